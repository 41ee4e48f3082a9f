package hostsim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// Command is a process a host runs. Restart runs it again as it is.
type Command struct {
	// Path is the executable (absolute, or looked up in PATH at Start).
	Path string
	// Args are its arguments (without argv[0]).
	Args []string
	// Env is its environment (nil: none at all, not the caller's).
	Env []string
	// Dir is its working directory (default: the caller's).
	Dir string
}

// Host is one simulated machine: a network namespace with one address on
// the switch, and the processes started in it.
type Host struct {
	net    *Net
	name   string
	addr   netip.Addr
	nsPath string
	swLink string // its port on the bridge, in the switch namespace
	logDir string
	// cg is the cgroup the host's processes start in until the next
	// Kill; each Kill moves on to a fresh one (<host>.<boot>): a cgroup
	// once killed is not started into again (on some kernels a process
	// cloned into a cgroup that was ever killed is killed at birth).
	cg    *cgroup
	boot  int
	oldCG []*cgroup

	mu          sync.Mutex
	cmds        []namedCommand // in Start order, for Restart
	procs       map[string]*Proc
	partitioned bool
	extraCG     []string // cgroups (v2, relative) Kill also kills
	closed      bool
}

type namedCommand struct {
	name string
	cmd  Command
}

// Proc is one run of a Command.
type Proc struct {
	// Name is the name it was started under; Log the file its stdout
	// and stderr are appended to (every run of the name).
	Name, Log string
	cmd       *exec.Cmd
	done      chan struct{}
	waitErr   error
}

// Pid returns the process id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Done is closed once the process has exited and been waited for.
func (p *Proc) Done() <-chan struct{} { return p.done }

// ProcessState is how it ended (nil while it runs).
func (p *Proc) ProcessState() *os.ProcessState {
	select {
	case <-p.done:
		return p.cmd.ProcessState
	default:
		return nil
	}
}

// Running reports whether the process has not exited yet.
func (p *Proc) Running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

func (n *Net) makeHost(name string, addr netip.Addr, idx int) (_ *Host, retErr error) {
	h := &Host{net: n, name: name, addr: addr, nsPath: filepath.Join(n.dir, name+".netns"),
		swLink: fmt.Sprintf("p%d", idx), logDir: filepath.Join(n.dir, name), procs: map[string]*Proc{}}
	if err := os.MkdirAll(h.logDir, 0o700); err != nil {
		return nil, fmt.Errorf("hostsim: %w", err)
	}
	if err := makeNetns(h.nsPath); err != nil {
		return nil, err
	}
	defer func() {
		if retErr != nil {
			_ = n.sw.LinkDel(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: h.swLink}})
			retErr = errors.Join(retErr, removeNetns(h.nsPath))
		}
	}()
	hf, err := os.Open(h.nsPath)
	if err != nil {
		return nil, fmt.Errorf("hostsim: %w", err)
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: h.swLink}, PeerName: hostIfName, PeerNamespace: netlink.NsFd(int(hf.Fd()))}
	err = n.sw.LinkAdd(veth)
	hf.Close()
	if err != nil {
		return nil, fmt.Errorf("hostsim: veth for %s: %w", name, err)
	}
	sw, err := n.sw.LinkByName(h.swLink)
	if err != nil {
		return nil, fmt.Errorf("hostsim: veth for %s: %w", name, err)
	}
	if err := n.sw.LinkSetMaster(sw, n.bridge); err != nil {
		return nil, fmt.Errorf("hostsim: %s on the bridge: %w", h.swLink, err)
	}
	if err := n.sw.LinkSetUp(sw); err != nil {
		return nil, fmt.Errorf("hostsim: %s up: %w", h.swLink, err)
	}
	hh, err := handleAt(h.nsPath)
	if err != nil {
		return nil, err
	}
	defer hh.Close()
	if err := upLoopback(hh); err != nil {
		return nil, err
	}
	eth, err := hh.LinkByName(hostIfName)
	if err != nil {
		return nil, fmt.Errorf("hostsim: %s eth0: %w", name, err)
	}
	na := &netlink.Addr{IPNet: &net.IPNet{IP: net.IP(addr.AsSlice()), Mask: net.CIDRMask(n.cfg.Prefix.Bits(), 32)}}
	if err := hh.AddrAdd(eth, na); err != nil {
		return nil, fmt.Errorf("hostsim: %s address %s: %w", name, addr, err)
	}
	if err := hh.LinkSetUp(eth); err != nil {
		return nil, fmt.Errorf("hostsim: %s eth0 up: %w", name, err)
	}
	if h.cg, err = n.cg.child(fmt.Sprintf("%s.%d", name, h.boot)); err != nil {
		return nil, err
	}
	return h, nil
}

// Name returns the host's name.
func (h *Host) Name() string { return h.name }

// Addr returns the host's address on the switch.
func (h *Host) Addr() netip.Addr { return h.addr }

// Netns returns the path of the host's network namespace (a bind mount).
func (h *Host) Netns() string { return h.nsPath }

// LogDir is where the host's processes' logs are.
func (h *Host) LogDir() string { return h.logDir }

// Start runs c inside the host under name (unique among the host's
// processes; a name whose process has exited may be started again): with
// nsenter into the host's namespace, in a process group of its own and in
// the host's cgroup, stdout and stderr appended to LogDir()/<name>.log.
func (h *Host) Start(name string, c Command) (*Proc, error) {
	if !hostName.MatchString(name) {
		return nil, fmt.Errorf("hostsim: process name %q: %w: want [a-z][a-z0-9-]{0,14}", name, errdefs.ErrInvalid)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, fmt.Errorf("hostsim: %w: host %s closed", errdefs.ErrConflict, h.name)
	}
	if p := h.procs[name]; p != nil && p.Running() {
		return nil, fmt.Errorf("hostsim: %w: %s already runs %s", errdefs.ErrConflict, h.name, name)
	}
	p, err := h.start(name, c)
	if err != nil {
		return nil, err
	}
	known := false
	for i := range h.cmds {
		if h.cmds[i].name == name {
			h.cmds[i].cmd, known = c, true
		}
	}
	if !known {
		h.cmds = append(h.cmds, namedCommand{name, c})
	}
	return p, nil
}

func (h *Host) start(name string, c Command) (*Proc, error) {
	path := c.Path
	if !filepath.IsAbs(path) {
		lp, err := exec.LookPath(path)
		if err != nil {
			return nil, fmt.Errorf("hostsim: %s: %w", name, err)
		}
		path = lp
	}
	nsenter, err := exec.LookPath("nsenter")
	if err != nil {
		return nil, fmt.Errorf("hostsim: %w: nsenter (util-linux): %w", errdefs.ErrUnavailable, err)
	}
	logPath := filepath.Join(h.logDir, name+".log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("hostsim: %w", err)
	}
	defer logf.Close() // the process holds its own descriptor
	args := append([]string{"--net=" + h.nsPath, "--", path}, c.Args...)
	cmd := exec.Command(nsenter, args...)
	cmd.Env, cmd.Dir, cmd.Stdout, cmd.Stderr = c.Env, c.Dir, logf, logf
	if cmd.Env == nil {
		cmd.Env = []string{}
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if h.cg != nil {
		f, err := h.cg.open()
		if err != nil {
			return nil, err
		}
		defer f.Close()
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, int(f.Fd())
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("hostsim: start %s on %s: %w", name, h.name, err)
	}
	p := &Proc{Name: name, Log: logPath, cmd: cmd, done: make(chan struct{})}
	go func() { // owned: ends when the process does (Kill, Close)
		p.waitErr = cmd.Wait()
		close(p.done)
	}()
	h.procs[name] = p
	return p, nil
}

// Proc returns the last process started under name (nil if none).
func (h *Host) Proc(name string) *Proc {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.procs[name]
}

// OwnCgroup makes the cgroup rel (a path relative to the root of the
// cgroup v2 hierarchy) part of the host: Kill kills what runs in it too.
// For processes that move themselves out of the host's cgroup (a
// worker's sandboxes on a pure v2 machine).
func (h *Host) OwnCgroup(rel string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.extraCG = append(h.extraCG, rel)
}

// Kill SIGKILLs every process of the host (its cgroup, the process group
// of each process started, the cgroups it owns) and waits until they are
// gone: the machine lost. Its network stays as it is.
func (h *Host) Kill() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.killLocked()
}

func (h *Host) killLocked() error {
	var errs []error
	for _, p := range h.procs {
		if p.Running() {
			_ = unix.Kill(-p.Pid(), unix.SIGKILL)
		}
	}
	if h.cg != nil {
		if err := h.cg.kill(); err != nil {
			errs = append(errs, err)
		} else if next, err := h.net.cg.child(fmt.Sprintf("%s.%d", h.name, h.boot+1)); err != nil {
			errs = append(errs, err)
		} else {
			h.oldCG = append(h.oldCG, h.cg)
			h.cg, h.boot = next, h.boot+1
		}
	}
	if root := cgroup2Mount(); root != "" {
		for _, rel := range h.extraCG {
			if err := (&cgroup{path: filepath.Join(root, rel)}).kill(); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, p := range h.procs {
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			errs = append(errs, fmt.Errorf("hostsim: %w: %s on %s not reaped 10s after SIGKILL", errdefs.ErrUnavailable, p.Name, h.name))
		}
	}
	return errors.Join(errs...)
}

// Stop sends SIGTERM to each process's group, waits up to grace for them
// to exit, then kills what is left of the host (Kill). It returns the
// names of the processes that had to be killed.
func (h *Host) Stop(grace time.Duration) ([]string, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, p := range h.procs {
		if p.Running() {
			_ = unix.Kill(-p.Pid(), unix.SIGTERM)
		}
	}
	deadline := time.After(grace)
	var killed []string
	for _, p := range h.procs {
		select {
		case <-p.done:
		case <-deadline:
			deadline = nil
		}
		if p.Running() {
			killed = append(killed, p.Name)
		}
	}
	return killed, h.killLocked()
}

// Restart kills whatever still runs on the host, then starts every
// command again, in the order they were first started.
func (h *Host) Restart() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return fmt.Errorf("hostsim: %w: host %s closed", errdefs.ErrConflict, h.name)
	}
	if err := h.killLocked(); err != nil {
		return err
	}
	for _, c := range h.cmds {
		if _, err := h.start(c.name, c.cmd); err != nil {
			return err
		}
	}
	return nil
}

// Partition cuts the host off the switch (its port leaves the bridge):
// its own link stays up, and whatever it or anyone sends across is lost,
// as when a machine's network fails. Heal puts it back.
func (h *Host) Partition() error { return h.setPartitioned(true) }

// Heal ends a Partition.
func (h *Host) Heal() error { return h.setPartitioned(false) }

// Partitioned reports whether the host is cut off.
func (h *Host) Partitioned() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.partitioned
}

func (h *Host) setPartitioned(cut bool) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	link, err := h.net.sw.LinkByName(h.swLink)
	if err != nil {
		return fmt.Errorf("hostsim: %s: %w", h.swLink, err)
	}
	if cut {
		err = h.net.sw.LinkSetNoMaster(link)
	} else {
		err = h.net.sw.LinkSetMaster(link, h.net.bridge)
	}
	if err != nil {
		return fmt.Errorf("hostsim: partition %s=%t: %w", h.name, cut, err)
	}
	h.partitioned = cut
	return nil
}

// DialContext connects from inside the host (the socket is made in its
// namespace), for the test's own clients: e.g. an http.Transport's
// DialContext.
func (h *Host) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	var c net.Conn
	err := onNewThread(func() error {
		f, err := os.Open(h.nsPath)
		if err != nil {
			return fmt.Errorf("hostsim: %w", err)
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("hostsim: enter %s: %w", h.name, err)
		}
		var d net.Dialer
		c, err = d.DialContext(ctx, network, address)
		return err
	})
	return c, err
}

// Listen listens from inside the host (a test's own server).
func (h *Host) Listen(network, address string) (net.Listener, error) {
	var l net.Listener
	err := onNewThread(func() error {
		f, err := os.Open(h.nsPath)
		if err != nil {
			return fmt.Errorf("hostsim: %w", err)
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("hostsim: enter %s: %w", h.name, err)
		}
		l, err = net.Listen(network, address)
		return err
	})
	return l, err
}

// close kills the host's processes and removes its namespace and cgroup.
func (h *Host) close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	errs := []error{h.killLocked()}
	for _, cg := range append(h.oldCG, h.cg) {
		if err := cg.remove(); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, removeNetns(h.nsPath))
	return errors.Join(errs...)
}
