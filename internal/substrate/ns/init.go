//go:build linux

package ns

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// initArg0 is the argv[0] with which Start re-executes the host binary as a
// sandbox init.
const initArg0 = "space-nsinit"

// File descriptors of the init: 3 carries the initConfig (parent -> init,
// written only after the init was placed in its cgroups), 4 is the user
// group's cgroup.procs (opened for writing by the parent; inherited as is
// by the agent, SPACE_CGROUP_FD=4), 5 carries the init's status back ("ok"
// right before exec, then "E:<error>" if anything failed). fd 3 is later
// replaced by the agent's listener.
const (
	initConfigFD  = 3
	agentCgroupFD = 4
	initStatusFD  = 5
	initBinaryFD  = 6
	agentListenFD = 3
)

// initConfig is what the init needs to build the sandbox.
type initConfig struct {
	Hostname string `json:"hostname"`
	// Lowers are the overlay's lower layers, top first (host paths, used
	// without a user namespace): the host template, or an image's stack.
	Lowers []string `json:"lowers"`
	// HostUsr binds Usr at /usr (the host template; an image has its own).
	HostUsr bool `json:"hostUsr"`
	// Suid mounts the root file system without nosuid (an image in a user
	// namespace: its set-uid binaries, sudo, become root of the
	// sandbox's namespace only).
	Suid bool `json:"suid"`
	// Layer is where the writable layer (upper/ and work/) is attached:
	// it arrives as a detached mount, the one descriptor sent with the
	// configuration without a user namespace.
	Layer  string   `json:"layer"`
	Rootfs string   `json:"rootfs"`
	Usr    string   `json:"usr"`
	Socket string   `json:"socket"`
	Agent  string   `json:"agent"`
	Env    []string `json:"env"`
	// MaxPTYs is the devpts instance's max=.
	MaxPTYs int `json:"maxPtys"`
	// UserNS: the init runs in a user namespace of its own and gets, with
	// the configuration, descriptors (userns.go, nsFDs): NLower lower
	// layers (top first), the writable layer, the activation directory
	// (for the agent's socket) and, with HostUsr, /usr as idmapped
	// detached mounts, and the agent binary as a detached bind. Lowers,
	// Layer, Rootfs, Usr, Socket and Agent are then unused.
	UserNS bool `json:"userns"`
	NLower int  `json:"nlower"`
	// Volumes are Spec.Volumes' paths; their mounts (volFDs) come after
	// the descriptors above (volumes.go).
	Volumes []string `json:"volumes,omitempty"`
	volFDs  []int
}

// nsFDs are the positions of a user-namespaced init's descriptors, in the
// order they are sent; usr is -1 without HostUsr.
type nsFDs struct{ layer, dir, usr, agent, count int }

func (c *initConfig) nsFDs() nsFDs {
	f := nsFDs{layer: c.NLower, dir: c.NLower + 1, usr: -1, agent: c.NLower + 2}
	if c.HostUsr {
		f.usr, f.agent = c.NLower+2, c.NLower+3
	}
	f.count = f.agent + 1
	return f
}

// MaybeInit must be the first statement of main() in every binary that
// hosts the ns substrate. When the process was started by Start as a
// sandbox init (argv[0] == "space-nsinit") it builds the sandbox and execs
// the agent, never returning; otherwise it returns at once.
func MaybeInit() {
	if len(os.Args) == 0 || os.Args[0] != initArg0 {
		return
	}
	runtime.LockOSThread() // credentials, seccomp and exec on one thread
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "space-nsinit: not the init of a new pid namespace; refusing")
		os.Exit(2)
	}
	// Keep the status fd, the init binary and anything the worker itself
	// inherited out of the agent.
	_, _ = unix.FcntlInt(initStatusFD, unix.F_SETFD, unix.FD_CLOEXEC)
	if err := unix.CloseRange(initBinaryFD, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		report("E:close_range: " + err.Error())
		os.Exit(1)
	}
	err := runInit()
	// Only reached on failure (runInit execs on success).
	report("E:" + err.Error())
	os.Exit(1)
}

func report(s string) {
	b := []byte(s)
	for len(b) > 0 {
		n, err := unix.Write(initStatusFD, b)
		if err != nil {
			return
		}
		b = b[n:]
	}
}

func runInit() error {
	raw, fds, err := recvConfig(initConfigFD)
	if err != nil {
		return err
	}
	if len(raw) == 0 {
		return errors.New("no config from parent (start aborted)")
	}
	var cfg initConfig
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return fmt.Errorf("decode config: %w", err)
	}
	if nv := len(cfg.Volumes); nv <= len(fds) {
		cfg.volFDs, fds = fds[len(fds)-nv:], fds[:len(fds)-nv]
	} // else: the counts below fail
	if cfg.UserNS {
		if cfg.NLower < 1 || len(fds) != cfg.nsFDs().count {
			return fmt.Errorf("config came with %d descriptors for %d lower layers", len(fds), cfg.NLower)
		}
		if err := becomeNamespaceRoot(); err != nil {
			return err
		}
	} else if len(fds) != 1 {
		return fmt.Errorf("config came with %d descriptors, want 1", len(fds))
	}
	// The parent placed us in the sandbox cgroups only after clone; a fresh
	// cgroup namespace rooted there hides the host's cgroup paths.
	if err := unix.Unshare(unix.CLONE_NEWCGROUP); err != nil {
		return fmt.Errorf("unshare cgroup ns: %w", err)
	}
	var lfd int
	if cfg.UserNS {
		lfd, err = setupUserNSRootfs(&cfg, fds)
	} else {
		lfd, err = setupRootfs(&cfg, fds[0])
	}
	if err != nil {
		return err
	}
	if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
		return fmt.Errorf("sethostname: %w", err)
	}
	if err := loopbackUp(); err != nil {
		return err
	}
	if cfg.UserNS {
		// No no_new_privs: set-uid binaries (sudo) work, and make a process
		// root only in the sandbox's namespace. Without it, installing the
		// filter takes CAP_SYS_ADMIN (in this namespace), so it goes first.
		if err := installSeccomp(); err != nil {
			return err
		}
		if err := dropCapabilities(); err != nil {
			return err
		}
	} else {
		if err := dropCapabilities(); err != nil {
			return err
		}
		if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
			return fmt.Errorf("no_new_privs: %w", err)
		}
		if err := installSeccomp(); err != nil {
			return err
		}
	}
	// fd 3 (the config pipe) becomes the listener, without CLOEXEC.
	if lfd == agentListenFD {
		if _, err := unix.FcntlInt(uintptr(lfd), unix.F_SETFD, 0); err != nil {
			return fmt.Errorf("listener fd: %w", err)
		}
	} else {
		if err := unix.Dup3(lfd, agentListenFD, 0); err != nil {
			return fmt.Errorf("dup listener: %w", err)
		}
		_ = unix.Close(lfd)
	}
	env := []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME=/root",
		"USER=root",
		"LANG=C.UTF-8",
		"TERM=xterm-256color",
		"HOSTNAME=" + cfg.Hostname,
		"SPACE_SANDBOX_ID=" + cfg.Hostname,
		"SPACE_LISTEN_FD=3",
		"SPACE_CGROUP_FD=" + strconv.Itoa(agentCgroupFD),
	}
	env = append(env, cfg.Env...)
	// Claimed: from now on the sandbox outlives the worker that started
	// it (a restart or an upgrade re-adopts it, adopt.go). Until here the
	// parent-death signal stays: an init nobody recorded (a warm one, one
	// whose start was cut short) must die with its worker.
	if err := unix.Prctl(unix.PR_SET_PDEATHSIG, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("clear the parent-death signal: %w", err)
	}
	report("ok")
	err = unix.Exec(agentMount, []string{"spaced-guest"}, env)
	return fmt.Errorf("exec %s: %w", agentMount, err)
}

func mount(src, dst, fstype string, flags uintptr, data string) error {
	if err := unix.Mount(src, dst, fstype, flags, data); err != nil {
		return fmt.Errorf("mount %s on %s (%s): %w", src, dst, fstype, err)
	}
	return nil
}

// bindRO bind-mounts src on dst and remounts it read-only with flags.
func bindRO(src, dst string, flags uintptr) error {
	if err := mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		return err
	}
	return mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|flags, "")
}

// setupRootfs builds the sandbox's mount tree, binds the agent socket and
// pivots into the rootfs. It returns the listening socket's fd.
func setupRootfs(c *initConfig, layerFD int) (int, error) {
	if err := mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return -1, err
	}
	if err := unix.MoveMount(layerFD, "", unix.AT_FDCWD, c.Layer, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return -1, fmt.Errorf("attach the writable layer on %s: %w", c.Layer, err)
	}
	_ = unix.Close(layerFD)
	r := c.Rootfs
	if len(c.Lowers) == 0 {
		return -1, errors.New("no lower layer")
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s/upper,workdir=%s/work", strings.Join(c.Lowers, ":"), c.Layer, c.Layer)
	if len(opts) >= 4000 { // mount options are at most a page
		lowers, err := stageLowers(c)
		if err != nil {
			return -1, err
		}
		opts = fmt.Sprintf("lowerdir=%s,upperdir=%s/upper,workdir=%s/work", strings.Join(lowers, ":"), c.Layer, c.Layer)
	}
	// nodev everywhere writable: CAP_MKNOD nodes are inert (no device
	// cgroup needed). nosuid: without a user namespace set-uid root would
	// be host root (c.Suid is never set here).
	if err := mount("overlay", r, "overlay", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		return -1, err
	}
	if err := addHostsEntry(r, c.Hostname); err != nil {
		return -1, err
	}
	if c.HostUsr {
		if err := bindRO(c.Usr, filepath.Join(r, "usr"), unix.MS_NOSUID|unix.MS_NODEV); err != nil {
			return -1, err
		}
	}
	if err := ensureMountPoints(r); err != nil {
		return -1, err
	}
	if err := setupProc(r); err != nil {
		return -1, err
	}
	if err := setupDev(r, c.MaxPTYs); err != nil {
		return -1, err
	}
	if err := bindRO(c.Agent, filepath.Join(r, agentMount), unix.MS_NOSUID|unix.MS_NODEV); err != nil {
		return -1, err
	}
	if err := mountVolumes(r, c.Volumes, c.volFDs); err != nil {
		return -1, err
	}
	lfd, err := listenUnix(c.Socket)
	if err != nil {
		return -1, err
	}
	if err := pivot(r); err != nil {
		return -1, err
	}
	return lfd, nil
}

func setupProc(r string) error {
	p := filepath.Join(r, "proc")
	if err := mount("proc", p, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	// Without a user namespace root in the sandbox is host root for /proc:
	// make the kernel knobs read-only and mask the leaky files (as Docker).
	for _, ro := range []string{"sys", "sysrq-trigger", "irq", "bus", "fs"} {
		t := filepath.Join(p, ro)
		if _, err := os.Lstat(t); err != nil {
			continue
		}
		if err := bindRO(t, t, unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC); err != nil {
			return err
		}
	}
	for _, m := range []string{"kcore", "keys", "timer_list", "sched_debug", "latency_stats", "kallsyms", "kpagecount", "kpageflags", "kpagecgroup", "config.gz"} {
		t := filepath.Join(p, m)
		if fi, err := os.Lstat(t); err != nil || fi.IsDir() {
			continue
		}
		if err := mount("/dev/null", t, "", unix.MS_BIND, ""); err != nil {
			return err
		}
	}
	for _, m := range []string{"acpi", "scsi"} {
		t := filepath.Join(p, m)
		if fi, err := os.Lstat(t); err != nil || !fi.IsDir() {
			continue
		}
		if err := mount("tmpfs", t, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=0"); err != nil {
			return err
		}
	}
	return nil
}

func setupDev(r string, maxPTYs int) error {
	d := filepath.Join(r, "dev")
	if err := mount("tmpfs", d, "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, "mode=755,size=65536k,nr_inodes=4096"); err != nil {
		return err
	}
	for _, n := range []string{"null", "zero", "full", "random", "urandom", "tty"} {
		t := filepath.Join(d, n)
		if err := os.WriteFile(t, nil, 0o666); err != nil {
			return err
		}
		if err := mount("/dev/"+n, t, "", unix.MS_BIND, ""); err != nil {
			return err
		}
	}
	for _, dir := range []struct {
		name string
		mode os.FileMode
	}{{"pts", 0o755}, {"shm", os.ModeSticky | 0o777}, {"mqueue", 0o755}} {
		if err := os.Mkdir(filepath.Join(d, dir.name), dir.mode); err != nil {
			return err
		}
	}
	if err := mount("devpts", filepath.Join(d, "pts"), "devpts", unix.MS_NOSUID|unix.MS_NOEXEC, fmt.Sprintf("newinstance,ptmxmode=0666,mode=620,gid=5,max=%d", maxPTYs)); err != nil {
		return err
	}
	if err := mount("shm", filepath.Join(d, "shm"), "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=1777,size=65536k"); err != nil {
		return err
	}
	if err := mount("mqueue", filepath.Join(d, "mqueue"), "mqueue", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	links := [][2]string{
		{"pts/ptmx", "ptmx"}, {"/proc/self/fd", "fd"}, {"/proc/self/fd/0", "stdin"},
		{"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"},
	}
	for _, l := range links {
		if err := os.Symlink(l[0], filepath.Join(d, l[1])); err != nil {
			return err
		}
	}
	// Nothing else is ever added: make /dev's tmpfs read-only and nodev
	// (the binds above keep their own flags).
	return mount("", d, "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NOEXEC|unix.MS_NODEV, "mode=755,size=65536k,nr_inodes=4096")
}

// stageLowers binds the lower layers under short names in a private
// tmpfs (in this mount namespace only; pivot detaches it) when their host
// paths together are too long for overlay's options. The tmpfs goes on a
// directory that holds none of the paths the overlay needs.
func stageLowers(c *initConfig) ([]string, error) {
	under := func(p, dir string) bool { return p == dir || strings.HasPrefix(p, dir+"/") }
	staging := ""
	for _, d := range []string{"/mnt", "/run", "/tmp", "/media", "/srv"} {
		ok := !under(c.Rootfs, d) && !under(c.Layer, d)
		for _, l := range c.Lowers {
			ok = ok && !under(l, d)
		}
		if fi, err := os.Stat(d); ok && err == nil && fi.IsDir() {
			staging = d
			break
		}
	}
	if staging == "" {
		return nil, fmt.Errorf("overlay options of %d lower layers exceed a page and there is no directory to stage them under", len(c.Lowers))
	}
	if err := mount("tmpfs", staging, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0700,size=64k"); err != nil {
		return nil, err
	}
	out := make([]string, len(c.Lowers))
	for i, l := range c.Lowers {
		out[i] = filepath.Join(staging, strconv.Itoa(i))
		if err := os.Mkdir(out[i], 0o700); err != nil {
			return nil, err
		}
		if err := mount(l, out[i], "", unix.MS_BIND, ""); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// ensureMountPoints makes what the init mounts on in the root file system
// r if its image lacks it (written into the sandbox's writable layer):
// /proc, /dev and the agent binary's file.
func ensureMountPoints(r string) error {
	for _, d := range []string{"proc", "dev", filepath.Dir(strings.TrimPrefix(agentMount, "/"))} {
		p := filepath.Join(r, d)
		if fi, err := os.Lstat(p); err == nil && fi.IsDir() {
			continue
		}
		if err := os.Mkdir(p, 0o755); err != nil {
			return fmt.Errorf("mount point /%s: %w", d, err)
		}
	}
	p := filepath.Join(r, agentMount)
	if fi, err := os.Lstat(p); err == nil && fi.Mode().IsRegular() {
		return nil
	}
	if err := os.WriteFile(p, nil, 0o755); err != nil {
		return fmt.Errorf("mount point %s: %w", agentMount, err)
	}
	return nil
}

// addHostsEntry makes the sandbox's hostname resolve (sudo, and many
// tools, look it up) by adding it to the rootfs's /etc/hosts unless a
// line there names it already. The file is the sandbox's own (copied up
// into its writable layer once).
func addHostsEntry(r, hostname string) error {
	p := filepath.Join(r, "etc/hosts")
	b, err := os.ReadFile(p)
	if err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("read /etc/hosts: %w", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		f := strings.Fields(line)
		for _, name := range f[min(1, len(f)):] {
			if name == hostname {
				return nil
			}
		}
	}
	if len(b) > 0 && b[len(b)-1] != '\n' {
		b = append(b, '\n')
	}
	b = append(b, "127.0.1.1\t"+hostname+"\n"...)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		return fmt.Errorf("write /etc/hosts: %w", err)
	}
	return nil
}

// listenUnix binds and listens on path (still a host path: we have not
// pivoted yet) and returns the fd (CLOEXEC; MaybeInit dups it to fd 3).
func listenUnix(path string) (int, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socket: %w", err)
	}
	old := unix.Umask(0o177)
	err = unix.Bind(fd, &unix.SockaddrUnix{Name: path})
	unix.Umask(old)
	if err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("bind %s: %w", path, err)
	}
	if err := unix.Listen(fd, 128); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("listen %s: %w", path, err)
	}
	return fd, nil
}

// pivot makes r the root and detaches the old root.
func pivot(r string) error {
	if err := unix.Chdir(r); err != nil {
		return fmt.Errorf("chdir rootfs: %w", err)
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	// The old root is now stacked on top of "."; detach it.
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach old root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return fmt.Errorf("chdir /: %w", err)
	}
	return nil
}

// loopbackUp brings up lo, the only interface of the new network namespace.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("lo: socket: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("lo: get flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("lo: up: %w", err)
	}
	return nil
}

// hostnameFor derives a valid hostname from a sandbox id (already a DNS
// label; kept as a function for clarity).
func hostnameFor(id string) string { return strings.ToLower(id) }
