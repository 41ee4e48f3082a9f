package gateway

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ErrNetnsMismatch means the network namespace or the process it was taken
// from is not the one sbx-manager recorded at activation.
var ErrNetnsMismatch = errors.New("gateway: sandbox network namespace mismatch")

// NetnsDialer dials 127.0.0.1:<port> inside one network namespace.
//
// The namespace is opened once, at start, from /proc/<pid>/ns/net and held
// as a file descriptor: a later pid change or reuse cannot redirect it. It
// is checked against what sbx-manager recorded at activation (namespace
// inode, and the init process's start time read after opening, so the fd
// belongs to that very process). A dedicated goroutine locked to its OS
// thread enters the namespace with setns(2) and does nothing but create
// sockets there; it never unlocks, so the thread is discarded when it ends
// and no other goroutine ever runs in the sandbox's namespace. A socket
// keeps the namespace it was created in, so connecting and I/O happen on
// ordinary goroutines.
//
// Handing work to a locked thread costs two OS thread switches (and, in a
// process with one P, the P goes with them): a dial that waited for one
// took hundreds of microseconds on a busy host. So the factory makes
// sockets ahead, a few at a time, into a small pool; a dial takes one
// (unconnected, created in the checked namespace, nothing else done to it)
// and the factory refills the pool when it runs low, off the dial's path.
type NetnsDialer struct {
	ns  *os.File
	ino uint64
	// target is the address dialed in the namespace: 127.0.0.1, or a
	// microVM's address on its link in the worker's egress namespace
	// (OpenNetnsPath).
	target [4]byte
	// pool holds sockets (or the error making one failed with) made
	// ahead by the factory; at most netnsPoolSize.
	pool chan sockResult
	// refill wakes the factory (capacity 1: wakes coalesce).
	refill chan struct{}
	quit   chan struct{}
	ended  chan struct{}
}

// netnsPoolSize bounds the sockets made ahead per namespace; the factory
// is woken when a dial leaves fewer than netnsPoolLow, so it switches
// threads once per dozen dials.
const (
	netnsPoolSize = 16
	netnsPoolLow  = 4
)

type sockResult struct {
	fd  int
	err error
}

// NetnsIdentity returns the device and inode of /proc/<pid>/ns/net and the
// process's start time (clock ticks after boot, /proc/<pid>/stat field 22).
func NetnsIdentity(pid int) (dev, ino, start uint64, err error) {
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &st); err != nil {
		return 0, 0, 0, fmt.Errorf("netns of pid %d: %w", pid, err)
	}
	start, err = startTime(pid)
	if err != nil {
		return 0, 0, 0, err
	}
	return st.Dev, st.Ino, start, nil
}

func startTime(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("stat of pid %d: %w", pid, err)
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("stat of pid %d: malformed", pid)
	}
	f := bytes.Fields(b[i+1:])
	// f[0] is field 3 (state); start time is field 22.
	if len(f) < 20 {
		return 0, fmt.Errorf("stat of pid %d: malformed", pid)
	}
	return strconv.ParseUint(string(f[19]), 10, 64)
}

// OpenNetns opens the network namespace of pid and checks it against the
// inode and start time recorded at activation.
func OpenNetns(pid int, wantIno, wantStart uint64) (*NetnsDialer, error) {
	if pid <= 1 {
		return nil, fmt.Errorf("%w: invalid init pid %d", ErrNetnsMismatch, pid)
	}
	f, err := openNetnsFile(fmt.Sprintf("/proc/%d/ns/net", pid), wantIno)
	if err != nil {
		return nil, err
	}
	// Read after opening: if pid was reused between recording and
	// opening, the start time differs.
	start, err := startTime(pid)
	if err != nil || start != wantStart {
		f.Close()
		return nil, fmt.Errorf("%w: init process %d start time %d, recorded %d (%v)", ErrNetnsMismatch, pid, start, wantStart, err)
	}
	return startDialer(f, wantIno, [4]byte{127, 0, 0, 1})
}

// OpenNetnsPath opens the network namespace bind-mounted at path (a
// worker's egress namespace), checks it against the inode recorded at
// activation, and dials target there: a microVM's ports, which its guest
// serves on its address on the link (the VM has no namespace on the
// host). target must be an IPv4 address other than loopback or
// unspecified: the egress namespace's own loopback is the worker's proxy.
func OpenNetnsPath(path string, wantIno uint64, target netip.Addr) (*NetnsDialer, error) {
	if !target.Is4() || target.IsLoopback() || target.IsUnspecified() {
		return nil, fmt.Errorf("gateway: dial address %s is not a sandbox link's address", target)
	}
	f, err := openNetnsFile(path, wantIno)
	if err != nil {
		return nil, err
	}
	return startDialer(f, wantIno, target.As4())
}

// openNetnsFile opens the namespace file at path and checks that it is
// the namespace recorded at activation (its inode, read from the open
// file: a path swapped after the check cannot change what is used).
func openNetnsFile(path string, wantIno uint64) (*os.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open netns: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, fmt.Errorf("stat netns: %w", err)
	}
	if st.Ino != wantIno {
		f.Close()
		return nil, fmt.Errorf("%w: inode %d, recorded %d", ErrNetnsMismatch, st.Ino, wantIno)
	}
	return f, nil
}

// startDialer starts the socket factory of the namespace f.
func startDialer(f *os.File, ino uint64, target [4]byte) (*NetnsDialer, error) {
	d := &NetnsDialer{ns: f, ino: ino, target: target, pool: make(chan sockResult, netnsPoolSize), refill: make(chan struct{}, 1),
		quit: make(chan struct{}), ended: make(chan struct{})}
	ready := make(chan error, 1)
	go d.factory(ready)
	if err := <-ready; err != nil {
		f.Close()
		return nil, err
	}
	return d, nil
}

// factory runs on its own locked OS thread inside the namespace.
func (d *NetnsDialer) factory(ready chan<- error) {
	defer close(d.ended)
	runtime.LockOSThread()
	// Never UnlockOSThread: the thread has a foreign namespace and is
	// discarded when this goroutine returns.
	if err := unix.Setns(int(d.ns.Fd()), unix.CLONE_NEWNET); err != nil {
		ready <- fmt.Errorf("setns: %w", err)
		return
	}
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil || st.Ino != d.ino {
		ready <- fmt.Errorf("%w: thread namespace after setns is %d (%v)", ErrNetnsMismatch, st.Ino, err)
		return
	}
	ready <- nil
	for {
		d.fill()
		select {
		case <-d.quit:
			return
		case <-d.refill:
		}
	}
}

// fill makes sockets until the pool is full. A failure is queued as a
// result of its own (the dial that takes it reports it) and ends this
// round: the next wake tries again.
func (d *NetnsDialer) fill() {
	for len(d.pool) < cap(d.pool) {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		select {
		case d.pool <- sockResult{fd, err}:
		default: // only the factory fills: cannot happen; never leak
			if err == nil {
				unix.Close(fd)
			}
			return
		}
		if err != nil {
			return
		}
	}
}

// wake asks the factory to refill the pool.
func (d *NetnsDialer) wake() {
	select {
	case d.refill <- struct{}{}:
	default:
	}
}

// Close ends the socket factory, closes the sockets it made ahead and
// releases the namespace.
func (d *NetnsDialer) Close() error {
	select {
	case <-d.quit:
	default:
		close(d.quit)
	}
	<-d.ended
	for {
		select {
		case r := <-d.pool:
			if r.err == nil {
				unix.Close(r.fd)
			}
			continue
		default:
		}
		break
	}
	return d.ns.Close()
}

// socket takes a socket made in the namespace: from the pool, or, when it
// is empty, the next one the factory makes.
func (d *NetnsDialer) socket(ctx context.Context) (int, error) {
	select {
	case <-d.quit:
		return -1, errors.New("gateway: netns dialer closed")
	default:
	}
	var r sockResult
	select {
	case r = <-d.pool:
	default:
		d.wake()
		select {
		case r = <-d.pool:
		case <-d.ended:
			return -1, errors.New("gateway: netns dialer closed")
		case <-ctx.Done():
			return -1, ctx.Err()
		}
	}
	if len(d.pool) < netnsPoolLow {
		d.wake()
	}
	if r.err != nil {
		return -1, fmt.Errorf("socket in sandbox netns: %w", r.err)
	}
	return r.fd, nil
}

// DialPort connects to 127.0.0.1:port (or the dialer's target) inside
// the namespace.
func (d *NetnsDialer) DialPort(ctx context.Context, port int) (net.Conn, error) {
	if port < 1 || port > 65535 {
		return nil, fmt.Errorf("gateway: invalid port %d", port)
	}
	fd, err := d.socket(ctx)
	if err != nil {
		return nil, err
	}
	sa := &unix.SockaddrInet4{Port: port, Addr: d.target}
	err = unix.Connect(fd, sa)

	if err != nil && err != unix.EINPROGRESS && err != unix.EINTR {
		unix.Close(fd)
		return nil, &net.OpError{Op: "dial", Net: "tcp", Addr: &net.TCPAddr{IP: net.IP(d.target[:]), Port: port}, Err: os.NewSyscallError("connect", err)}
	}
	f := os.NewFile(uintptr(fd), "sandbox-tcp") // non-blocking: pollable
	defer f.Close()
	if err != nil { // in progress: wait until writable, then read SO_ERROR
		if dl, ok := ctx.Deadline(); ok {
			_ = f.SetWriteDeadline(dl)
		} else {
			_ = f.SetWriteDeadline(time.Now().Add(10 * time.Second))
		}
		rc, rerr := f.SyscallConn()
		if rerr != nil {
			return nil, rerr
		}
		var cerr error
		werr := rc.Write(func(fd uintptr) bool {
			v, gerr := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
			if gerr != nil {
				cerr = gerr
				return true
			}
			if v != 0 {
				cerr = syscall.Errno(v)
				return true
			}
			if _, perr := unix.Getpeername(int(fd)); perr == unix.ENOTCONN {
				return false // not connected yet: wait for writability
			}
			return true
		})
		if werr != nil {
			return nil, fmt.Errorf("gateway: connect to sandbox port %d: %w", port, werr)
		}
		if cerr != nil {
			return nil, &net.OpError{Op: "dial", Net: "tcp", Addr: &net.TCPAddr{IP: net.IP(d.target[:]), Port: port}, Err: os.NewSyscallError("connect", cerr)}
		}
		_ = f.SetWriteDeadline(time.Time{})
	}
	c, err := net.FileConn(f) // dups the fd

	if err != nil {
		return nil, err
	}
	return c, nil
}
