//go:build linux

package microvm

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/substrate/spawner"
)

// Names of the entries of an activation directory.
const (
	SocketName    = "guest.sock"
	QMPSocketName = "qmp.sock"
	ConsoleLog    = "console.log"
	maxLogSize    = 4 << 20
)

// Descriptor numbers in QEMU (ExtraFiles order); the NIC's tap, the
// migration stream and a RAM file, when passed, follow from fdNext on.
const (
	fdAgent  = 3
	fdQMP    = 4
	fdKernel = 5
	fdInitrd = 6
	fdEnv    = 7
	fdNext   = 8
)

// ramID is the guest RAM's memory backend id: microvm's default RAM id,
// so RAM blocks carry the same name whether RAM is anonymous or a file.
const ramID = "microvm.ram"

// Substrate is the microvm substrate. It is safe for concurrent use.
type Substrate struct {
	cfg    Config
	accel  string // "" when no accelerator works (see unavailable)
	tscKHz uint64 // host TSC frequency (0: unknown)
	asRoot bool
	// probes are the accelerator probe's attempts (none when Config.Accel
	// forced one); unavailable says why no accelerator works, or "".
	probes      []ProbeAttempt
	unavailable string

	modules []string // guest kernel modules, absolute, in load order
	// diskModules are what a root disk needs on top of modules (block
	// driver, ext4, overlay), in load order; diskErr says why image VMs
	// cannot start when the kernel lacks one.
	diskModules []string
	diskErr     error

	tmplMu    sync.Mutex
	templates map[string]*templateSlot
	tmplWG    sync.WaitGroup
	closing   chan struct{}
	closed    bool

	imgMu     sync.Mutex
	sums      map[fileKey][32]byte
	rootDisks map[string]*rootDisk // by rootDiskKey

	// spawner starts QEMU: the parent-death signal of probes and
	// templates is tied to the forking thread.
	spawner spawner.Spawner
}

var _ substrate.Substrate = (*Substrate)(nil)

// New checks the configuration and the host (QEMU, kernel, modules,
// busybox) and returns a substrate. The guest image is built lazily by the
// first Start.
func New(cfg Config) (*Substrate, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	for name, img := range cfg.Images {
		if err := validateImage(&img); err != nil {
			return nil, fmt.Errorf("microvm: image of template %s: %w", name, err)
		}
	}
	for _, p := range []string{cfg.QEMUPath, cfg.KernelPath, cfg.BusyboxPath} {
		if fi, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("microvm: %w", err)
		} else if !fi.Mode().IsRegular() {
			return nil, fmt.Errorf("microvm: %s is not a regular file", p)
		}
	}
	mods, err := resolveModules(cfg.ModulesDir, guestDrivers)
	if err != nil {
		return nil, err
	}
	diskMods, diskErr := diskModulesFor(cfg.ModulesDir, mods)
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, err
	}
	s := &Substrate{cfg: cfg, asRoot: os.Geteuid() == 0, sums: map[fileKey][32]byte{}, modules: mods, tscKHz: hostTSCKHz(),
		diskModules: diskMods, diskErr: diskErr, rootDisks: map[string]*rootDisk{},
		templates: map[string]*templateSlot{}, closing: make(chan struct{})}
	if cfg.Accel != "" {
		// Forced by the operator: no probe, but KVM access is still set up.
		s.accel = cfg.Accel
		if s.accel == "kvm" && s.asRoot {
			if err := grantKVM(kvmDevice, cfg.KVMGroup, cfg.UIDLockDir); err != nil {
				s.spawner.Close()
				return nil, err
			}
		}
		cfg.Logger.Info("microvm: accelerator forced", "accel", s.accel)
		s.prewarm()
		return s, nil
	}
	var cands []string
	if _, err := os.Stat(kvmDevice); err == nil {
		cands = append(cands, "kvm")
	}
	cands = append(cands, "tcg")
	ctx, cancel := context.WithTimeout(context.Background(), cfg.ProbeTimeout+cfg.ProbeTimeoutTCG+5*time.Second)
	defer cancel()
	s.accel, s.probes = s.chooseAccel(ctx, cands)
	attrs := []any{"accel", s.accel}
	for _, p := range s.probes {
		attrs = append(attrs, "probe_"+p.Accel, p.String())
	}
	if s.accel == "" {
		var why []string
		for _, p := range s.probes {
			why = append(why, p.String())
		}
		s.unavailable = fmt.Sprintf("%s (%s)", noAccel, strings.Join(why, "; "))
		cfg.Logger.Warn("microvm: no working accelerator; the substrate is unavailable", attrs...)
	} else {
		cfg.Logger.Info("microvm: accelerator chosen by booting a probe guest", attrs...)
		s.prewarm()
	}
	return s, nil
}

// Unavailable says why no sandbox can start here (no accelerator booted
// the probe guest), or "" when the substrate works.
func (s *Substrate) Unavailable() string { return s.unavailable }

// Probes returns the accelerator probe's attempts, in order (none when
// the accelerator was forced).
func (s *Substrate) Probes() []ProbeAttempt { return append([]ProbeAttempt(nil), s.probes...) }

// Name returns identity.SubstrateMicroVM.
func (s *Substrate) Name() string { return identity.SubstrateMicroVM }

// Accel reports the accelerator instances use ("kvm" or "tcg"), or ""
// when none works (see Unavailable).
func (s *Substrate) Accel() string { return s.accel }

// Close stops the spawner thread and template builds (their QEMUs die);
// sandboxes' VMs keep running (Stop or Detach them). Start fails
// afterwards.
func (s *Substrate) Close() error {
	s.closeTemplates()
	s.spawner.Close()
	return nil
}

// Capabilities: a VM's state (its files included: a busybox VM's live in
// guest memory, an image VM's on its layer disk too) is saved whole, so a
// move keeps its processes (an image VM whose QEMU died comes back from
// its layer disk alone: LayerSaver); the agent is
// reached over QEMU's chardev and configured by spaced-host's activation
// message; the NIC's backend is Spec.Network.Tap (there is no network
// namespace on the host to attach a veth to).
func (s *Substrate) Capabilities() substrate.Capabilities {
	return substrate.Capabilities{SavesState: true, Activation: true, Tap: true}
}

// Start activates spec (see the package doc) and returns once QEMU runs
// with the agent channel's socket listening (and, for a restore, once the
// saved state is loaded and the guest continues). The guest's readiness is
// for the caller to check over the channel.
func (s *Substrate) Start(ctx context.Context, spec substrate.Spec) (substrate.Instance, error) {
	if len(spec.Volumes) > 0 {
		return nil, ErrVolumes
	}
	spec = s.templateImage(spec)
	inst, err := s.start(ctx, spec, nil)
	if err != nil {
		return nil, err
	}
	return inst, nil
}

// start is Start; templateRAM, when set, boots a template: guest RAM is
// that file, shared, and no template is used.
func (s *Substrate) start(ctx context.Context, spec substrate.Spec, templateRAM *os.File) (*instance, error) {
	if err := validateSpec(&spec); err != nil {
		return nil, err
	}
	if s.unavailable != "" {
		return nil, fmt.Errorf("microvm: %w: %s", errdefs.ErrUnavailable, s.unavailable)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.cfg.StartTimeout)
		defer cancel()
	}
	t0 := time.Now()
	imgID, imgPath, err := s.ensureImage(spec.AgentPath)
	if err != nil {
		return nil, err
	}
	lim := mergeLimits(spec.Limits, s.cfg.Limits)
	var root *rootSpec
	if spec.Image != nil {
		if root, err = s.rootFor(spec.Image, lim); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(spec.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("microvm: activation dir: %w", err)
	}
	layerPath := filepath.Join(spec.Dir, LayerDiskName)
	// A validated route's sandbox id is a lowercase DNS label: a hostname
	// as it is (the agent sets it again at every activation).
	l := launch{shape: shapeOf(lim), hostname: spec.Route.SandboxID}
	var state *os.File
	var clonedFrom *vmTemplate
	switch {
	case spec.RestoreState != "":
		f, hdr, err := openState(spec.RestoreState)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		if hdr.Version == layerStateVersion {
			// A VM that died left its files only: a cold boot on them.
			if err := checkLayerState(hdr, root); err != nil {
				return nil, err
			}
			if err := restoreLayerState(f, layerPath, hdr.Layer.Size); err != nil {
				return nil, err
			}
			root.layerSize = hdr.Layer.Size
			break
		}
		if err := s.checkHeader(hdr, imgID, spec.Limits, root); err != nil {
			return nil, err
		}
		if hdr.Layer != nil {
			// The saved layer disk precedes the migration stream; the
			// state's file offset is then where QEMU reads on.
			if err := restoreLayer(f, layerPath, hdr.Layer.Size); err != nil {
				return nil, err
			}
			root.layerSize = hdr.Layer.Size
		}
		state, l.shape, l.incoming = f, hdr.Shape, true
		lim.MemoryBytes, lim.CPUMillis = hdr.Shape.MemoryMiB<<20, int64(hdr.Shape.VCPUs)*1000
	case templateRAM != nil:
		l.ram, l.ramShared = templateRAM, true
	case !s.cfg.NoTemplates:
		if root != nil && fileExists(layerPath) {
			// The sandbox's own layer (a Start after a Stop on this
			// directory): a clone's memory would hold the template's
			// view of another disk. A cold boot.
			break
		}
		// A clone of this image's and shape's template, when one can be
		// had; otherwise a cold boot.
		if t := s.templateFor(ctx, imgID, imgPath, l.shape, spec.AgentPath, root); t != nil {
			f, err := t.openState()
			if err != nil {
				return nil, err
			}
			defer f.Close()
			if t.layer != nil {
				if err := copyLayerDisk(layerPath, t.layer); err != nil {
					return nil, err
				}
			}
			state, l.incoming, l.ram, l.ignoreShared, clonedFrom = f, true, t.ram, true, t
		}
	}
	if root != nil && !fileExists(layerPath) {
		if err := s.createLayerDisk(layerPath, root.layerSize); err != nil {
			return nil, err
		}
	}
	envScript, _ := agentEnvScript(spec.AgentEnv) // validated above

	inst := &instance{
		s: s, route: spec.Route, dir: spec.Dir, socket: filepath.Join(spec.Dir, SocketName),
		qmpPath: filepath.Join(spec.Dir, QMPSocketName), imageID: imgID, shape: l.shape, accel: s.accel,
		done: make(chan struct{}),
	}
	if root != nil {
		inst.root, inst.layerPath = root.disk, layerPath
	}
	inst.processesKept = spec.RestoreState != "" && l.incoming
	fail := func(err error) (*instance, error) {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if serr := inst.Stop(sctx); serr != nil {
			s.cfg.Logger.Warn("microvm: cleanup after failed start", "route", spec.Route.String(), "err", serr)
		}
		if inst.qmp != nil {
			if ev := inst.qmp.recentEvents(); len(ev) > 0 {
				err = fmt.Errorf("%w (qmp events: %s)", err, strings.Join(ev, ", "))
			}
		}
		if tail := inst.consoleTail(2048); tail != "" {
			err = fmt.Errorf("%w; console tail:\n%s", err, tail)
		}
		return nil, fmt.Errorf("microvm: start %s: %w", spec.Route.SandboxID, err)
	}
	logf, err := os.OpenFile(filepath.Join(spec.Dir, ConsoleLog), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return fail(err)
	}
	inst.log = &cappedWriter{f: logf, left: maxLogSize}

	cred, lease, err := s.qemuCredential(s.accel)
	if err != nil {
		return fail(err)
	}
	inst.uid = lease
	if lease != nil {
		// Until QEMU runs, the uid is this process's: should it die
		// after QEMU starts but before the lease names QEMU, the tag
		// names a dead owner and the next Acquire finds QEMU under the
		// uid (uidlease.rangeInUse) instead of handing it out.
		if err := lease.l.Bind(os.Getpid()); err != nil {
			return fail(err)
		}
	}

	lf, err := s.openLaunchFiles(inst, imgPath, envScript)
	if err != nil {
		return fail(err)
	}
	defer lf.close()
	extra := []*os.File{lf.listener, lf.qmpListener, lf.kernel, lf.initrd, lf.env}
	if root != nil {
		if err := lf.openDisks(root.disk.path, layerPath); err != nil {
			return fail(err)
		}
		l.rootFD = fdAgent + len(extra)
		l.layerFD = l.rootFD + 1
		extra = append(extra, lf.root, lf.layer, lf.layerRO)
	}
	tap, ownTap, mac, err := s.nicFor(spec.Network)
	if err != nil {
		return fail(err)
	}
	if ownTap {
		lf.tap = tap // QEMU's copy keeps it; ours goes with the others
	}
	l.mac = mac
	if tap != nil {
		l.tapFD = fdAgent + len(extra)
		extra = append(extra, tap)
	}
	if state != nil {
		l.incomingFD = fdAgent + len(extra)
		extra = append(extra, state)
	}
	if l.ram != nil {
		l.ramFD = fdAgent + len(extra)
		extra = append(extra, l.ram)
	}
	// QEMU writes its console into a pipe this process copies into
	// console.log (capped); the pipe breaks when this process is gone.
	consoleR, consoleW, err := os.Pipe()
	if err != nil {
		return fail(err)
	}
	inst.console, inst.copied = consoleR, make(chan struct{})
	go inst.copyConsole() // owned: Stop and Detach wait for it
	cmd := &exec.Cmd{
		Path:       s.cfg.QEMUPath,
		Args:       append([]string{"qemu-system-x86_64"}, s.qemuArgs(l)...),
		Env:        []string{},
		Dir:        "/",
		Stdin:      nil,
		Stdout:     consoleW,
		Stderr:     consoleW,
		ExtraFiles: extra,
		SysProcAttr: &syscall.SysProcAttr{
			Credential: cred,
			// A session of its own: signals to the worker's process group
			// or terminal do not reach QEMU.
			Setsid: true,
		},
	}
	if templateRAM != nil {
		// A template is the substrate's own: it dies with this process.
		// A sandbox's QEMU outlives it, to be adopted by the next one.
		cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	}
	var startErr error
	err = s.spawner.Do(func() { startErr = cmd.Start() })
	consoleW.Close() // QEMU holds its copy: EOF comes when QEMU exits
	if err != nil {
		return fail(fmt.Errorf("microvm: %w", err))
	}
	if startErr != nil {
		return fail(fmt.Errorf("launch qemu: %w", startErr))
	}
	inst.cmd = cmd
	inst.pid = cmd.Process.Pid
	if lease != nil {
		// The uid stays QEMU's for as long as QEMU lives, whether or not
		// this process does.
		if err := lease.l.Bind(inst.pid); err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			inst.cmd = nil
			return fail(err)
		}
	}
	if inst.pidfd, err = openPidfd(inst.pid); err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		inst.cmd = nil
		return fail(err)
	}
	inst.wg.Add(1)
	go inst.watch()
	lf.close() // QEMU holds its copies; the listeners must be QEMU's alone
	if state != nil {
		state.Close()
	}
	id, err := identify(inst.pidfd, inst.pid)
	if err != nil {
		return fail(fmt.Errorf("qemu %d: %w", inst.pid, err))
	}
	id.Leased = lease != nil
	if err := inst.record(id); err != nil {
		return fail(err)
	}
	conn, err := dialQMP(ctx, inst.qmpPath, nil)
	if err != nil {
		return fail(err)
	}
	q, err := newQMP(ctx, conn)
	if err != nil {
		return fail(err)
	}
	inst.qmp = q
	if l.incoming && l.ignoreShared {
		if err := inst.startIncoming(ctx, l.incomingFD); err != nil {
			return fail(err)
		}
	}
	if l.incoming {
		if err := inst.finishIncoming(ctx); err != nil {
			return fail(err)
		}
	}
	if l.incoming && l.ignoreShared {
		// The clone's own saves carry all of its RAM (it is private).
		if _, err := q.execute(ctx, "migrate-set-capabilities", map[string]any{
			"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": false}},
		}, nil); err != nil {
			return fail(fmt.Errorf("clone: %w", err))
		}
	}
	st, err := q.status(ctx)
	if err != nil {
		return fail(err)
	}
	if st != "running" {
		return fail(fmt.Errorf("vm is %q after start", st))
	}
	s.cfg.Logger.Debug("microvm: started", "route", spec.Route.String(), "pid", inst.pid,
		"accel", s.accel, "restored", spec.RestoreState != "", "cloned", clonedFrom != nil, "image", spec.Image != nil, "took", time.Since(t0))
	return inst, nil
}

// rootSpec is an image VM's disks: the flattened image and the size of
// its writable layer disk.
type rootSpec struct {
	img       *substrate.Image
	disk      *rootDisk
	layerSize int64
}

// rootFor flattens img (once, cached) for a VM with limits lim.
func (s *Substrate) rootFor(img *substrate.Image, lim substrate.Limits) (*rootSpec, error) {
	if s.diskErr != nil {
		return nil, fmt.Errorf("microvm: %w: image VMs: %w", errdefs.ErrUnavailable, s.diskErr)
	}
	size := layerDiskSize(lim.DiskBytes)
	if size < MinDiskBytes {
		return nil, fmt.Errorf("microvm: %w: disk limit %d is below the %d MiB an image VM's layer disk needs", errdefs.ErrInvalid, lim.DiskBytes, MinDiskBytes>>20)
	}
	d, err := s.ensureRootDisk(img)
	if err != nil {
		return nil, err
	}
	return &rootSpec{img: img, disk: d, layerSize: size}, nil
}

// restoreLayer writes the layer disk records of a state file (positioned
// at them) into a new path.
func restoreLayer(f *os.File, path string, size int64) error {
	if !validLayerSize(size) {
		return fmt.Errorf("microvm: restore: %w: layer disk size %d", errdefs.ErrInvalid, size)
	}
	_ = os.Remove(path) // a retried restore: the state is the truth
	dst, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("microvm: restore: layer disk: %w", err)
	}
	err = readLayer(f, dst, size)
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(path)
		return fmt.Errorf("microvm: restore: %w", err)
	}
	return nil
}

func fileExists(p string) bool {
	_, err := os.Lstat(p)
	return err == nil
}
