// Package substrate defines the isolation-technology interface that every
// sandbox substrate implements (DESIGN.md section 10). The request path
// (sbx-manager -> spaced-host -> spaced-guest) is the same for all of them;
// a substrate only has to start the guest agent inside an isolated
// environment, hand back a host-side endpoint for it and control the
// environment's lifecycle.
package substrate

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/spacesbx/space/internal/identity"
)

// Spec describes one activation of one execution.
type Spec struct {
	// Route is the execution identity being activated. It must validate.
	Route identity.Route
	// Template is the template name, e.g. "base".
	Template string
	// Dir is the per-activation state directory on the host. Substrates
	// create it if missing (mode 0700). Its layout is substrate specific
	// but a writable layer that survives Stop lives in a stable
	// subdirectory documented by the substrate (snapshots archive it).
	Dir string
	// AgentPath is the host path of the static spaced-guest binary to run
	// inside the sandbox.
	AgentPath string
	// AgentEnv is extra environment for the agent process, e.g.
	// SPACE_GUEST_CONFIG=...
	AgentEnv []string
	// Limits bounds the sandbox's resources; zero fields take the
	// substrate's defaults.
	Limits Limits
	// RestoreState, when set, is the path of a file written by
	// StateSaver.SaveState: the instance continues from that state (its
	// processes still running) instead of booting; or by
	// LayerSaver.SaveLayer: the instance boots with the saved files. The guest then still
	// holds the identity it had before; spaced-host activates it with
	// Route before anything is served. Substrates whose instances do not
	// implement StateSaver reject a non-empty RestoreState.
	RestoreState string
	// Network is the execution's way out (egress), nil for loopback only.
	// Substrates with Capabilities.Tap give Network.Tap to their VMM as
	// the guest's NIC; for the others (Capabilities.Netns) the manager
	// attaches a veth to InitPID's network namespace after Start.
	Network *Network
	// Image, when set, is the sandbox's root file system (a template built
	// from an OCI image, the Debian base or template build steps); nil runs
	// the substrate's built-in template named Template.
	Image *Image
	// Volumes are persistent directories mounted into the sandbox.
	Volumes []VolumeMount
}

// Image is a root file system as a stack of read-only layers plus the
// process defaults its builder recorded.
type Image struct {
	// ID names the stack's content (e.g. "sha256:<hex>" over the layer
	// IDs in order): substrates key what they derive from it (a flattened
	// disk image) by ID.
	ID string
	// Layers are host directories in overlayfs lower-layer form, bottom
	// first: whiteouts are 0:0 character devices, opaque directories carry
	// trusted.overlay.opaque=y and user.overlay.opaque=y, owners are the
	// image's own ids (the substrate maps them into the sandbox's user
	// namespace). The platform keeps them read-only and root-only (0700
	// parents): they may hold setuid files.
	Layers []string
	// Env (KEY=VALUE), WorkingDir and User are the defaults of processes
	// started in the sandbox; empty means the substrate's own.
	Env        []string
	WorkingDir string
	User       string
}

// VolumeMount is one persistent volume mounted into a sandbox.
type VolumeMount struct {
	// Name is the volume's name (its team's namespace), for errors and logs.
	Name string
	// Source is the host directory holding the volume's files (on its
	// quota-bounded file system), owned by the sandbox user's ids as the
	// substrate maps them.
	Source string
	// Path is the absolute mount point inside the sandbox.
	Path string
	// ReadOnly mounts it read-only.
	ReadOnly bool
}

// Network describes one execution's link to the worker's egress netns. The
// guest learns its side (address, gateway, resolver, CA) from the guest
// configuration; the substrate only needs Tap and MAC.
type Network struct {
	// Addr is the sandbox's address with the link's prefix (e.g.
	// 10.201.0.6/30); Gateway is the worker's side of the link, which is
	// also the sandbox's resolver.
	Addr    netip.Prefix
	Gateway netip.Addr
	// Tap is an open tap device (IFF_TAP|IFF_NO_PI) that lives in the
	// worker's egress network namespace. A substrate with
	// Capabilities.Tap passes it to its VMM (QEMU -netdev tap,fd=N); the
	// caller closes its own copy after Start returns. Nil otherwise.
	Tap *os.File
	// MAC is the guest NIC's address (locally administered).
	MAC net.HardwareAddr
}

// MaxSocketPath is the longest Unix socket path the kernel accepts
// (sun_path holds 108 bytes, the terminating NUL included).
const MaxSocketPath = 107

// Validate makes the checks every substrate runs on a spec before it
// starts anything: the route names substrate name, Dir is absolute and
// short enough for the socket socketName in it, and AgentPath is an
// absolute path to an executable file. Errors start with name (its
// substrate's prefix). Limits are not checked here: their bounds are the
// substrate's own.
func (s Spec) Validate(name, socketName string) error {
	if err := s.Route.Validate(); err != nil {
		return err
	}
	if s.Route.Substrate != name {
		return fmt.Errorf("%s: route names substrate %q", name, s.Route.Substrate)
	}
	if s.Dir == "" || !filepath.IsAbs(s.Dir) {
		return fmt.Errorf("%s: Dir must be an absolute path, got %q", name, s.Dir)
	}
	if n := len(filepath.Join(s.Dir, socketName)); n > MaxSocketPath {
		return fmt.Errorf("%s: Dir %q too long for a Unix socket path (%d bytes)", name, s.Dir, n)
	}
	if !filepath.IsAbs(s.AgentPath) {
		return fmt.Errorf("%s: AgentPath must be absolute, got %q", name, s.AgentPath)
	}
	fi, err := os.Stat(s.AgentPath)
	if err != nil {
		return fmt.Errorf("%s: agent: %w", name, err)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%s: agent %s is not an executable file", name, s.AgentPath)
	}
	return nil
}

// Limits bounds a sandbox's resources. A zero field means "substrate
// default"; substrates document their defaults (ns: 512 MiB memory without
// swap, 512 pids, 1000 millicores).
type Limits struct {
	// MemoryBytes caps resident memory (and swap: sandboxes get none).
	MemoryBytes int64
	// Pids caps the number of tasks (processes and threads).
	Pids int64
	// CPUMillis caps CPU bandwidth in thousandths of a CPU (1000 = 1 core).
	CPUMillis int64
	// DiskBytes caps the writable layer (a substrate without a quota
	// ignores it).
	DiskBytes int64
}

// LayerPreparer is implemented by substrates whose writable layer is a
// file tree on the host (a substrate without one keeps a sandbox's files
// elsewhere, e.g. in guest memory, and snapshots them with StateSaver).
// The layer may have to be made available (a disk mounted) before it is
// read or written outside a running instance: snapshots of a paused
// instance, restores before a start.
type LayerPreparer interface {
	// PrepareLayer makes the layer of activation directory dir available
	// and returns its root, upper (an overlay upper dir: whiteouts and
	// opaque markers as overlayfs keeps them); release undoes the
	// preparation and is safe to call twice.
	PrepareLayer(ctx context.Context, dir string, lim Limits) (upper string, release func() error, err error)
	// LayerDir is the root of the layer of activation directory dir as
	// this process reaches it while the layer is available (its instance
	// runs, or PrepareLayer holds it).
	LayerDir(dir string) string
}

// LayerSaver is implemented by substrates whose instances save their
// whole state (Capabilities.SavesState) yet may also keep their files on
// a disk of their own on the host (the microvm substrate's image VMs): an
// instance whose process died (its memory, its processes gone) comes back
// from those files, as a new instance that boots with them. The host
// never mounts such a disk: it is saved and restored as it is.
type LayerSaver interface {
	// HasLayer reports whether the activation of dir kept its files on a
	// disk of its own (false: they lived in its memory, and nothing of
	// them outlives its process).
	HasLayer(dir string) bool
	// SaveLayer writes that disk of the ended activation of dir to w as a
	// state for Spec.RestoreState, which Start boots a new instance from
	// (its processes start afresh: RestoreReporter), and returns the
	// bytes written. It refuses, with an error wrapping
	// errdefs.ErrConflict, a disk that a live instance may still write
	// (its process was not seen to end, or it still holds the disk), and
	// with one wrapping errdefs.ErrNotFound an activation without one.
	SaveLayer(ctx context.Context, dir string, w io.Writer) (int64, error)
}

// RestoreReporter is implemented by instances that tell what their start
// from Spec.RestoreState kept: the processes (a state written by
// StateSaver), or the files only (one written by LayerSaver: the instance
// booted). An instance without it kept its processes when it restored.
type RestoreReporter interface {
	ProcessesKept() bool
}

// Instance is one running activation.
type Instance interface {
	// Route is the identity the instance was activated with.
	Route() identity.Route
	// GuestSocket is the host path of the agent's Unix listening socket.
	// It is not visible inside the sandbox.
	GuestSocket() string
	// InitPID is the host pid of the sandbox's init/agent process (the
	// bridge verifies it and ties the guest listener to it).
	InitPID() int
	// Pause freezes every process of the sandbox and returns once they are
	// all frozen.
	Pause(ctx context.Context) error
	// Resume thaws a paused sandbox.
	Resume(ctx context.Context) error
	// Stop kills everything, unmounts, removes cgroups and the activation
	// directory's runtime bits. It is idempotent and must be called even
	// after Done is closed.
	Stop(ctx context.Context) error
	// Done is closed when the sandbox's init exits.
	Done() <-chan struct{}
}

// Substrate starts sandboxes of one isolation technology.
type Substrate interface {
	// Name is the substrate name carried in route identities
	// (identity.SubstrateNS, identity.SubstrateMicroVM, ...).
	Name() string
	// Capabilities says what this substrate's instances do where
	// substrates differ; callers act on it, never on Name.
	Capabilities() Capabilities
	// Start activates spec and returns once the guest agent's socket is
	// listening, or with an error after cleaning up what it created.
	Start(ctx context.Context, spec Spec) (Instance, error)
}

// Capabilities are what substrates differ in beyond the Instance
// interface. A new substrate declares them; sbx-manager reads them (and
// the optional interfaces LayerPreparer, StateSaver, StatsReporter) and
// never asks which substrate a route names.
type Capabilities struct {
	// SavesState: instances implement StateSaver and Start honours
	// Spec.RestoreState, so a snapshot is the instance's whole state
	// (memory, devices, files) and a move keeps its processes running;
	// such a snapshot exists only while the instance does. Without it a
	// snapshot archives the writable layer (LayerPreparer) and a move
	// restarts the processes, so a pause lets running commands finish
	// first.
	SavesState bool
	// Netns: the instance's init (InitPID) runs in a network namespace of
	// its own on the host, which the service-port gateway (netgtw) enters
	// to reach the sandbox's ports. Without it the sandbox has no service
	// ports.
	Netns bool
	// Activation: GuestSocket is a VMM's chardev serving one connection
	// that spaced-host multiplexes (bridge.ChannelVM), and the agent takes
	// its guest configuration from spaced-host's activation message sent
	// over it (again after a restore). Without it GuestSocket is the
	// agent's own listener, InitPID is the agent (running Spec.AgentPath)
	// and the agent reads its configuration from Spec.AgentEnv
	// (SPACE_GUEST_CONFIG) at start.
	Activation bool
	// Tap: the instance's NIC is Spec.Network.Tap (a microVM). Without it
	// the instance's network namespace (Netns) gets a veth from the
	// manager; with neither the sandbox has no way out.
	Tap bool
}

// Reclaimer is implemented by substrates whose instances can outlive the
// process that started them (ns sandboxes do): after a worker restart,
// Reclaim ends what is left of route's activation in dir (an instance
// that is not adopted) and releases what it held, keeping its files.
// Idempotent; nothing left is not an error.
type Reclaimer interface {
	Reclaim(ctx context.Context, route identity.Route, dir string) error
}

// Sweeper is implemented by substrates whose instances outlive the
// process that started them and can be listed without a record (ns: the
// cgroups under its parent, which belongs to one worker). A worker calls
// Sweep at start, before it starts or adopts anything: an instance started
// but never recorded (the worker died between the start and the record's
// write), or anything else a crash left, would otherwise run on unseen.
// Sweep offers keep the name of each instance it finds,
// "<SandboxID>-<ActivationID>" of its route, and ends (like Reclaim) each
// one keep rejects, keeping its files; swept counts them.
type Sweeper interface {
	Sweep(ctx context.Context, keep func(cgroupName string) bool) (swept int, err error)
}

// Adopter is implemented by substrates whose instances outlive the
// process that started them: nothing ties a sandbox's life to its
// worker's, so a worker binary can be restarted or upgraded (or crash)
// under running sandboxes. After a restart, Adopt takes over the running
// activation of spec from the state its instance reported when it was
// started (Adoptable.AdoptState, persisted by the caller with its record).
// Before it returns the instance, Adopt verifies that what runs is that
// very activation: the init by pidfd and start time, its executable, its
// cgroups or VMM, its guest socket, and it takes back what the instance
// holds on the host (its uid range, its layer). When any check fails it
// returns an error wrapping ErrNotAdoptable (or a context error) and
// leaves everything as it found it: the caller then reclaims the
// leftovers (Reclaimer) and recovers the execution, never serves it.
// An adopted instance that was paused is still paused (Adoptable.Paused).
type Adopter interface {
	Adopt(ctx context.Context, spec Spec, state []byte) (Instance, error)
}

// ErrNotAdoptable is the class of Adopter.Adopt's verification failures:
// what runs is not (or no longer) the recorded activation.
var ErrNotAdoptable = errors.New("not adoptable")

// Adoptable is implemented by the instances of an Adopter.
type Adoptable interface {
	// AdoptState is what Adopter.Adopt needs to find and verify this
	// instance (JSON, opaque to the caller). It is fixed once Start has
	// returned.
	AdoptState() []byte
	// Paused reports whether the instance is paused (frozen) now.
	Paused() bool
	// Detach lets go of what this process holds for the instance
	// (descriptors, watchers, its uid range and layer references) and
	// leaves it running, to be adopted by the next process. The instance
	// must not be used afterwards; Done is not closed by it.
	Detach()
}

// Availability is implemented by substrates whose usability depends on
// the host and was found when they were made (the microvm substrate boots
// a probe guest under each accelerator). It is optional: callers check for
// it by type assertion; a substrate without it is always available.
type Availability interface {
	// Unavailable says why no instance can start here, or "" when they
	// can.
	Unavailable() string
	// Accel names the accelerator instances run on ("kvm", "tcg"), or ""
	// when none works.
	Accel() string
}

// Stats is one sample of an instance's resource usage.
type Stats struct {
	// Timestamp is when the sample was taken.
	Timestamp time.Time
	// CPUCount is the number of CPUs the sandbox may use (its CPU limit
	// rounded up to whole cores).
	CPUCount int
	// CPUUsedPct is the CPU time used over the sampling interval as a
	// percentage of one core (so up to 100*CPUCount).
	CPUUsedPct float64
	// MemUsed and MemTotal are the memory charged to the sandbox and its
	// limit, in bytes; MemCache is the page cache part of MemUsed.
	MemUsed, MemTotal, MemCache int64
	// DiskUsed is the size of the sandbox's writable layer in bytes;
	// DiskTotal is its capacity, 0 when the substrate has none.
	DiskUsed, DiskTotal int64
}

// StatsReporter is implemented by instances that can report their
// resource usage. It is optional: callers check for it by type assertion.
type StatsReporter interface {
	// Stats samples the instance's usage. It may block briefly (a CPU
	// percentage needs two readings) but never longer than ctx allows.
	Stats(ctx context.Context) (Stats, error)
}

// StateSaver is implemented by instances whose complete state (memory,
// devices and disk) can be written out, so that an instance restored from
// it on another worker continues the same processes (the microvm
// substrate). The ns substrate does not implement it: its snapshots are
// archives of the writable layer and a move restarts processes.
type StateSaver interface {
	// SaveState writes the instance's state to w and returns the number of
	// bytes written. The instance must be paused and stays paused.
	SaveState(ctx context.Context, w io.Writer) (int64, error)
}
