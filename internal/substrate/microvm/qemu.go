//go:build linux

package microvm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

// QEMU's command line and the files it is handed as descriptors (see the
// package doc, "The machine" and "Least privilege").

// kvmDevice is the KVM device QEMU opens.
const kvmDevice = "/dev/kvm"

// qemuSandbox is QEMU's -sandbox option: its own seccomp filter (no exec,
// no set*id, no scheduler or resource changes).
const qemuSandbox = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"

// machineConfig is what differs between accelerators on QEMU's command
// line.
type machineConfig struct {
	machine, cpu string
	appendExtra  string // kernel command line additions, each with a leading space
}

// machineFor returns the machine for accel. Under TCG the PIT, PIC and RTC
// let the kernel calibrate its clocks (without the PIT a loaded TCG host
// can stall the boot in delay-loop calibration), and the kernel is told
// the host's TSC frequency and that the TSC is reliable: otherwise it
// falls back to the jiffies clocksource (4 ms resolution, and the tick
// can then never stop, so an idle guest costs QEMU more CPU).
func machineFor(accel string, tscKHz uint64) machineConfig {
	mc := machineConfig{machine: "microvm,rtc=on", cpu: "max"}
	switch accel {
	case "kvm":
		mc.cpu = "host"
	case "tcg":
		mc.machine += ",pit=on,pic=on"
		if tscKHz > 0 {
			mc.appendExtra = " tsc_early_khz=" + strconv.FormatUint(tscKHz, 10) + " tsc=reliable"
		}
	}
	return mc
}

// accelArg is QEMU's -accel option for instances.
func (s *Substrate) accelArg() string {
	if s.accel == "tcg" && s.cfg.TCGCacheMiB > 0 {
		return "tcg,tb-size=" + strconv.Itoa(s.cfg.TCGCacheMiB)
	}
	return s.accel
}

// qemuCredential is what a QEMU runs as: when the substrate runs as root,
// a leased uid of its own (uid = gid) whose only supplementary group,
// under KVM, is Config.KVMGroup (the one /dev/kvm's ACL admits); else the
// caller (nil credential and lease).
func (s *Substrate) qemuCredential(accel string) (*syscall.Credential, *uidLease, error) {
	if !s.asRoot {
		return nil, nil, nil
	}
	lease, err := leaseUID(s.cfg.UIDLockDir, s.cfg.UIDFirst, s.cfg.UIDCount, uint32(time.Now().UnixNano()))
	if err != nil {
		return nil, nil, err
	}
	cred := &syscall.Credential{Uid: lease.uid, Gid: lease.uid, Groups: []uint32{}}
	if accel == "kvm" {
		cred.Groups = []uint32{s.cfg.KVMGroup}
	}
	return cred, lease, nil
}

// validateSpec makes the substrate-wide checks and this substrate's own.
func validateSpec(spec *substrate.Spec) error {
	if err := spec.Validate(identity.SubstrateMicroVM, SocketName); err != nil {
		return err
	}
	// The environment travels as a script the init sources.
	if _, err := agentEnvScript(spec.AgentEnv); err != nil {
		return err
	}
	if err := checkNetwork(spec.Network); err != nil {
		return err
	}
	if spec.Image != nil {
		if err := validateImage(spec.Image); err != nil {
			return err
		}
	}
	if len(spec.Volumes) > 0 {
		// Fail closed: a sandbox that expects its volumes must not run
		// without them.
		return fmt.Errorf("microvm: %w: volumes are not supported by the microvm substrate", errdefs.ErrInvalid)
	}
	return validateLimits(spec.Limits)
}

// agentEnvScript renders env as "export NAME='value'" lines for the init
// to source (single quotes, so nothing in a value is interpreted).
func agentEnvScript(env []string) ([]byte, error) {
	var b strings.Builder
	for _, kv := range env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || !validEnvName(k) {
			return nil, fmt.Errorf("microvm: agent environment entry %q is not NAME=value", kv)
		}
		if strings.ContainsRune(v, 0) {
			return nil, fmt.Errorf("microvm: agent environment %s contains NUL", k)
		}
		fmt.Fprintf(&b, "export %s='%s'\n", k, strings.ReplaceAll(v, "'", `'\''`))
	}
	return []byte(b.String()), nil
}

func validEnvName(s string) bool {
	if s == "" {
		return false
	}
	for i, c := range s {
		switch {
		case c == '_', c >= 'A' && c <= 'Z', c >= 'a' && c <= 'z':
		case c >= '0' && c <= '9' && i > 0:
		default:
			return false
		}
	}
	return true
}

// launch is what qemuArgs needs for one instance.
type launch struct {
	shape    machineShape
	hostname string
	incoming bool
	// ram, when set, backs guest RAM with this file (QEMU's fd ramFD) as a
	// memory-backend-file with the machine's default RAM id, so states
	// migrate between file-backed and anonymous instances: shared (a
	// template boot writes its RAM into the file) or private (a clone maps
	// the template's RAM copy-on-write).
	ram       *os.File
	ramShared bool
	// ignoreShared sets migration's x-ignore-shared before an incoming
	// stream is read: the state carries no pages of the file-backed RAM (a
	// clone's load).
	ignoreShared      bool
	ramFD, incomingFD int
	// tapFD is the NIC's tap (0: the NIC has no backend); mac its MAC.
	tapFD int
	mac   net.HardwareAddr
	// rootFD and layerFD are an image VM's disks (0: a busybox VM): the
	// flattened image (read-only) and the writable layer disk (layerFD
	// read-write, layerFD+1 read-only: QEMU opens a disk read-only first
	// and reopens it for writing when a device needs to write).
	rootFD, layerFD int
}

// qemuArgs is QEMU's command line (argv[1:]) for one instance. Descriptors
// are those of the ExtraFiles Start passes.
func (s *Substrate) qemuArgs(l launch) []string {
	mc := machineFor(s.accel, s.tscKHz)
	appendLine := "console=ttyS0 quiet panic=-1 reboot=t pci=off space.hostname=" + l.hostname + mc.appendExtra
	if s.cfg.ZeroFreedMemory {
		appendLine += " init_on_free=1"
	}
	if s.cfg.testMode != "" {
		appendLine += " space.test=" + s.cfg.testMode
	}
	machine := mc.machine
	if l.ram != nil {
		machine += ",memory-backend=" + ramID
	}
	args := []string{
		"-name", "space-" + l.hostname,
		"-machine", machine,
		"-accel", s.accelArg(),
		"-cpu", mc.cpu,
		"-smp", strconv.Itoa(l.shape.VCPUs),
		"-m", strconv.FormatInt(l.shape.MemoryMiB, 10) + "M",
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-chardev", "stdio,id=con,signal=off",
		"-serial", "chardev:con",
		"-fw_cfg", "name=" + envFwCfg + ",file=" + procFD(fdEnv),
		"-device", "virtio-serial-device,max_ports=2",
		"-chardev", "socket,id=agent,fd=" + strconv.Itoa(fdAgent) + ",server=on,wait=off",
		"-device", "virtserialport,chardev=agent,name=" + PortName,
	}
	// The NIC, the same device whatever its backend (see tap.go).
	if l.tapFD > 0 {
		args = append(args, "-netdev", "tap,id="+netdevID+",fd="+strconv.Itoa(l.tapFD),
			"-device", "virtio-net-device,netdev="+netdevID+",mac="+l.mac.String())
	} else {
		args = append(args, "-device", "virtio-net-device,mac="+l.mac.String())
	}
	if l.rootFD > 0 {
		// Passed as fd sets: QEMU dups the descriptor of the matching
		// access mode instead of opening a path (it could not: the
		// files are root's, QEMU is not).
		// file.locking=off: QEMU's image locks (OFD locks on the shared
		// read-only root and on this VM's own layer disk) fail the `cont`
		// after a snapshot once clones of the snapshot hold the root; which
		// VM uses which disk is the worker's records' business, not locks'.
		args = append(args,
			"-add-fd", "fd="+strconv.Itoa(l.rootFD)+",set=1",
			"-drive", "if=none,id=root,format=raw,readonly=on,file.locking=off,file=/dev/fdset/1",
			"-device", "virtio-blk-device,drive=root,serial="+rootDiskSerial,
			"-add-fd", "fd="+strconv.Itoa(l.layerFD)+",set=2",
			"-add-fd", "fd="+strconv.Itoa(l.layerFD+1)+",set=2",
			"-drive", "if=none,id=layer,format=raw,discard=unmap,file.locking=off,file=/dev/fdset/2",
			"-device", "virtio-blk-device,drive=layer,serial="+layerDiskSerial,
		)
		appendLine += " space.root=disk"
	}
	args = append(args,
		// A listener, like the agent's: QEMU accepts the next QMP client once
		// one goes, so the worker that adopts this QEMU connects again.
		"-chardev", "socket,id=qmp,fd="+strconv.Itoa(fdQMP)+",server=on,wait=off",
		"-mon", "chardev=qmp,mode=control",
		"-sandbox", qemuSandbox,
		"-msg", "timestamp=on",
	)
	if l.ram != nil {
		share := "off"
		if l.ramShared {
			share = "on"
		}
		args = append(args, "-object", fmt.Sprintf("memory-backend-file,id=%s,size=%dM,mem-path=%s,share=%s",
			ramID, l.shape.MemoryMiB, procFD(l.ramFD), share))
	}
	if !l.incoming {
		// An incoming VM continues a booted kernel: QEMU would only hold
		// the bzImage (13.5 MiB for Debian's cloud kernel) in its memory
		// for the firmware, per VM, for nothing.
		args = append(args, "-kernel", procFD(fdKernel), "-initrd", procFD(fdInitrd), "-append", appendLine)
	}
	switch {
	case l.incoming && l.ignoreShared:
		// x-ignore-shared must be set before the stream is read: the
		// migration starts over QMP (startIncoming).
		args = append(args, "-incoming", "defer")
	case l.incoming:
		args = append(args, "-incoming", "fd:"+strconv.Itoa(l.incomingFD))
	}
	return args
}

func procFD(n int) string { return "/proc/self/fd/" + strconv.Itoa(n) }

// launchFiles are what QEMU inherits (listener, qmpListener, kernel,
// initrd, env: its fds 3 to 7) and a throwaway tap when the substrate
// made one (tap.go).
type launchFiles struct {
	listener, qmpListener, kernel, initrd, env *os.File
	tap                                        *os.File
	root, layer, layerRO                       *os.File // an image VM's disks
	once                                       sync.Once
}

// openDisks opens an image VM's disks: the flattened image read-only, the
// layer disk read-write.
func (lf *launchFiles) openDisks(root, layer string) (err error) {
	if lf.root, err = os.OpenFile(root, os.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
		return fmt.Errorf("root disk: %w", err)
	}
	if lf.layer, err = os.OpenFile(layer, os.O_RDWR|unix.O_CLOEXEC, 0); err != nil {
		return fmt.Errorf("layer disk: %w", err)
	}
	// QEMU inherits this description and its lock (layersave.go): no
	// other VM boots on the disk, and no save reads it, while QEMU runs.
	if err := lockLayer(lf.layer); err != nil {
		return err
	}
	if lf.layerRO, err = os.OpenFile(layer, os.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
		return fmt.Errorf("layer disk: %w", err)
	}
	return nil
}

// close closes the inherited files (QEMU keeps its own copies).
// Idempotent.
func (lf *launchFiles) close() {
	lf.once.Do(func() {
		for _, f := range []*os.File{lf.listener, lf.qmpListener, lf.kernel, lf.initrd, lf.env, lf.tap, lf.root, lf.layer, lf.layerRO} {
			if f != nil {
				f.Close()
			}
		}
	})
}

// listenUnix binds and listens on a new socket at path (replacing a stale
// one) for QEMU to inherit. The socket file is the substrate's, mode 0600
// in the 0700 activation directory: QEMU, under its own uid, reaches it
// only through the inherited descriptor.
func listenUnix(path string) (*os.File, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("stale socket: %w", err)
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "listener:"+path)
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		f.Close()
		return nil, fmt.Errorf("bind %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		f.Close()
		return nil, err
	}
	if err := unix.Listen(fd, 16); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// openLaunchFiles binds the agent channel's and QMP's listeners in the
// activation directory and opens everything else QEMU inherits.
func (s *Substrate) openLaunchFiles(inst *instance, imgPath string, env []byte) (_ *launchFiles, err error) {
	lf := &launchFiles{}
	defer func() {
		if err != nil {
			lf.close()
		}
	}()
	if lf.listener, err = listenUnix(inst.socket); err != nil {
		return nil, err
	}
	if lf.qmpListener, err = listenUnix(inst.qmpPath); err != nil {
		return nil, err
	}
	if lf.kernel, err = os.Open(s.cfg.KernelPath); err != nil {
		return nil, err
	}
	if lf.initrd, err = os.Open(imgPath); err != nil {
		return nil, err
	}
	mfd, err := unix.MemfdCreate("space-agent-env", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, err
	}
	lf.env = os.NewFile(uintptr(mfd), "agent-env")
	if len(env) == 0 {
		env = []byte("\n") // fw_cfg refuses an empty file
	}
	if _, err := lf.env.Write(env); err != nil {
		return nil, err
	}
	if _, err := lf.env.Seek(0, 0); err != nil {
		return nil, err
	}
	return lf, nil
}

// dialQMP connects to the QMP listener at path. With owner set it checks
// that the listener is the one that QEMU listens on: QEMU calls listen()
// on the descriptor it inherits, so a client's SO_PEERCRED names QEMU and
// nothing else can have taken the path's place. (Right after the launch
// QEMU may not have called it yet; the substrate made the socket then.)
func dialQMP(ctx context.Context, path string, owner *procID) (*net.UnixConn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("qmp: %w", err)
	}
	uc := c.(*net.UnixConn)
	if owner == nil {
		return uc, nil
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		uc.Close()
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		cerr = err
	}
	if cerr != nil {
		uc.Close()
		return nil, fmt.Errorf("qmp: peer credentials: %w", cerr)
	}
	if int(cred.Pid) != owner.PID || cred.Uid != owner.UID {
		uc.Close()
		return nil, fmt.Errorf("qmp: %s is served by pid %d uid %d, not qemu %d uid %d", path, cred.Pid, cred.Uid, owner.PID, owner.UID)
	}
	return uc, nil
}
