package procid

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// ErrClosed means the Handle was closed (its process was reaped): nothing
// verifies against it. It is a mismatch, so callers fail closed.
var ErrClosed = fmt.Errorf("%w: procid: handle closed (recorded process reaped)", ErrMismatch)

// Handle is a recorded process: its identity (pid, start time, executable
// device+inode and SHA-256) taken once, plus a pidfd that keeps naming that
// very process for as long as the handle is open.
//
// Cost model. The SHA-256 of the executable is computed once, in Open.
// Check, which runs once per connection, does not hash: it compares the
// start time and the executable's device+inode (two reads of
// /proc/<pid>/stat and one stat of /proc/<pid>/exe) and asks the pidfd
// whether the recorded process is still alive. It re-hashes only when the
// executable's size, mtime or ctime changed since Open, which any write to
// the file does; Linux refuses writes to a running executable (ETXTBSY), so
// in practice that path never runs and a per-connection hash (milliseconds
// for a 10 MB binary) would buy nothing. Replacing the file at its path
// does not change the running process's executable; a process that
// re-executes another binary keeps pid and start time but changes
// device+inode, which Check catches.
type Handle struct {
	mu     sync.RWMutex
	p      Process
	meta   exeMeta
	closed bool
	// pidfd is -1 when the kernel has no pidfds (then: pid + start time).
	pidfd int
	// pidfs: pidfds live on pidfs (Linux 6.9+), whose inode number names
	// one process for the whole boot, so two pidfds name the same process
	// exactly when device and inode agree.
	pidfs              bool
	pidfdDev, pidfdIno uint64
}

// Open records the process pid: it opens a pidfd first, then reads the
// identity and hashes the executable, then checks through the pidfd that the
// process it opened is still the one alive under pid, so a pid reused while
// recording cannot be recorded by mistake.
func Open(pid int) (*Handle, error) {
	h := &Handle{pidfd: -1}
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	switch {
	case err == nil:
		h.pidfd = fd
	case errors.Is(err, unix.ESRCH):
		return nil, fmt.Errorf("procid: %w: pid %d: %v", ErrMismatch, pid, err)
	case errors.Is(err, unix.ENOSYS), errors.Is(err, unix.EINVAL), errors.Is(err, unix.EPERM):
		// No pidfds here: fall back to pid + start time.
	default:
		return nil, fmt.Errorf("procid: pidfd_open %d: %w", pid, err)
	}
	fail := func(err error) (*Handle, error) {
		h.Close()
		return nil, err
	}
	p, meta, err := read(pid)
	if err != nil {
		return fail(err)
	}
	sum, err := hashExe(pid, p, meta)
	if err != nil {
		return fail(err)
	}
	p.ExeSHA256 = sum
	h.p, h.meta = p, meta
	if h.pidfd >= 0 {
		var st unix.Stat_t
		if err := unix.Fstat(h.pidfd, &st); err != nil {
			return fail(fmt.Errorf("procid: fstat pidfd: %w", err))
		}
		var sfs unix.Statfs_t
		if err := unix.Fstatfs(h.pidfd, &sfs); err == nil && sfs.Type == unix.PID_FS_MAGIC {
			h.pidfs, h.pidfdDev, h.pidfdIno = true, uint64(st.Dev), st.Ino
		}
		if got, err := pidfdPid(h.pidfd); err != nil || got != pid {
			return fail(fmt.Errorf("procid: %w: pidfd of %d names pid %d (%v)", ErrMismatch, pid, got, err))
		}
		if err := h.alive(); err != nil {
			return fail(err)
		}
	}
	return h, nil
}

// hashExe hashes the executable of pid through /proc/<pid>/exe, making sure
// the file hashed is the one p names and that it did not change meanwhile.
// A file whose device, inode, size, mtime and ctime equal those of a file
// hashed before (or primed, see PrimeExeHash) has that hash: the same
// rule by which Check re-hashes only when size, mtime or ctime changed.
func hashExe(pid int, p Process, meta exeMeta) (string, error) {
	key := exeKey{dev: p.ExeDev, ino: p.ExeIno, meta: meta}
	if sum, ok := exeHashes.get(key); ok {
		return sum, nil
	}
	f, err := os.Open(fmt.Sprintf("/proc/%d/exe", pid))
	if err != nil {
		return "", fmt.Errorf("procid: open exe of %d: %w", pid, err)
	}
	defer f.Close()
	sum, err := hashOpen(f, key)
	if err != nil {
		return "", fmt.Errorf("procid: exe of %d: %w", pid, err)
	}
	return sum, nil
}

// Process returns the recorded identity.
func (h *Handle) Process() Process {
	h.mu.RLock()
	defer h.mu.RUnlock()
	return h.p
}

// HasPidfd reports whether the handle holds a pidfd (false: the checks
// fall back to pid + start time).
func (h *Handle) HasPidfd() bool { return h.pidfd >= 0 }

// Close releases the pidfd; every later check fails with ErrClosed.
func (h *Handle) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil
	}
	h.closed = true
	if h.pidfd >= 0 {
		return unix.Close(h.pidfd)
	}
	return nil
}

// alive asks the pidfd whether the recorded process still exists. A pid
// reused by another process does not fool it, even within one clock tick
// (which a start-time comparison cannot tell apart).
func (h *Handle) alive() error {
	if h.pidfd < 0 {
		return nil
	}
	if err := unix.PidfdSendSignal(h.pidfd, 0, nil, 0); err != nil {
		return fmt.Errorf("procid: %w: recorded process %d is gone (pidfd: %v)", ErrMismatch, h.p.PID, err)
	}
	return nil
}

// Check verifies that the recorded process is alive and unchanged: the
// pidfd still names a live process, and under its pid /proc shows the
// recorded start time and executable. Cheap enough for every connection.
func (h *Handle) Check() error {
	h.mu.RLock()
	if h.closed {
		h.mu.RUnlock()
		return ErrClosed
	}
	p, meta := h.p, h.meta
	now, nowMeta, err := read(p.PID)
	if err == nil {
		// After /proc was read: the pid could not have been reused before
		// the read if the recorded process is still alive now.
		err = h.alive()
	}
	h.mu.RUnlock()
	if err != nil {
		return fmt.Errorf("procid: %w: pid %d: %v", ErrMismatch, p.PID, err)
	}
	if !p.same(now) {
		return p.mismatch(now)
	}
	if nowMeta != meta {
		// The executable file was written to: hash it again.
		sum, err := hashExe(p.PID, now, nowMeta)
		if err != nil {
			return fmt.Errorf("procid: %w: pid %d: %v", ErrMismatch, p.PID, err)
		}
		if sum != p.ExeSHA256 {
			return fmt.Errorf("procid: %w: executable of pid %d changed content (sha256 %s, recorded %s)", ErrMismatch, p.PID, sum, p.ExeSHA256)
		}
		h.mu.Lock()
		h.meta = nowMeta
		h.mu.Unlock()
	}
	return nil
}

// PeerMethod says how VerifyPeer matched the peer with a Handle.
type PeerMethod int

const (
	// PeerPidfdInode: SO_PEERPIDFD, same pidfs inode as the recorded pidfd.
	PeerPidfdInode PeerMethod = iota + 1
	// PeerPidfdPid: SO_PEERPIDFD names the recorded pid and the recorded
	// pidfd is alive (pidfds without pidfs).
	PeerPidfdPid
	// PeerCredPid: SO_PEERCRED pid plus start time (no SO_PEERPIDFD).
	PeerCredPid
)

// VerifyPeer checks that the peer of the Unix connection c is the recorded
// process: SO_PEERCRED names its pid, SO_PEERPIDFD (Linux 6.5+) names the
// same process as the recorded pidfd, and Check passes. Without
// SO_PEERPIDFD it falls back to pid + start time.
func (h *Handle) VerifyPeer(c net.Conn) error {
	_, err := h.VerifyPeerMethod(c)
	return err
}

// VerifyPeerMethod is VerifyPeer that also reports how the peer was matched.
func (h *Handle) VerifyPeerMethod(c net.Conn) (PeerMethod, error) {
	h.mu.RLock()
	p, closed := h.p, h.closed
	h.mu.RUnlock()
	if closed {
		return 0, ErrClosed
	}
	var cred *unix.Ucred
	peerfd := -1
	var credErr, pidfdErr error
	if err := control(c, func(fd int) {
		cred, credErr = unix.GetsockoptUcred(fd, unix.SOL_SOCKET, unix.SO_PEERCRED)
		if h.pidfd >= 0 {
			peerfd, pidfdErr = unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PEERPIDFD)
		}
	}); err != nil {
		return 0, err
	}
	if credErr != nil {
		if peerfd >= 0 {
			unix.Close(peerfd)
		}
		return 0, fmt.Errorf("procid: SO_PEERCRED: %w", credErr)
	}
	if int(cred.Pid) != p.PID {
		if peerfd >= 0 {
			unix.Close(peerfd)
		}
		return 0, fmt.Errorf("procid: %w: peer pid %d, expected %d", ErrMismatch, cred.Pid, p.PID)
	}
	method := PeerCredPid
	switch {
	case h.pidfd < 0, errors.Is(pidfdErr, unix.ENOPROTOOPT), errors.Is(pidfdErr, unix.EINVAL):
		// No SO_PEERPIDFD on this kernel: pid (above) + start time (Check).
	case pidfdErr != nil:
		// ESRCH: the peer process is gone.
		return 0, fmt.Errorf("procid: %w: SO_PEERPIDFD: %v", ErrMismatch, pidfdErr)
	default:
		err := h.samePidfd(peerfd)
		unix.Close(peerfd)
		if err != nil {
			return 0, err
		}
		method = PeerPidfdPid
		if h.pidfs {
			method = PeerPidfdInode
		}
	}
	return method, h.Check()
}

// samePidfd reports whether the pidfd fd names the recorded process.
func (h *Handle) samePidfd(fd int) error {
	if h.pidfs {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return fmt.Errorf("procid: fstat peer pidfd: %w", err)
		}
		if uint64(st.Dev) != h.pidfdDev || st.Ino != h.pidfdIno {
			return fmt.Errorf("procid: %w: peer pidfd names another process (pidfs inode %d, recorded %d)", ErrMismatch, st.Ino, h.pidfdIno)
		}
		return nil
	}
	got, err := pidfdPid(fd)
	if err != nil {
		return err
	}
	if got != h.p.PID {
		return fmt.Errorf("procid: %w: peer pidfd names pid %d, expected %d", ErrMismatch, got, h.p.PID)
	}
	// Same pid number; it is the recorded process if that one is alive.
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.closed {
		return ErrClosed
	}
	return h.alive()
}

// pidfdPid reads the pid a pidfd names from /proc/self/fdinfo (-1 once the
// process has been reaped).
func pidfdPid(fd int) (int, error) {
	b, err := os.ReadFile("/proc/self/fdinfo/" + strconv.Itoa(fd))
	if err != nil {
		return 0, fmt.Errorf("procid: pidfd fdinfo: %w", err)
	}
	return parseFdinfoPid(b)
}

// parseFdinfoPid extracts the "Pid:" field of a pidfd's fdinfo.
func parseFdinfoPid(b []byte) (int, error) {
	for line := range bytes.SplitSeq(b, []byte("\n")) {
		if v, ok := bytes.CutPrefix(line, []byte("Pid:")); ok {
			n, err := strconv.Atoi(string(bytes.TrimSpace(v)))
			if err != nil {
				return 0, fmt.Errorf("procid: malformed pidfd fdinfo: %w", err)
			}
			return n, nil
		}
	}
	return 0, errors.New("procid: pidfd fdinfo has no Pid field")
}

// control runs f on the file descriptor of the Unix connection c.
func control(c net.Conn, f func(fd int)) error {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("procid: not a unix connection: %T", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return fmt.Errorf("procid: %w", err)
	}
	if err := raw.Control(func(fd uintptr) { f(int(fd)) }); err != nil {
		return fmt.Errorf("procid: %w", err)
	}
	return nil
}

// Signal sends sig to the recorded process through its pidfd, so a pid
// reused since cannot receive it (without pidfds: to the pid, after
// Check).
func (h *Handle) Signal(sig unix.Signal) error {
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.closed {
		return ErrClosed
	}
	if h.pidfd >= 0 {
		return unix.PidfdSendSignal(h.pidfd, sig, nil, 0)
	}
	now, err := Read(h.p.PID)
	if err != nil || !h.p.same(now) {
		return fmt.Errorf("procid: %w: pid %d changed", ErrMismatch, h.p.PID)
	}
	return unix.Kill(h.p.PID, sig)
}

// Exited returns a channel closed once the recorded process has exited.
// It serves processes that are not this process's children (adopted after
// a restart): their pidfd becomes readable when they exit, and Go's
// netpoller waits for that, so no thread is held per process. It needs a
// pidfd.
func (h *Handle) Exited() (<-chan struct{}, error) {
	h.mu.RLock()
	if h.closed || h.pidfd < 0 {
		h.mu.RUnlock()
		return nil, fmt.Errorf("procid: exited: %w", ErrClosed)
	}
	fd, err := unix.FcntlInt(uintptr(h.pidfd), unix.F_DUPFD_CLOEXEC, 0)
	h.mu.RUnlock()
	if err != nil {
		return nil, fmt.Errorf("procid: exited: %w", err)
	}
	return WaitPidfd(fd)
}

// WaitPidfd takes ownership of pidfd (opened with PIDFD_NONBLOCK) and
// returns a channel closed once its process has exited; the descriptor is
// closed then.
func WaitPidfd(pidfd int) (<-chan struct{}, error) {
	f := os.NewFile(uintptr(pidfd), "pidfd")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("procid: wait pidfd: %w", err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer f.Close()
		// Read waits (in the netpoller) for readability between calls.
		_ = rc.Read(func(fd uintptr) bool {
			fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			n, err := unix.Poll(fds, 0)
			return err != nil || n > 0
		})
	}()
	return done, nil
}
