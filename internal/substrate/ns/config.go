package ns

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"time"

	"github.com/spacesbx/space/internal/substrate"
)

// Defaults applied by Config.withDefaults and to zero Spec.Limits fields.
const (
	DefaultCgroupParent       = "space"
	DefaultMemoryBytes  int64 = 512 << 20
	DefaultPids         int64 = 512
	DefaultCPUMillis    int64 = 1000
	DefaultStartTimeout       = 15 * time.Second
	DefaultUsrDir             = "/usr"
	// DefaultMaxPTYs caps the pseudo-terminals one sandbox may hold (its
	// devpts instance's max=): the host's kernel.pty.max is shared by
	// every sandbox's devpts (beyond kernel.pty.reserve), so without a cap
	// one sandbox could take them all.
	DefaultMaxPTYs = 128
	// DefaultDiskSizeMB is the writable layer's quota when neither the
	// sandbox nor Config.Limits names one.
	DefaultDiskSizeMB = 4096
	// MinDiskSizeMB is the smallest layer disk (smaller quotas round up).
	MinDiskSizeMB = 32
)

// usernsSize is the number of ids each sandbox maps (0..65535: nobody
// and nogroup included).
const usernsSize = 1 << 16

// Default uid ranges of the ns substrate: [DefaultUIDRangeFirst,
// +DefaultUIDRangeCount*65536) ends below the microvm substrate's QEMU
// uids (2,100,000,000).
const (
	DefaultUIDRangeFirst uint32 = 1 << 20
	DefaultUIDRangeCount uint32 = 16384
	DefaultUIDLockDir           = "/run/space/ns-uids"
)

// Config configures the ns substrate.
type Config struct {
	// StateDir holds substrate-wide state; templates are built under
	// StateDir/templates/<name>. Required, absolute. It must live on a
	// filesystem that overlayfs accepts as a lower layer (ext4, xfs,
	// btrfs, tmpfs; not overlayfs itself).
	StateDir string
	// CgroupParent is the cgroup (relative to the root of each hierarchy)
	// under which sandbox groups are created: <parent>/<sandbox>-<activation>.
	// One or more '/'-separated components of letters, digits, '-', '_'
	// or '.' (none starting with '.'), e.g. "space/w1". Default "space".
	// The parent (and the groups above it) is created on demand and left
	// in place (empty) so concurrent starts never race its removal. Sweep
	// ends whatever it finds directly under the parent, so every process
	// that runs sandboxes on a host needs a parent of its own (a worker:
	// space/<worker id>.<data dir hash>, as internal/node sets it).
	CgroupParent string
	// Limits are the defaults for zero Spec.Limits fields. Zero fields
	// here take DefaultMemoryBytes, DefaultPids, DefaultCPUMillis and
	// DefaultDiskSizeMB (the writable layer's quota).
	Limits substrate.Limits
	// UsrDir is the host directory bind-mounted read-only at /usr inside
	// every sandbox of the built-in host template (default "/usr"). It
	// must be a merged-usr tree containing bin/sh.
	UsrDir string
	// Images are the root file systems of named templates: a Spec without
	// an Image whose Template is named here runs that image (image.go;
	// internal/node gives "base" the Debian base image). Other templates,
	// and TemplateBaseHost always, run the built-in host template (a
	// generated /etc over the host's UsrDir).
	Images map[string]substrate.Image
	// StartTimeout bounds Start when the caller's context has no earlier
	// deadline (default 15 s).
	StartTimeout time.Duration
	// InitPath is the binary started as each sandbox's init; it must call
	// MaybeInit first in main (cmd/space-nsinit does nothing else). Empty:
	// the hosting binary re-executes itself (/proc/self/exe). A small init
	// binary starts in about a millisecond, where a worker binary's
	// package initialization (etcd, gRPC, Prometheus) takes about 15 ms
	// on every sandbox start. Absolute; trusted like the hosting binary.
	InitPath string
	// NoUserNamespaces runs sandboxes without a user namespace (root in a
	// sandbox is then root on the host as far as uid checks go). By
	// default each sandbox gets one (userns.go) when the kernel supports
	// it; New logs why when it does not.
	NoUserNamespaces bool
	// UIDRangeFirst, UIDRangeCount and UIDLockDir: each sandbox's user
	// namespace maps 65536 ids to a host range [first + k*65536, +65536),
	// k < count, held by an flock in UIDLockDir (machine-wide, shared by
	// every worker on the host) while the sandbox runs. Defaults
	// DefaultUIDRangeFirst, DefaultUIDRangeCount, DefaultUIDLockDir.
	UIDRangeFirst, UIDRangeCount uint32
	UIDLockDir                   string
	// MaxPTYs is the most pseudo-terminals one sandbox may hold at once
	// (default DefaultMaxPTYs).
	MaxPTYs int
	// NoDiskQuota keeps each sandbox's writable layer in a plain
	// directory instead of a layer disk of its own (disk.go, layer.go).
	// By default the layer is a disk of Limits.DiskBytes when the host
	// can make one (mkfs.ext4, loop devices); New logs why when it cannot.
	NoDiskQuota bool
	// NoWarmInit turns off starting each next sandbox's init ahead of time
	// (warm.go; cgroup v1 only).
	NoWarmInit bool
	// Logger receives lifecycle logs (default slog.Default()).
	Logger *slog.Logger
}

// withDefaults returns c with its zero fields set to the defaults above.
func (c Config) withDefaults() Config {
	if c.CgroupParent == "" {
		c.CgroupParent = DefaultCgroupParent
	}
	if c.Limits.MemoryBytes == 0 {
		c.Limits.MemoryBytes = DefaultMemoryBytes
	}
	if c.Limits.Pids == 0 {
		c.Limits.Pids = DefaultPids
	}
	if c.Limits.CPUMillis == 0 {
		c.Limits.CPUMillis = DefaultCPUMillis
	}
	if c.Limits.DiskBytes == 0 {
		c.Limits.DiskBytes = DefaultDiskSizeMB << 20
	}
	if c.UsrDir == "" {
		c.UsrDir = DefaultUsrDir
	}
	if c.StartTimeout == 0 {
		c.StartTimeout = DefaultStartTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.UIDRangeFirst == 0 {
		c.UIDRangeFirst = DefaultUIDRangeFirst
	}
	if c.UIDRangeCount == 0 {
		c.UIDRangeCount = DefaultUIDRangeCount
	}
	if c.UIDLockDir == "" {
		c.UIDLockDir = DefaultUIDLockDir
	}
	if c.MaxPTYs == 0 {
		c.MaxPTYs = DefaultMaxPTYs
	}
	return c
}

// Validate reports whether c is usable. It only checks: a field left zero
// takes its default (withDefaults) and is valid.
func (c Config) Validate() error {
	if c.StateDir == "" || !filepath.IsAbs(c.StateDir) {
		return fmt.Errorf("ns: StateDir must be an absolute path, got %q", c.StateDir)
	}
	if c.CgroupParent != "" && !validCgroupParent(c.CgroupParent) {
		return fmt.Errorf("ns: CgroupParent %q must be '/'-separated path components of [A-Za-z0-9._-]", c.CgroupParent)
	}
	for name, img := range c.Images {
		if err := validateImage(&img); err != nil {
			return fmt.Errorf("ns: image of template %q: %w", name, err)
		}
	}
	if c.UsrDir != "" && !filepath.IsAbs(c.UsrDir) {
		return fmt.Errorf("ns: UsrDir must be absolute, got %q", c.UsrDir)
	}
	if c.StartTimeout < 0 {
		return errors.New("ns: StartTimeout must not be negative")
	}
	if c.InitPath != "" && !filepath.IsAbs(c.InitPath) {
		return fmt.Errorf("ns: InitPath must be absolute, got %q", c.InitPath)
	}
	// The range in effect: either bound may be left to its default.
	first, count := cmp.Or(c.UIDRangeFirst, DefaultUIDRangeFirst), cmp.Or(c.UIDRangeCount, DefaultUIDRangeCount)
	if first < 65536 || uint64(first)+uint64(count)*usernsSize > 1<<31 {
		return fmt.Errorf("ns: uid ranges %d+%d*65536 must lie within [65536, 2^31)", first, count)
	}
	if c.UIDLockDir != "" && !filepath.IsAbs(c.UIDLockDir) {
		return fmt.Errorf("ns: UIDLockDir must be absolute, got %q", c.UIDLockDir)
	}
	if c.MaxPTYs < 0 || c.MaxPTYs > 1<<20 {
		return fmt.Errorf("ns: MaxPTYs %d must be in [1, 2^20]", c.MaxPTYs)
	}
	return validateLimits(c.Limits)
}

func validateLimits(l substrate.Limits) error {
	switch {
	case l.MemoryBytes < 0 || (l.MemoryBytes > 0 && l.MemoryBytes < 16<<20):
		return fmt.Errorf("ns: memory limit %d must be at least 16 MiB", l.MemoryBytes)
	case l.Pids < 0 || (l.Pids > 0 && l.Pids < 16):
		return fmt.Errorf("ns: pids limit %d must be at least 16", l.Pids)
	case l.CPUMillis < 0 || (l.CPUMillis > 0 && l.CPUMillis < 10):
		return fmt.Errorf("ns: cpu limit %d must be at least 10 millicores", l.CPUMillis)
	case l.DiskBytes < 0 || l.DiskBytes > 1<<44:
		return fmt.Errorf("ns: disk limit %d must be between 0 and 16 TiB", l.DiskBytes)
	}
	return nil
}

// mergeLimits fills zero fields of l from def.
func mergeLimits(l, def substrate.Limits) substrate.Limits {
	if l.MemoryBytes == 0 {
		l.MemoryBytes = def.MemoryBytes
	}
	if l.Pids == 0 {
		l.Pids = def.Pids
	}
	if l.CPUMillis == 0 {
		l.CPUMillis = def.CPUMillis
	}
	if l.DiskBytes == 0 {
		l.DiskBytes = def.DiskBytes
	}
	return l
}

// maxCgroupParentDepth bounds CgroupParent's components.
const maxCgroupParentDepth = 8

// validCgroupParent reports whether p is a relative path of safe
// components (no empty, "." or ".." ones).
func validCgroupParent(p string) bool {
	parts := strings.Split(p, "/")
	if len(parts) > maxCgroupParentDepth {
		return false
	}
	for _, c := range parts {
		if !validComponent(c) {
			return false
		}
	}
	return true
}

// validComponent reports whether s is a safe single path component.
func validComponent(s string) bool {
	if s == "" || len(s) > 128 || s == "." || s == ".." || strings.HasPrefix(s, ".") {
		return false
	}
	for _, c := range s {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '_', c == '.':
		default:
			return false
		}
	}
	return true
}
