package hostsim

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// onNewThread runs fn on an OS thread of its own that is thrown away
// afterwards (its goroutine ends locked, so the runtime ends the thread):
// fn may change the thread's namespaces. The main thread is never used
// (the runtime would wedge it instead of ending it), see netsim.
func onNewThread(fn func() error) error {
	errc := make(chan error, 1)
	var run func(handed chan<- struct{})
	run = func(handed chan<- struct{}) {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if unix.Gettid() == unix.Getpid() {
			h := make(chan struct{})
			go run(h)
			<-h
			runtime.UnlockOSThread()
			return
		}
		if handed != nil {
			close(handed)
		}
		errc <- fn()
	}
	go run(nil)
	return <-errc
}

// makeNetns creates a network namespace bind-mounted at path (a new
// file).
func makeNetns(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
	if err != nil {
		return fmt.Errorf("hostsim: netns file: %w", err)
	}
	f.Close()
	err = onNewThread(func() error {
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			if errors.Is(err, unix.EPERM) {
				err = fmt.Errorf("%w: %w (needs CAP_SYS_ADMIN)", errdefs.ErrDenied, err)
			}
			return fmt.Errorf("hostsim: unshare network namespace: %w", err)
		}
		if err := unix.Mount("/proc/thread-self/ns/net", path, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("hostsim: bind-mount network namespace at %s: %w", path, err)
		}
		return nil
	})
	if err != nil {
		os.Remove(path)
	}
	return err
}

// removeNetns unmounts path and removes the file: the namespace goes
// once no process is in it.
func removeNetns(path string) error {
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("hostsim: unmount %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("hostsim: %w", err)
	}
	return nil
}

// handleAt returns a netlink handle whose sockets live in the namespace
// bind-mounted at path.
func handleAt(path string) (*netlink.Handle, error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, fmt.Errorf("hostsim: open %s: %w", path, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("hostsim: netlink in %s: %w", path, err)
	}
	return h, nil
}

func upLoopback(h *netlink.Handle) error {
	lo, err := h.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("hostsim: lo: %w", err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		return fmt.Errorf("hostsim: lo up: %w", err)
	}
	return nil
}

// netnsInode returns the inode of the namespace bind-mounted at path.
func netnsInode(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}

// cgroup is a directory of the cgroup v2 hierarchy (nil methods are
// no-ops: without a v2 hierarchy processes are tracked by group only).
type cgroup struct {
	path string
}

// cgroup2Mount returns where the cgroup v2 hierarchy is mounted ("" when
// it is not).
func cgroup2Mount() string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		pf, sf := strings.Fields(pre), strings.Fields(post)
		if ok && len(pf) >= 5 && len(sf) >= 1 && sf[0] == "cgroup2" {
			return pf[4]
		}
	}
	return ""
}

// newCgroup makes hostsim.<name> at the top of the v2 hierarchy (nil
// when there is none).
func newCgroup(name string) (*cgroup, error) {
	root := cgroup2Mount()
	if root == "" {
		return nil, nil
	}
	p := filepath.Join(root, "hostsim."+name)
	if err := os.Mkdir(p, 0o755); err != nil {
		return nil, fmt.Errorf("hostsim: cgroup: %w", err)
	}
	return &cgroup{path: p}, nil
}

func (c *cgroup) child(name string) (*cgroup, error) {
	if c == nil {
		return nil, nil
	}
	p := filepath.Join(c.path, name)
	if err := os.Mkdir(p, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("hostsim: cgroup: %w", err)
	}
	return &cgroup{path: p}, nil
}

// open returns a descriptor of the directory (clone3's CLONE_INTO_CGROUP).
func (c *cgroup) open() (*os.File, error) {
	f, err := os.Open(c.path)
	if err != nil {
		return nil, fmt.Errorf("hostsim: cgroup: %w", err)
	}
	return f, nil
}

// pids lists the processes in the cgroup and its descendants.
func (c *cgroup) pids() []int {
	if c == nil {
		return nil
	}
	var out []int
	_ = filepath.WalkDir(c.path, func(p string, d os.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		b, err := os.ReadFile(filepath.Join(p, "cgroup.procs"))
		if err != nil {
			return nil
		}
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil {
				out = append(out, pid)
			}
		}
		return nil
	})
	return out
}

// kill SIGKILLs every process in the cgroup and its descendants
// (cgroup.kill; each listed process where the kernel has none) and waits
// up to 10 s for them to be gone.
func (c *cgroup) kill() error {
	if c == nil {
		return nil
	}
	if _, err := os.Stat(c.path); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if err := os.WriteFile(filepath.Join(c.path, "cgroup.kill"), []byte("1"), 0); err != nil {
			for _, pid := range c.pids() {
				_ = unix.Kill(pid, unix.SIGKILL)
			}
		}
		left := c.pids()
		if len(left) == 0 {
			return nil
		}
		// A frozen process takes its SIGKILL only once thawed (a paused
		// sandbox in a cgroup v1 freezer).
		for _, pid := range left {
			thaw(pid)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("hostsim: %w: processes %v still in %s 10s after SIGKILL", errdefs.ErrUnavailable, c.pids(), c.path)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// remove kills what is left and removes the cgroup and its descendants
// (deepest first).
func (c *cgroup) remove() error {
	if c == nil {
		return nil
	}
	if err := c.kill(); err != nil {
		return err
	}
	var dirs []string
	_ = filepath.WalkDir(c.path, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	var errs []error
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := unix.Rmdir(dirs[i]); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("hostsim: remove cgroup %s: %w", dirs[i], err))
		}
	}
	return errors.Join(errs...)
}

// thaw thaws the freezer cgroups pid is in: v1's freezer.state and
// v2's cgroup.freeze (best effort: a process that is gone needs none).
func thaw(pid int) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 || f[2] == "/" {
			continue
		}
		switch {
		case f[1] == "" && f[0] == "0":
			if root := cgroup2Mount(); root != "" {
				_ = os.WriteFile(filepath.Join(root, f[2], "cgroup.freeze"), []byte("0"), 0)
			}
		case slices.Contains(strings.Split(f[1], ","), "freezer"):
			if root := freezerMount(); root != "" {
				_ = os.WriteFile(filepath.Join(root, f[2], "freezer.state"), []byte("THAWED"), 0)
			}
		}
	}
}

// freezerMount returns where the cgroup v1 freezer is mounted ("" when
// it is not).
func freezerMount() string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		pf, sf := strings.Fields(pre), strings.Fields(post)
		if ok && len(pf) >= 5 && len(sf) >= 3 && sf[0] == "cgroup" && slices.Contains(strings.Split(sf[2], ","), "freezer") {
			return pf[4]
		}
	}
	return ""
}
