//go:build linux

package ns

// User namespaces. With Config.NoUserNamespaces unset, every sandbox gets
// a user namespace of its own whose 65536 ids map to a host range leased
// for the instance (internal/substrate/uidlease): root in the sandbox is
// an unprivileged uid on the host, and the kernel's per-user limits
// (inotify instances and watches, RLIMIT_NPROC, ...) are counted per
// sandbox: the namespace is owned by the range's first uid (the spawner
// thread takes that effective uid for the clone), so its counts charge
// that uid, not host root's shared ones.
//
// File ownership inside stays what it was without the namespace: the
// template, /usr and the writable layer reach the init as idmapped
// detached mounts (open_tree + mount_setattr MOUNT_ATTR_IDMAP, made by the
// worker with the host's privileges) mapping host uid N to sandbox uid N.
// So the read-only template still reads as root-owned inside, and what a
// sandbox writes is stored on disk under the ids it has inside (0, 1000,
// ...), whichever range the activation had: snapshots and moves carry
// owners unchanged to any worker and range. The overlay is mounted by the
// init inside its namespace with userxattr (trusted.* xattrs need host
// privileges), so its whiteouts are 0/0 devices as always and opaque
// directories carry user.overlay.opaque.
//
// The init cannot reach host paths under 0700 directories (it has no
// capability in the host's namespace), so everything it needs from the
// host arrives as a descriptor: the init binary (executed through
// /proc/self/fd), the mounts above, the agent binary (a detached bind)
// and the activation directory, in which the init binds the agent's
// socket (it owns that directory through the idmapping).

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/substrate"
)

// withThreadEUID runs f on the calling (locked) thread with its effective
// uid set to euid and its effective capabilities kept, then restores
// euid 0. Only this thread's credentials change: raw setresuid, not Go's
// all-threads syscall.
func withThreadEUID(euid uint32, f func() error) error {
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), uintptr(euid), ^uintptr(0)); e != 0 {
		return fmt.Errorf("ns: set thread euid: %w", e)
	}
	restore := func() error {
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), 0, ^uintptr(0)); e != 0 {
			// A spawner thread that cannot become root again must not
			// start anything else: the caller treats this as fatal.
			return fmt.Errorf("ns: restore thread euid: %w", e)
		}
		return nil
	}
	// Leaving euid 0 clears the effective set (the permitted set stays:
	// the saved uid is still 0); writing the child's id maps needs
	// CAP_SETUID and CAP_SETGID effective.
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return errors.Join(fmt.Errorf("ns: capget: %w", err), restore())
	}
	for i := range data {
		data[i].Effective = data[i].Permitted
	}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return errors.Join(fmt.Errorf("ns: capset: %w", err), restore())
	}
	err := f()
	if rerr := restore(); rerr != nil {
		return errors.Join(err, rerr)
	}
	return err
}

// idmapClone returns a detached copy of the mount at path (only that
// mount, not what is mounted below it) with attrs set and, when usernsFD
// is not -1, the ids of that user namespace's mapping applied: host id N
// reads as N inside it.
func idmapClone(path string, usernsFD int, attrs uint64) (int, error) {
	fd, err := unix.OpenTree(unix.AT_FDCWD, path, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_SYMLINK_NOFOLLOW)
	if err != nil {
		return -1, fmt.Errorf("open_tree %s: %w", path, err)
	}
	return setMountAttrs(fd, path, usernsFD, attrs)
}

// idmapCloneFD is idmapClone of the mount open at mfd (a detached one).
func idmapCloneFD(mfd, usernsFD int, attrs uint64) (int, error) {
	fd, err := unix.OpenTree(mfd, "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_EMPTY_PATH)
	if err != nil {
		return -1, fmt.Errorf("open_tree of a detached mount: %w", err)
	}
	return setMountAttrs(fd, "a detached mount", usernsFD, attrs)
}

// setMountAttrs applies attrs (and the idmapping of usernsFD unless -1) to
// the detached mount fd, closing it on error.
func setMountAttrs(fd int, path string, usernsFD int, attrs uint64) (int, error) {
	attr := unix.MountAttr{Attr_set: attrs}
	if usernsFD >= 0 {
		attr.Attr_set |= unix.MOUNT_ATTR_IDMAP
		attr.Userns_fd = uint64(usernsFD)
	}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("mount_setattr %s: %w", path, err)
	}
	return fd, nil
}

var (
	usernsOnce   sync.Once
	usernsReason string
)

// userNamespacesUnsupported returns why this kernel cannot run sandboxes
// in user namespaces the way userns.go does, or "" when it can: idmapped
// mounts (5.12), overlayfs on idmapped layers inside a user namespace
// with userxattr (5.19).
func userNamespacesUnsupported() string {
	usernsOnce.Do(func() {
		var u unix.Utsname
		if err := unix.Uname(&u); err != nil {
			usernsReason = "uname: " + err.Error()
			return
		}
		rel := unix.ByteSliceToString(u.Release[:])
		major, minor, ok := kernelVersion(rel)
		if !ok {
			usernsReason = "unrecognized kernel release " + strconv.Quote(rel)
			return
		}
		if major < 5 || (major == 5 && minor < 19) {
			usernsReason = fmt.Sprintf("kernel %s is older than 5.19 (overlayfs on idmapped layers in a user namespace)", rel)
			return
		}
		if b, err := os.ReadFile("/proc/sys/user/max_user_namespaces"); err == nil && strings.TrimSpace(string(b)) == "0" {
			usernsReason = "user.max_user_namespaces is 0"
		}
	})
	return usernsReason
}

func kernelVersion(rel string) (major, minor int, ok bool) {
	a, rest, ok1 := strings.Cut(rel, ".")
	b, _, _ := strings.Cut(rest, ".")
	b = strings.TrimRightFunc(b, func(r rune) bool { return r < '0' || r > '9' })
	if i := strings.IndexFunc(b, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
		b = b[:i]
	}
	x, err1 := strconv.Atoi(a)
	y, err2 := strconv.Atoi(b)
	return x, y, ok1 && err1 == nil && err2 == nil
}

// usernsFiles makes what the init of a user-namespaced sandbox gets as
// descriptors, in the order of initConfig's documentation: the lower
// layers (top first), the writable layer (upper/ and work/), the
// activation directory (the init binds the agent's socket in it), /usr
// when hostUsr (the host template) and the agent binary. An image's
// layers (hostUsr false) are not nosuid: their set-uid binaries (sudo)
// make a process root of the sandbox's namespace only.
func (s *Substrate) usernsFiles(pid int, lowers []string, hostUsr bool, spec substrate.Spec) (fds []int, err error) {
	defer func() {
		if err != nil {
			closeFDs(fds)
			fds = nil
		}
	}()
	uns, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("ns: user namespace of init %d: %w", pid, err)
	}
	defer unix.Close(uns)
	type mnt struct {
		path   string
		userns int
		attrs  uint64
	}
	lowerAttrs := uint64(unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NODEV)
	if hostUsr {
		lowerAttrs |= unix.MOUNT_ATTR_NOSUID // the generated template has no set-uid files
	}
	var ms []mnt
	for _, l := range lowers {
		ms = append(ms, mnt{l, uns, lowerAttrs})
	}
	ms = append(ms,
		mnt{"", uns, 0}, // the writable layer: s.layerClone
		mnt{spec.Dir, uns, unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC})
	if hostUsr {
		// Set-uid binaries here (sudo) only make a process root in the
		// sandbox's namespace.
		ms = append(ms, mnt{s.cfg.UsrDir, uns, unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NODEV})
	}
	ms = append(ms, mnt{spec.AgentPath, -1, unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV})
	for _, m := range ms {
		var fd int
		var err error
		if m.path == "" {
			fd, err = s.layerClone(spec.Dir, m.userns)
		} else {
			fd, err = idmapClone(m.path, m.userns, m.attrs)
		}
		if err != nil {
			return fds, fmt.Errorf("ns: %w", err)
		}
		fds = append(fds, fd)
	}
	return fds, nil
}

// sendConfig writes the init's configuration with fds attached to its
// first byte, then ends the stream.
func sendConfig(w *os.File, b []byte, fds []int) error {
	rc, err := w.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	err = rc.Write(func(fd uintptr) bool {
		var oob []byte
		if len(fds) > 0 {
			oob = unix.UnixRights(fds...)
		}
		for len(b) > 0 {
			n, err := unix.SendmsgN(int(fd), b, oob, nil, 0)
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				serr = err
				return true
			}
			b, oob = b[n:], nil
		}
		return true
	})
	if err != nil {
		return err
	}
	return serr
}

// recvConfig reads the configuration and the descriptors sent with it
// (CLOEXEC) until the sender closes its end.
func recvConfig(fd int) (raw []byte, fds []int, err error) {
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(253*4)) // SCM_MAX_FD
	for {
		n, oobn, _, _, err := unix.Recvmsg(fd, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, fds, fmt.Errorf("read config: %w", err)
		}
		if oobn > 0 {
			msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
			if err != nil {
				return nil, fds, fmt.Errorf("read config: %w", err)
			}
			for i := range msgs {
				got, err := unix.ParseUnixRights(&msgs[i])
				if err != nil {
					return nil, fds, fmt.Errorf("read config: %w", err)
				}
				fds = append(fds, got...)
			}
		}
		if n == 0 && oobn == 0 {
			return raw, fds, nil
		}
		raw = append(raw, buf[:n]...)
		if len(raw) > 1<<20 {
			return nil, fds, errors.New("read config: over 1 MiB")
		}
	}
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}
