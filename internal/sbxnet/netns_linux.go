package sbxnet

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// inNetns runs fn on a fresh locked OS thread moved into target, and moves
// the thread back afterwards. The caller's own thread never changes
// namespace. If the thread cannot be moved back it stays locked, and the
// runtime ends it with its goroutine: no other goroutine ever runs in a
// namespace it did not ask for. fn must not start goroutines that rely on
// the namespace (they run on other threads).
func inNetns(target netns.NsHandle, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("sbxnet: current netns: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			// A failed setns leaves the thread where it was.
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("sbxnet: enter netns: %w", err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("sbxnet: leave netns: %w", err))
			return // still locked: the thread exits with this goroutine
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// newNetnsAt makes a new network namespace and bind-mounts it on path (an
// existing, empty regular file).
func newNetnsAt(path string) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("sbxnet: current netns: %w", err)
			return
		}
		defer orig.Close()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("sbxnet: unshare netns: %w", err)
			return
		}
		merr := unix.Mount("/proc/thread-self/ns/net", path, "", unix.MS_BIND, "")
		if err := netns.Set(orig); err != nil {
			errc <- errors.Join(merr, fmt.Errorf("sbxnet: leave new netns: %w", err))
			return // still locked: the thread exits with this goroutine
		}
		runtime.UnlockOSThread()
		if merr != nil {
			merr = fmt.Errorf("sbxnet: bind-mount netns on %s: %w", path, merr)
		}
		errc <- merr
	}()
	return <-errc
}

// isNetns reports whether fd is a network namespace; an nsfs file of
// another type is an error (someone else's mount on our path).
func isNetns(fd int) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return false, fmt.Errorf("sbxnet: statfs: %w", err)
	}
	if st.Type != unix.NSFS_MAGIC {
		return false, nil
	}
	t, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE)
	if err != nil {
		return false, fmt.Errorf("sbxnet: namespace type: %w", err)
	}
	if t != unix.CLONE_NEWNET {
		return false, fmt.Errorf("sbxnet: %w: a namespace of another kind is mounted there", errdefs.ErrConflict)
	}
	return true, nil
}

// openOrCreateNetns opens the netns mounted at path, creating it (and the
// file it is mounted on) when there is none.
func openOrCreateNetns(path string) (netns.NsHandle, error) {
	fi, err := os.Lstat(path)
	created := false
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return -1, fmt.Errorf("sbxnet: %w", err)
		}
		f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
		if err != nil {
			return -1, fmt.Errorf("sbxnet: %w", err)
		}
		f.Close()
		created = true
	case err != nil:
		return -1, fmt.Errorf("sbxnet: %w", err)
	case !fi.Mode().IsRegular():
		return -1, fmt.Errorf("sbxnet: %w: %s is not a regular file", errdefs.ErrInvalid, path)
	}
	ns, err := netns.GetFromPath(path)
	if err != nil {
		if created {
			os.Remove(path)
		}
		return -1, fmt.Errorf("sbxnet: open %s: %w", path, err)
	}
	ok, err := isNetns(int(ns))
	if err != nil {
		ns.Close()
		return -1, err
	}
	if ok {
		return ns, nil
	}
	// A plain file: ours from before a reboot, or just created. Anything
	// with content is not ours to mount over.
	var st unix.Stat_t
	err = unix.Fstat(int(ns), &st)
	ns.Close()
	if err == nil && st.Size != 0 {
		err = fmt.Errorf("sbxnet: %w: %s is a non-empty file, not a netns", errdefs.ErrConflict, path)
	}
	if err == nil {
		err = newNetnsAt(path)
	}
	if err == nil {
		ns, err = netns.GetFromPath(path)
		if err == nil {
			if ok, verr := isNetns(int(ns)); !ok {
				ns.Close()
				err = errors.Join(verr, fmt.Errorf("sbxnet: %s is no netns after mounting one", path))
			}
		}
	}
	if err != nil {
		if created {
			unix.Unmount(path, unix.MNT_DETACH)
			os.Remove(path)
		}
		return -1, err
	}
	return ns, nil
}

// handleAt makes a rtnetlink handle whose socket lives in ns. The handle is
// made on a thread inside ns (netlink.NewHandleAt would move a thread
// itself and unlock it even when it could not move it back).
func handleAt(ns netns.NsHandle) (*netlink.Handle, error) {
	var h *netlink.Handle
	err := inNetns(ns, func() error {
		var err error
		h, err = netlink.NewHandle(unix.NETLINK_ROUTE)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("sbxnet: netlink handle: %w", err)
	}
	return h, nil
}

// writeSysctls sets /proc/sys values as seen from inside ns (the /proc/sys/net
// tree is the one of the opening thread's netns). A missing file is skipped
// only when allowMissing says so (IPv6 compiled out).
func writeSysctls(ns netns.NsHandle, kv [][2]string, allowMissing func(string) bool) error {
	return inNetns(ns, func() error {
		for _, e := range kv {
			p := "/proc/sys/" + e[0]
			if err := os.WriteFile(p, []byte(e[1]), 0o644); err != nil {
				if errors.Is(err, fs.ErrNotExist) && allowMissing(e[0]) {
					continue
				}
				return fmt.Errorf("sbxnet: sysctl %s=%s: %w", e[0], e[1], err)
			}
		}
		return nil
	})
}
