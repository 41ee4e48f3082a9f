package microvm

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/spacesbx/space/internal/substrate"
)

// Defaults applied by Config.withDefaults and to zero Spec.Limits fields.
const (
	DefaultQEMUPath    = "/usr/bin/qemu-system-x86_64"
	DefaultBusyboxPath = "/bin/busybox"
	// DefaultRootDiskDir is the machine-wide cache of flattened images
	// (rootdisk.go), shared by every worker of the host.
	DefaultRootDiskDir       = "/var/cache/space/vm-images"
	DefaultMemoryBytes int64 = 256 << 20
	DefaultCPUMillis   int64 = 1000
	// MinMemoryBytes is the smallest guest that boots the kernel, unpacks
	// the initramfs (agent included) and still has room for user work.
	MinMemoryBytes int64 = 128 << 20
	// MaxVCPUs bounds ceil(CPUMillis/1000).
	MaxVCPUs            = 32
	DefaultStartTimeout = 30 * time.Second
	DefaultStopTimeout  = 5 * time.Second
	// DefaultUIDFirst and DefaultUIDCount are the host uid (and gid) range
	// QEMU processes run as when the substrate runs as root: one uid per
	// running instance, unused by any account.
	DefaultUIDFirst   uint32 = 2_100_000_000
	DefaultUIDCount   uint32 = 10_000
	DefaultUIDLockDir        = "/run/space/microvm-uids"
	// DefaultKVMGroup is the gid /dev/kvm's ACL admits and every QEMU
	// under KVM carries as its only supplementary group: one below the uid
	// range, unused by any account or file.
	DefaultKVMGroup uint32 = DefaultUIDFirst - 1
	// DefaultProbeTimeout bounds the KVM probe boot (a real KVM boots the
	// probe guest in well under a second; a KVM that cannot run the guest
	// kernel hangs it). DefaultProbeTimeoutTCG bounds the TCG probe, which
	// emulates every instruction and shares 2 cores with the tests.
	DefaultProbeTimeout    = 3 * time.Second
	DefaultProbeTimeoutTCG = 30 * time.Second
)

// Layer disk sizes.
const (
	DefaultDiskBytes int64 = 4 << 30
	MinDiskBytes     int64 = 64 << 20
	MaxDiskBytes     int64 = 1 << 40
)

// Config configures the microvm substrate.
type Config struct {
	// StateDir holds substrate-wide state; guest images are cached under
	// StateDir/images/<sha256>.cpio.gz. Required, absolute.
	StateDir string
	// QEMUPath is the qemu-system-x86_64 binary (default
	// DefaultQEMUPath). QEMU 7.2 or later.
	QEMUPath string
	// KernelPath is the guest kernel (a bzImage, e.g. Debian's
	// linux-image-cloud-amd64 vmlinuz; `make vm-deps` extracts one to
	// .cache/vm/kernel/vmlinuz). Required, absolute.
	KernelPath string
	// ModulesDir is the kernel's lib/modules/<version> directory; the
	// virtio_mmio, virtio_console and qemu_fw_cfg drivers and what they
	// depend on (modules.dep, else each module's modinfo) are copied from
	// it into the image. Required, absolute.
	ModulesDir string
	// BusyboxPath is a static busybox, the guest's userland (default
	// DefaultBusyboxPath, from Debian's busybox-static).
	BusyboxPath string
	// RootDiskDir caches the read-only ext4 disks flattened from
	// Spec.Image layer stacks, one per Image.ID (default
	// DefaultRootDiskDir; made 0700).
	RootDiskDir string
	// MkfsPath is mkfs.ext4 (default: found in PATH, /usr/sbin, /sbin;
	// e2fsprogs). Only image VMs need it.
	MkfsPath string
	// Limits are the defaults for zero Spec.Limits fields. Zero fields
	// here take DefaultMemoryBytes, DefaultCPUMillis and DefaultDiskBytes
	// (an image VM's writable layer disk). Pids is not enforced (the
	// guest kernel is the boundary).
	Limits substrate.Limits
	// Accel forces "kvm" or "tcg". Empty (the default): New boots a tiny
	// probe guest under KVM (when /dev/kvm exists), then TCG, and uses the
	// first that reaches its ready line; with none the substrate is
	// unavailable (see Substrate.Unavailable).
	Accel string
	// ProbeTimeout and ProbeTimeoutTCG bound each probe boot (defaults
	// DefaultProbeTimeout, DefaultProbeTimeoutTCG).
	ProbeTimeout, ProbeTimeoutTCG time.Duration
	// KVMGroup is the gid QEMU gets /dev/kvm through (a rw entry in the
	// device's access ACL; the device's owner and mode are left alone).
	// Default DefaultKVMGroup; must lie outside the uid range.
	KVMGroup uint32
	// UIDFirst and UIDCount are the host uid range (uid = gid) QEMU runs
	// in when the substrate runs as root: every instance gets a uid of its
	// own, held by an flock in UIDLockDir for its lifetime (defaults
	// DefaultUIDFirst, DefaultUIDCount, DefaultUIDLockDir; the lock dir is
	// host-wide so several workers on one host never share a uid). Not
	// root: QEMU runs as the caller.
	UIDFirst, UIDCount uint32
	UIDLockDir         string
	// ZeroFreedMemory boots guests with init_on_free=1: the guest kernel
	// zeroes every page it frees, and QEMU's migration sends zero pages as
	// flags, so SaveState writes less (measured with a 256 MiB busybox
	// guest: 55 MiB instead of 93 MiB, 160 ms instead of 600 ms) at the
	// price of host memory: zeroing touches the whole guest RAM at boot, so
	// QEMU's resident guest RAM is MemoryBytes at once (instead of 130 MiB
	// for the same guest). Default off (host density first).
	ZeroFreedMemory bool
	// StartTimeout bounds Start when the caller's context has no earlier
	// deadline (default 30 s: image building and a restore included).
	StartTimeout time.Duration
	// StopTimeout bounds the graceful part of Stop (QMP quit) before
	// SIGKILL (default 5 s).
	StopTimeout time.Duration
	// PrewarmAgent, when set (the agent binary sandboxes will run), makes
	// New start building the template for the default limits in the
	// background, so the first create is a clone too. Default: templates
	// are built by the first Start that needs one.
	PrewarmAgent string
	// Images gives templates an image to boot when a spec names none
	// (template name -> image; e.g. base-vm -> the Debian base). Their
	// VMs run the image's userland instead of busybox; PrewarmAgent
	// prewarms their templates (the image's disk flattened first).
	Images map[string]substrate.Image
	// TCGCacheMiB bounds TCG's translated-code cache per VM (QEMU's
	// tb-size; 0: QEMU's default). Only under TCG.
	TCGCacheMiB int
	// NoTemplates turns template snapshots off: every sandbox boots cold
	// (default: clones of a per-image, per-shape template; see
	// template.go).
	NoTemplates bool
	// Logger receives lifecycle logs (default slog.Default()).
	Logger *slog.Logger

	// testMode, when set, is passed as space.test=<mode> on the kernel
	// command line: the init runs a test loop on the channel instead of
	// the agent (see initScript). Tests only.
	testMode string
}

// withDefaults returns c with its zero fields set to the defaults above.
func (c Config) withDefaults() Config {
	if c.QEMUPath == "" {
		c.QEMUPath = DefaultQEMUPath
	}
	if c.BusyboxPath == "" {
		c.BusyboxPath = DefaultBusyboxPath
	}
	if c.Limits.MemoryBytes == 0 {
		c.Limits.MemoryBytes = DefaultMemoryBytes
	}
	if c.Limits.CPUMillis == 0 {
		c.Limits.CPUMillis = DefaultCPUMillis
	}
	if c.Limits.DiskBytes == 0 {
		c.Limits.DiskBytes = DefaultDiskBytes
	}
	if c.RootDiskDir == "" {
		c.RootDiskDir = DefaultRootDiskDir
	}
	if c.UIDFirst == 0 {
		c.UIDFirst = DefaultUIDFirst
	}
	if c.UIDCount == 0 {
		c.UIDCount = DefaultUIDCount
	}
	if c.UIDLockDir == "" {
		c.UIDLockDir = DefaultUIDLockDir
	}
	if c.StartTimeout == 0 {
		c.StartTimeout = DefaultStartTimeout
	}
	if c.ProbeTimeout == 0 {
		c.ProbeTimeout = DefaultProbeTimeout
	}
	if c.ProbeTimeoutTCG == 0 {
		c.ProbeTimeoutTCG = DefaultProbeTimeoutTCG
	}
	if c.KVMGroup == 0 {
		c.KVMGroup = c.UIDFirst - 1
	}
	if c.StopTimeout == 0 {
		c.StopTimeout = DefaultStopTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate reports whether c is usable. It only checks (a field left zero
// takes its default and is valid) and does not touch the file system; New
// checks that the files exist.
func (c Config) Validate() error {
	for _, p := range []struct {
		name, v  string
		required bool
	}{
		{"StateDir", c.StateDir, true}, {"QEMUPath", c.QEMUPath, false}, {"KernelPath", c.KernelPath, true},
		{"ModulesDir", c.ModulesDir, true}, {"BusyboxPath", c.BusyboxPath, false}, {"UIDLockDir", c.UIDLockDir, false},
		{"RootDiskDir", c.RootDiskDir, false}, {"MkfsPath", c.MkfsPath, false},
	} {
		if (p.required || p.v != "") && !filepath.IsAbs(p.v) {
			return fmt.Errorf("microvm: %s must be an absolute path, got %q", p.name, p.v)
		}
	}
	switch c.Accel {
	case "", "kvm", "tcg":
	default:
		return fmt.Errorf("microvm: Accel must be \"kvm\", \"tcg\" or empty, got %q", c.Accel)
	}
	// The ranges in effect: each bound may be left to its default.
	first, count := cmp.Or(c.UIDFirst, DefaultUIDFirst), cmp.Or(c.UIDCount, DefaultUIDCount)
	kvmGroup := cmp.Or(c.KVMGroup, first-1)
	if uint64(first)+uint64(count) > 1<<31 || first < 1000 {
		return fmt.Errorf("microvm: uid range %d+%d must lie within [1000, 2^31)", first, count)
	}
	if kvmGroup < 1000 || (kvmGroup >= first && uint64(kvmGroup) < uint64(first)+uint64(count)) {
		return fmt.Errorf("microvm: KVMGroup %d must be at least 1000 and outside the uid range %d+%d", kvmGroup, first, count)
	}
	if c.StartTimeout < 0 || c.StopTimeout < 0 || c.ProbeTimeout < 0 || c.ProbeTimeoutTCG < 0 {
		return errors.New("microvm: timeouts must not be negative")
	}
	return validateLimits(c.Limits)
}

func validateLimits(l substrate.Limits) error {
	switch {
	case l.MemoryBytes < 0 || (l.MemoryBytes > 0 && l.MemoryBytes < MinMemoryBytes):
		return fmt.Errorf("microvm: memory limit %d must be at least %d MiB", l.MemoryBytes, MinMemoryBytes>>20)
	case l.MemoryBytes > 1<<40:
		return fmt.Errorf("microvm: memory limit %d is too large", l.MemoryBytes)
	case l.CPUMillis < 0 || l.CPUMillis > MaxVCPUs*1000:
		return fmt.Errorf("microvm: cpu limit %d must be between 0 and %d millicores", l.CPUMillis, MaxVCPUs*1000)
	case l.Pids < 0:
		return fmt.Errorf("microvm: pids limit %d must not be negative", l.Pids)
	case l.DiskBytes < 0 || l.DiskBytes > MaxDiskBytes:
		// The lower bound (MinDiskBytes) holds for image VMs only: others
		// have no disk.
		return fmt.Errorf("microvm: disk limit %d must be between 0 and %d GiB", l.DiskBytes, MaxDiskBytes>>30)
	}
	return nil
}

// mergeLimits fills zero fields of l from def.
func mergeLimits(l, def substrate.Limits) substrate.Limits {
	if l.MemoryBytes == 0 {
		l.MemoryBytes = def.MemoryBytes
	}
	if l.CPUMillis == 0 {
		l.CPUMillis = def.CPUMillis
	}
	if l.Pids == 0 {
		l.Pids = def.Pids
	}
	if l.DiskBytes == 0 {
		l.DiskBytes = def.DiskBytes
	}
	return l
}

// machineShape is what the guest's memory layout depends on: a restored
// state must be loaded into the same shape.
type machineShape struct {
	MemoryMiB int64 `json:"memory_mib"`
	VCPUs     int   `json:"vcpus"`
}

func shapeOf(l substrate.Limits) machineShape {
	return machineShape{
		MemoryMiB: (l.MemoryBytes + (1<<20 - 1)) >> 20,
		VCPUs:     int(max((l.CPUMillis+999)/1000, 1)),
	}
}
