//go:build linux

// Package microvm is the SPACE substrate that runs every sandbox in its own
// QEMU "microvm" virtual machine (DESIGN.md section 10): a guest kernel of
// its own, a full memory snapshot for pause-and-move, and the same request
// path as the ns substrate (spaced-host -> a Unix socket -> spaced-guest).
//
// # The machine
//
// qemu-system-x86_64 -M microvm (the accelerator whose probe guest boots
// first, KVM then TCG, see probe.go: -cpu host or -cpu max), -nodefaults -no-user-config,
// no disk, no host device: the only devices are the ISA serial console (to
// Spec.Dir/console.log), a virtio-serial port named PortName (the agent's
// channel), one virtio-net NIC (see "The network") and, under TCG, the
// PIT, PIC and RTC the kernel needs to
// calibrate its clocks (without the PIT a loaded TCG host can stall the
// boot in delay-loop calibration; the kernel is also told the host's TSC
// frequency, see hostTSCKHz). vCPUs = ceil(CPUMillis/1000), memory =
// MemoryBytes (default 256 MiB, minimum 128 MiB). The exact command line is
// built by qemuArgs. The kernel reboots by triple fault (reboot=t): a
// panic (panic=-1) or a reboot resets the vCPU, which -no-reboot turns
// into QEMU exiting, so Done closes. (The default reboot sequence ends, on
// microvm, in a jump to the firmware, which boots the kernel again behind
// QEMU's back and hangs.)
//
// The guest boots the kernel (Config.KernelPath) with an initramfs the
// substrate builds itself on first use and caches under
// StateDir/images/<sha256 of every input>.cpio.gz: static busybox, the
// virtio and fw_cfg modules, the agent at /.space/spaced-guest and a
// busybox sh /init (see initScript) that mounts proc, sys, devtmpfs,
// devpts and tmpfs /tmp, /run and /dev/shm, loads the modules, brings lo up
// and execs the agent as pid 1 with SPACE_GUEST_VM_PORT=space.0 plus
// Spec.AgentEnv. Spec.AgentEnv travels as a fw_cfg item (not on the
// command line: it is too small and world-readable); the init copies it
// and unloads the fw_cfg driver. /bin/bash execs busybox sh (the e2b SDK runs
// "/bin/bash -l -c"); accounts are root and user (uid 1000).
//
// Spec.Template is not interpreted: every VM runs this one image (the
// control plane names it, e.g. "base-vm").
//
// # The network
//
// Every VM, templates included, has one virtio-net NIC (-netdev
// tap,fd=N -device virtio-net-device): the device set must be the same
// for a template and its clones and for a saved state and its restore.
// Its backend is Spec.Network.Tap, a tap the caller made in the worker's
// egress network namespace (passed as a descriptor; QEMU keeps it, so an
// adopted VM keeps its link), with Spec.Network.MAC. Without
// Spec.Network the backend is a throwaway tap in a network namespace of
// its own, where nothing else lives, and the MAC a fixed one (without
// root, no backend at all). The guest agent configures the NIC at every
// activation (address, route, resolver, CA, and the MAC: a clone keeps
// the template's; see internal/guest); the init only loads its driver.
// See tap.go for why every tap is a plain IFF_TAP|IFF_NO_PI one.
//
// # Files live in guest memory
//
// The root file system is the initramfs itself (a tmpfs-like rootfs in
// guest RAM); there is no disk. Everything a sandbox writes is therefore
// part of its memory, and a memory snapshot (SaveState) carries files and
// processes together. The flip side: files count against MemoryBytes, and
// nothing survives Stop except through SaveState. Spec.Dir holds no
// writable layer.
//
// # Activation directory (Spec.Dir)
//
//	guest.sock   the agent channel's listening socket (removed by Stop)
//	qmp.sock     QEMU's QMP listening socket, mode 0600 (removed by Stop)
//	vm.json      the adoption state (adopt.go; removed by Stop)
//	console.log  the guest's serial console and QEMU's messages, capped at
//	             4 MiB, while the process that started QEMU runs (kept;
//	             Start errors quote its tail)
//
// # Host side of the channel
//
// The substrate binds and listens on guest.sock itself and hands the
// listening socket to QEMU as an inherited descriptor (-chardev
// socket,fd=3,server=on); QEMU calls listen() on it again, so the
// listener's credentials (what a client reads with SO_PEERCRED) are
// QEMU's, the listener lives in QEMU's descriptor table and the substrate
// closes its copy: spaced-host can tie the socket to InitPID() exactly as
// it ties the ns substrate's socket to the agent. QMP is set up the same
// way on qmp.sock (QEMU's fd 4), which only root can reach: QEMU accepts
// one client at a time and the next once it goes, so the worker process
// that adopts a running QEMU connects again (adopt.go).
//
// # Least privilege
//
// QEMU runs with -sandbox on,obsolete=deny,elevateprivileges=deny,
// spawn=deny,resourcecontrol=deny (its own seccomp filter: no exec, no
// set*id, no scheduler/affinity changes). When the substrate runs as root,
// QEMU is started directly as an unprivileged uid of its own (uid = gid,
// one per running instance from [UIDFirst, UIDFirst+UIDCount), leased by
// an flock; no supplementary groups except Config.KVMGroup under KVM), so
// two QEMUs can neither signal nor ptrace each other and none can read
// another's activation directory. QEMU's -runas is not used: QEMU 7.2
// installs its seccomp filter before it drops privileges, so -runas with
// elevateprivileges=deny dies with SIGSYS. Every file QEMU needs is opened
// by the substrate and passed as a descriptor (the kernel, the image and
// the environment as /proc/self/fd/N, a memfd for the environment; the
// migration stream through QMP getfd), so QEMU needs no access to any host
// directory. No mount or pid namespace: QEMU under its own uid, its
// seccomp filter and no host devices is the boundary that matters, and a
// namespace set-up would add a re-exec like the ns substrate's for little.
// A sandbox's QEMU outlives the worker process (a session of its own, no
// parent-death signal; see adopt.go); probe and template QEMUs die with it
// (parent-death signal, forked from one dedicated locked OS thread).
//
// # Pause, state and restore
//
// Pause is QMP stop (vCPUs halted, same QEMU process), Resume is cont.
// SaveState (paused instances only) writes a small header (format version,
// memory, vCPUs, CPU model, accelerator, image id) followed by QEMU's
// migration stream (QMP migrate to a pipe passed with getfd: fd: migration,
// because spawn=deny rules out exec:). A Start with Spec.RestoreState
// checks the header against what this substrate would run (same image id,
// so the same kernel, modules, busybox and agent; same CPU model; the
// spec's limits, when set, must give the same shape), launches the same
// command line with -incoming fd:N on the state file, waits for the
// migration to complete and continues the guest: its processes go on
// where they stopped. The guest keeps the identity it had; spaced-host
// re-activates it over the channel.
//
// # Known limits
//
//   - Guest time stops while the VM is paused or saved: after Resume or a
//     restore the guest's clock is behind by the pause (measured: 5 s
//     pause, guest 5 s behind). The guest's RTC (/dev/rtc0) follows the
//     host's clock throughout, so the agent can resynchronize (it does
//     not yet).
//   - KVM (-cpu host) boots only where a probe guest boots: a paravirtual
//     KVM (kvm_pvm) that runs only PVM-built guest kernels fails the probe
//     and TCG is used. QEMU reaches /dev/kvm through a POSIX ACL entry for
//     Config.KVMGroup, its only supplementary group (kvmacl.go).
//   - Pids limits are not enforced (the guest kernel is the boundary); no
//     disk: files count against guest memory.
//   - A restore needs the identical image on the target (same kernel,
//     modules, busybox and agent build); cached images are never removed.
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

	tmplMu    sync.Mutex
	templates map[string]*templateSlot
	tmplWG    sync.WaitGroup
	closing   chan struct{}
	closed    bool

	imgMu sync.Mutex
	sums  map[fileKey][32]byte

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
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, err
	}
	s := &Substrate{cfg: cfg, asRoot: os.Geteuid() == 0, sums: map[fileKey][32]byte{}, modules: mods, tscKHz: hostTSCKHz(),
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

// prewarm starts building the default shape's template when
// Config.PrewarmAgent is set (a failure is logged by templateFor).
func (s *Substrate) prewarm() {
	if s.cfg.PrewarmAgent == "" || s.cfg.NoTemplates {
		return
	}
	imgID, imgPath, err := s.ensureImage(s.cfg.PrewarmAgent)
	if err != nil {
		s.cfg.Logger.Warn("microvm: prewarm: guest image", "err", err)
		return
	}
	shape := shapeOf(s.cfg.Limits)
	s.tmplWG.Add(1)
	go func() { // owned: Close waits for it
		defer s.tmplWG.Done()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			select {
			case <-s.closing:
				cancel()
			case <-ctx.Done():
			}
		}()
		s.templateFor(ctx, imgID, imgPath, shape, s.cfg.PrewarmAgent)
	}()
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

// Capabilities: a VM's state (its files included: they live in guest
// memory) is saved whole, so a move keeps its processes; the agent is
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
		if err := s.checkHeader(hdr, imgID, spec.Limits); err != nil {
			return nil, err
		}
		state, l.shape, l.incoming = f, hdr.Shape, true
		lim.MemoryBytes, lim.CPUMillis = hdr.Shape.MemoryMiB<<20, int64(hdr.Shape.VCPUs)*1000
	case templateRAM != nil:
		l.ram, l.ramShared = templateRAM, true
	case !s.cfg.NoTemplates:
		// A clone of this image's and shape's template, when one can be
		// had; otherwise a cold boot.
		if t := s.templateFor(ctx, imgID, imgPath, l.shape, spec.AgentPath); t != nil {
			f, err := t.openState()
			if err != nil {
				return nil, err
			}
			defer f.Close()
			state, l.incoming, l.ram, l.ignoreShared, clonedFrom = f, true, t.ram, true, t
		}
	}
	envScript, _ := agentEnvScript(spec.AgentEnv) // validated above

	if err := os.MkdirAll(spec.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("microvm: activation dir: %w", err)
	}
	inst := &instance{
		s: s, route: spec.Route, dir: spec.Dir, socket: filepath.Join(spec.Dir, SocketName),
		qmpPath: filepath.Join(spec.Dir, QMPSocketName), imageID: imgID, shape: l.shape, accel: s.accel,
		done: make(chan struct{}),
	}
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
		"accel", s.accel, "restored", spec.RestoreState != "", "cloned", clonedFrom != nil, "took", time.Since(t0))
	return inst, nil
}
