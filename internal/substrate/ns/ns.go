//go:build linux

// Package ns is the default SPACE substrate: sandboxes built from Linux
// namespaces, an overlay root filesystem, cgroups, capabilities and
// seccomp. It runs on any Linux host as root.
//
// # Isolation
//
// Start re-executes the host binary (/proc/self/exe, or Config.InitPath)
// with argv[0] "space-nsinit" in a session of its own (no controlling
// terminal: nothing in a sandbox can reach the terminal of whoever started
// the worker) and in new user, mount, pid, network, IPC, UTS and cgroup
// namespaces. The user namespace (userns.go; Config.NoUserNamespaces or a
// kernel older than 5.19 turns it off, with a warning) maps the sandbox's
// ids 0-65535 to a host range leased for the instance: root in a sandbox
// is an unprivileged uid on the host, per-user kernel limits are counted
// per sandbox, and sudo works inside (no no_new_privs there). Files keep
// the owners they have inside, on disk and in snapshots (idmapped mounts).
// The layers below hold with or without it:
//
//   - root filesystem: overlayfs with Spec.Dir/upper as the writable layer
//     over either an image's layers (Spec.Image, or Config.Images for the
//     template: image.go; no host path at all) or the built-in host
//     template (a generated /etc) with the host's /usr bind-mounted
//     read-only,nosuid,nodev; always nodev, and nosuid except for an image
//     in a user namespace (its sudo makes root of that namespace only); a fresh /proc
//     (with /proc/sys, /proc/sysrq-trigger, ... read-only and /proc/kcore,
//     /proc/keys, ... masked); /dev a read-only tmpfs with null, zero, full,
//     random, urandom and tty bound from the host, a private devpts and
//     /dev/shm; no /sys; the agent bound read-only at /.space/spaced-guest;
//   - pivot_root with the old root detached: no host path is reachable;
//   - network: a new namespace with only lo up (no route anywhere);
//   - capabilities: bounding, permitted and effective sets cut to Docker's
//     default set; inheritable and ambient empty; no_new_privs without a
//     user namespace;
//   - seccomp: x86_64 only (x32 refused), mount/namespace/kernel/clock/
//     keyring/ptrace syscalls fail with EPERM, clone3 with ENOSYS and clone
//     with CLONE_NEW* flags with EPERM; io_uring, pidfd_getfd, kcmp and
//     process_madvise are refused too;
//   - descriptors: the init marks everything above its own close-on-exec,
//     so nothing the worker inherited reaches the agent;
//   - pseudo-terminals: the sandbox's devpts instance holds at most
//     Config.MaxPTYs (the host's kernel.pty.max is shared);
//   - cgroups (v1 or pure v2): memory without swap, pids, cpu bandwidth and
//     the freezer (Pause/Resume), in <CgroupParent>/<sandbox>-<activation>
//     relative to the root of each hierarchy: the group of the user's
//     processes. The agent lives in the sibling group
//     <CgroupParent>/agent.<sandbox>-<activation> of the pids hierarchy (v2:
//     of the unified one, with the same memory and cpu limits) with a pids
//     reserve of its own (agentPids), so a fork bomb that fills the
//     sandbox's pids.max cannot starve it of threads; Pause freezes both.
//
// # Activation directory (Spec.Dir)
//
// Start creates Spec.Dir (0700) if needed and uses:
//
//	layer.img   the layer disk (disk.go): a sparse ext4 image of the
//	            quota's size holding the writable layer; survives Stop
//	            (snapshots archive it; the next activation on the same
//	            Dir continues from it). Absent without the disk quota.
//	layer/      without the disk quota, the writable layer: upper/ and
//	            work/ (overlayfs's). With it, an empty directory: the
//	            disk is mounted detached while the layer is held (an
//	            instance runs, or PrepareLayer; layer.go), and an init
//	            without a user namespace attaches its copy here.
//	rootfs/     the overlay mount point without a user namespace (the
//	            mount exists only in the sandbox's mount namespace; the
//	            empty dir is removed by Stop)
//	guest.sock  the agent's listening socket (removed by Stop)
//	agent.log   the agent's stdout/stderr, capped at 4 MiB (kept)
//
// A caller that no longer needs the writable layer removes Spec.Dir after
// Stop.
//
// The agent (Spec.AgentPath) runs as pid 1 of the sandbox with fd 3 a
// listening Unix socket bound at Spec.Dir/guest.sock, fd 4 the user group's
// cgroup.procs open for writing (opened on the host, so the kernel checks
// the move with the host's credentials and cgroup namespace), uid 0, a
// clean environment (PATH, HOME=/root, LANG, TERM, HOSTNAME,
// SPACE_SANDBOX_ID, SPACE_LISTEN_FD=3, SPACE_CGROUP_FD=4) plus
// Spec.AgentEnv. Being pid 1 it must reap orphans. It must move every
// process it starts for the user into the user group before the process
// runs user code (spaced-guest does, through internal/guest/cgexec); what
// it leaves in its own group is held only by the agent's pids reserve.
//
// # Hosting binaries
//
// Unless Config.InitPath names a small init binary (cmd/space-nsinit;
// space up and space-node use it when it is in their bin directory),
// every binary that hosts the substrate re-executes itself as the sandbox
// init, so it must call MaybeInit as the first statement of main():
//
//	func main() {
//		ns.MaybeInit() // returns unless this process is a sandbox init
//		...
//	}
//
// Sandboxes outlive the hosting process: a worker restart or upgrade
// leaves them running and the next process takes them over (Adopt,
// adopt.go; Sweep ends the ones nobody recorded, sweep.go). Only an init
// not yet claimed by a Start (a warm one, one being configured) dies with
// the process (parent-death signal, cleared by the init right before it
// execs the agent); inits are forked from one dedicated locked OS thread
// that lives until Close, so Go retiring threads never kills them.
//
// # Known limits
//
// /sys is
// absent; the sandbox's /proc/self/mountinfo shows the host paths of the
// overlay layers; the sandbox's cgroup namespace is rooted at the agent's
// groups, so user processes see their pids group (v2: their group) as
// /../<sandbox>-<activation>.
package ns

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/substrate/spawner"
)

// Names of the entries of an activation directory (DiskMountName and
// DiskImageName are in disk.go).
const (
	rootfsDir  = "rootfs"
	SocketName = "guest.sock"
	LogName    = "agent.log"
	maxLogSize = 4 << 20
)

// cloneFlags are the namespaces of a sandbox (no CLONE_NEWUSER: root-mapped).
const cloneFlags = unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWNET |
	unix.CLONE_NEWIPC | unix.CLONE_NEWUTS | unix.CLONE_NEWCGROUP

// Substrate is the ns substrate. It is safe for concurrent use.
type Substrate struct {
	cfg     Config
	cgroups *cgroupLayout
	// userns: sandboxes get user namespaces (userns.go).
	userns bool
	// quota: writable layers are layer disks (disk.go); layers holds the
	// ones in use (layer.go).
	quota   bool
	layerMu sync.Mutex
	layers  map[string]*layerRef
	// lastLoop: the loop device each image was last mounted through
	// (layer.go: an image is never mounted twice at once).
	lastLoop map[string]string
	// The spare layer disk (spare.go).
	spareMu sync.Mutex
	spare   *spareDisk
	sparing bool

	tmplMu    sync.Mutex
	tmplReady map[string]bool

	// spawner starts sandbox inits: their parent-death signal is tied to
	// the forking thread.
	spawner spawner.Spawner

	// The warm init (warm.go): at most one, started ahead of a Start.
	warmMu  sync.Mutex
	warm    *spawned
	warming bool
	closed  bool
	warmWG  sync.WaitGroup

	// live names the groups of the inits this substrate runs (started,
	// warm or adopted): Sweep never ends them.
	liveMu sync.Mutex
	live   map[string]bool
}

// setLive records whether the groups named name belong to an init this
// substrate runs.
func (s *Substrate) setLive(name string, on bool) {
	s.liveMu.Lock()
	defer s.liveMu.Unlock()
	if on {
		s.live[name] = true
	} else {
		delete(s.live, name)
	}
}

var _ substrate.Substrate = (*Substrate)(nil)

// New checks the host (root, cgroups) and returns a substrate. Templates
// are built lazily by the first Start that needs them.
func New(cfg Config) (*Substrate, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("ns: the ns substrate needs root")
	}
	layout, err := detectCgroups()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, err
	}
	s := &Substrate{cfg: cfg, cgroups: layout, tmplReady: map[string]bool{}, layers: map[string]*layerRef{}, lastLoop: map[string]string{},
		live: map[string]bool{}}
	if !cfg.NoDiskQuota {
		if why := diskQuotaUnsupported(); why != "" {
			cfg.Logger.Warn("ns: sandboxes run without a disk quota: one sandbox can fill the host's disk", "reason", why)
		} else {
			s.quota = true
			s.clearSpares()
		}
	}
	if !cfg.NoUserNamespaces {
		if why := userNamespacesUnsupported(); why != "" {
			cfg.Logger.Warn("ns: sandboxes run without user namespaces: root in a sandbox is root on the host for uid checks", "reason", why)
		} else {
			s.userns = true
		}
	}
	return s, nil
}

// Name returns identity.SubstrateNS.
func (s *Substrate) Name() string { return identity.SubstrateNS }

// Close stops the spawner thread and the warm init. Sandboxes still
// running keep running (a worker restart adopts them: Adopt); Stop or
// Detach them first. Start fails afterwards.
func (s *Substrate) Close() error {
	s.stopWarm() // also waits for a spare disk being made
	s.stopSpares()
	s.spawner.Close()
	return nil
}

// Capabilities: an ns sandbox is a tree of host processes in namespaces
// of their own (a network namespace for service ports) whose agent reads
// its configuration from the environment; its files live in a host-side
// layer (LayerPreparer), so a move restarts its processes.
func (s *Substrate) Capabilities() substrate.Capabilities {
	return substrate.Capabilities{Netns: true}
}

func validateSpec(spec *substrate.Spec) error {
	if err := spec.Validate(identity.SubstrateNS, SocketName); err != nil {
		return err
	}
	// The activation id names the sandbox's cgroup.
	if !validComponent(spec.Route.ActivationID) {
		return fmt.Errorf("ns: activation id %q is not a safe name", spec.Route.ActivationID)
	}
	if err := validateVolumes(spec.Volumes); err != nil {
		return err
	}
	return validateLimits(spec.Limits)
}

// Start activates spec (see the package doc for what it requires and
// creates) and returns once the agent's socket is listening.
func (s *Substrate) Start(ctx context.Context, spec substrate.Spec) (substrate.Instance, error) {
	if err := validateSpec(&spec); err != nil {
		return nil, err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.cfg.StartTimeout)
		defer cancel()
	}
	t0 := time.Now()
	img, err := s.imageFor(&spec)
	if err != nil {
		return nil, err
	}
	var lowers []string // top first
	if img != nil {
		lowers = topFirst(img.Layers)
		if spec.AgentEnv, err = withImageDefaults(spec.AgentEnv, img); err != nil {
			return nil, err
		}
	} else {
		lower, err := s.ensureTemplate(spec.Template)
		if err != nil {
			return nil, err
		}
		lowers = []string{lower}
	}
	lim := mergeLimits(spec.Limits, s.cfg.Limits)
	socket := filepath.Join(spec.Dir, SocketName)
	releaseLayer, err := s.acquireLayer(spec.Dir, lim.DiskBytes)
	if err != nil {
		return nil, fmt.Errorf("ns: start %s: %w", spec.Route.SandboxID, err)
	}
	layerHeld := true
	defer func() {
		if layerHeld { // not handed to an instance
			_ = releaseLayer()
		}
	}()
	if err := os.Mkdir(filepath.Join(spec.Dir, rootfsDir), 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("ns: activation dir: %w", err)
	}
	if err := os.Remove(socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("ns: stale socket: %w", err)
	}
	cgName := spec.Route.SandboxID + "-" + spec.Route.ActivationID
	// An init started ahead of time (warm.go) already sits in its cgroups;
	// otherwise one is started now.
	sp := s.takeWarm(lim)
	if sp != nil {
		if err := sp.claim(cgName, filepath.Join(spec.Dir, LogName)); err != nil {
			s.cfg.Logger.Warn("ns: warm init unusable; starting another", "err", err)
			sp.discard()
			sp = nil
		}
	}
	if sp == nil {
		logf, err := os.OpenFile(filepath.Join(spec.Dir, LogName), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
		if err != nil {
			return nil, fmt.Errorf("ns: %w", err)
		}
		if sp, err = s.spawn(cgName, lim, logf); err != nil { // logf closed
			_ = os.Remove(socket)
			_ = os.Remove(filepath.Join(spec.Dir, rootfsDir))
			return nil, err
		}
	}
	defer sp.cfgW.Close()
	defer sp.stR.Close()
	inst := sp.inst
	inst.route, inst.dir, inst.socket = spec.Route, spec.Dir, socket
	inst.releaseLayer, layerHeld = releaseLayer, false

	fail := func(err error) (substrate.Instance, error) {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if serr := inst.Stop(sctx); serr != nil {
			s.cfg.Logger.Warn("ns: cleanup after failed start", "route", spec.Route.String(), "err", serr)
		}
		return nil, fmt.Errorf("ns: start %s: %w", spec.Route.SandboxID, err)
	}
	cfgW, stR := sp.cfgW, sp.stR
	icfg := initConfig{
		Hostname: hostnameFor(spec.Route.SandboxID),
		Lowers:   lowers,
		HostUsr:  img == nil,
		Layer:    filepath.Join(spec.Dir, DiskMountName),
		Rootfs:   filepath.Join(spec.Dir, rootfsDir),
		Usr:      s.cfg.UsrDir,
		Socket:   inst.socket,
		Agent:    spec.AgentPath,
		Env:      spec.AgentEnv,
	}
	icfg.MaxPTYs = s.cfg.MaxPTYs
	var fds []int
	if inst.uids != nil {
		icfg.UserNS, icfg.NLower, icfg.Suid = true, len(lowers), img != nil
		fds, err = s.usernsFiles(inst.pid, lowers, img == nil, spec)
	} else {
		// The layer as a detached mount: a warm init's mount namespace
		// was copied before the layer disk was mounted.
		var fd int
		if fd, err = s.layerClone(spec.Dir, -1); err == nil {
			fds = []int{fd}
		}
	}
	if err != nil {
		return fail(err)
	}
	if len(spec.Volumes) > 0 {
		vfds, err := volumeFiles(inst.pid, inst.uids != nil, spec.Volumes)
		if err != nil {
			closeFDs(fds)
			return fail(err)
		}
		fds = append(fds, vfds...)
		icfg.Volumes = volumePaths(spec.Volumes)
	}
	defer closeFDs(fds)
	b, err := json.Marshal(icfg)
	if err != nil {
		return fail(err)
	}
	if err := sendConfig(cfgW, b, fds); err != nil {
		return fail(fmt.Errorf("send config to init: %w", err))
	}
	cfgW.Close()

	// Wait for "ok" (then EOF when exec closes the pipe) or "E:<err>".
	type status struct {
		b   []byte
		err error
	}
	stCh := make(chan status, 1)
	var rwg sync.WaitGroup
	rwg.Add(1)
	go func() {
		defer rwg.Done()
		b, err := io.ReadAll(io.LimitReader(stR, 64<<10))
		stCh <- status{b, err}
	}()
	var st status
	select {
	case st = <-stCh:
	case <-ctx.Done():
		_ = syscall.Kill(inst.pid, syscall.SIGKILL) // closes the pipe: the reader ends
		rwg.Wait()
		return fail(fmt.Errorf("init did not report: %w", ctx.Err()))
	}
	rwg.Wait()
	msg := string(st.b)
	switch {
	case st.err != nil:
		return fail(fmt.Errorf("read init status: %w", st.err))
	case msg == "ok":
	case len(msg) > 2 && msg[:2] == "E:":
		return fail(errors.New(msg[2:]))
	case len(msg) > 4 && msg[:4] == "okE:":
		return fail(errors.New(msg[4:]))
	default:
		return fail(fmt.Errorf("init exited without reporting (see %s)", filepath.Join(spec.Dir, LogName)))
	}
	select {
	case <-inst.done:
		return fail(fmt.Errorf("agent exited right after start (see %s)", filepath.Join(spec.Dir, LogName)))
	default:
	}
	if err := s.recordState(inst); err != nil {
		return fail(err)
	}
	s.cfg.Logger.Debug("ns: sandbox started", "route", spec.Route.String(), "pid", inst.pid, "warm", sp.warm, "took", time.Since(t0))
	s.prewarm(lim)
	if s.quota && !s.cfg.NoWarmInit {
		s.prewarmDisk(diskSize(lim.DiskBytes))
	}
	return inst, nil
}
