package procid

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// sock_diag for AF_UNIX (linux/unix_diag.h); x/sys/unix has no constants
// for it.
const (
	UDiagShowName  = 0x01 // UDIAG_SHOW_NAME
	UDiagShowVFS   = 0x02 // UDIAG_SHOW_VFS
	UDiagShowPeer  = 0x04 // UDIAG_SHOW_PEER
	UDiagShowIcons = 0x08 // UDIAG_SHOW_ICONS

	unixDiagName  = 0 // UNIX_DIAG_NAME
	unixDiagVFS   = 1 // UNIX_DIAG_VFS
	unixDiagPeer  = 2 // UNIX_DIAG_PEER
	unixDiagIcons = 3 // UNIX_DIAG_ICONS

	// StateListen is TCP_LISTEN, the state of a listening Unix socket.
	StateListen = 10
	// StateEstablished is TCP_ESTABLISHED.
	StateEstablished = 1

	unixDiagReqLen = 24 // struct unix_diag_req
	unixDiagMsgLen = 16 // struct unix_diag_msg
	nlmsgHdrLen    = 16
)

// ErrDiagNotFound means sock_diag knows no socket with that inode (in the
// network namespace the Diag was opened in).
var ErrDiagNotFound = errors.New("procid: sock_diag: no such socket")

// UnixSocket is what sock_diag reports about one AF_UNIX socket.
type UnixSocket struct {
	Ino   uint32 // socket inode (as in /proc/<pid>/fd -> socket:[Ino])
	Type  uint8  // SOCK_STREAM, ...
	State uint8  // StateListen, StateEstablished, ...
	// Name is the bound path (UDiagShowName); accepted sockets carry
	// their listener's name.
	Name    string
	HasName bool
	// VFSDev/VFSIno identify the filesystem inode of the bound path
	// (UDiagShowVFS); accepted sockets carry their listener's. VFSDev is
	// the kernel's dev_t encoding (major<<20|minor), see KernelDev.
	VFSDev, VFSIno uint32
	HasVFS         bool
	// Peer is the inode of the connected peer socket (UDiagShowPeer).
	// An accepted socket gets its inode when accept(2) returns; until
	// then the peer inode reads 0.
	Peer    uint32
	HasPeer bool
	// Icons are, for a listener (UDiagShowIcons), the inodes of the client
	// sockets whose connections wait in its accept queue.
	Icons []uint32
}

// KernelDev converts a stat(2) st_dev to the kernel-internal encoding that
// sock_diag reports (major<<20 | minor, 32 bits).
func KernelDev(dev uint64) uint32 {
	return unix.Major(dev)<<20 | unix.Minor(dev)&0xfffff
}

// Diag is a NETLINK_SOCK_DIAG socket. It answers for the network namespace
// it was created in (Unix sockets are per network namespace). Safe for
// concurrent use: requests are serialized.
type Diag struct {
	mu  sync.Mutex
	fd  int
	seq uint32
	buf []byte
}

// NewDiag opens a sock_diag socket in the caller's network namespace.
func NewDiag() (*Diag, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return nil, fmt.Errorf("procid: sock_diag socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("procid: sock_diag bind: %w", err)
	}
	tv := unix.NsecToTimeval(int64(2 * time.Second))
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	return &Diag{fd: fd, buf: make([]byte, 64*1024)}, nil
}

// SameNetns reports whether pid lives in the caller's network namespace.
func SameNetns(pid int) (bool, error) {
	var a, b unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &a); err != nil {
		return false, fmt.Errorf("procid: %w", err)
	}
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &b); err != nil {
		return false, fmt.Errorf("procid: %w", err)
	}
	return a.Dev == b.Dev && a.Ino == b.Ino, nil
}

// NewDiagInNetns opens a sock_diag socket in the network namespace of pid
// (a sandbox's sockets are only visible from its own namespace). The
// caller checks afterwards that pid is still the process it means.
func NewDiagInNetns(pid int) (*Diag, error) {
	same, err := SameNetns(pid)
	if err != nil {
		return nil, err
	}
	if same {
		return NewDiag()
	}
	target, err := unix.Open(fmt.Sprintf("/proc/%d/ns/net", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("procid: netns of %d: %w", pid, err)
	}
	defer unix.Close(target)
	type result struct {
		d   *Diag
		err error
	}
	ch := make(chan result, 1)
	go func() {
		// Switch one locked thread into the namespace, create the socket
		// (it stays in that namespace) and switch back. If switching back
		// fails the thread stays locked and dies with this goroutine.
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: fmt.Errorf("procid: own netns: %w", err)}
			return
		}
		defer unix.Close(orig)
		if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: fmt.Errorf("procid: setns: %w", err)}
			return
		}
		d, derr := NewDiag()
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			if d != nil {
				d.Close()
			}
			ch <- result{err: fmt.Errorf("procid: restore netns: %w", err)}
			return
		}
		runtime.UnlockOSThread()
		ch <- result{d, derr}
	}()
	r := <-ch
	return r.d, r.err
}

// Close closes the netlink socket.
func (d *Diag) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.fd < 0 {
		return nil
	}
	err := unix.Close(d.fd)
	d.fd = -1
	return err
}

// Lookup asks for the Unix socket with inode ino.
func (d *Diag) Lookup(ino uint32, show uint32) (UnixSocket, error) {
	socks, err := d.query(0, ino, show, false)
	if err != nil {
		return UnixSocket{}, err
	}
	for _, s := range socks {
		if s.Ino == ino {
			return s, nil
		}
	}
	return UnixSocket{}, fmt.Errorf("%w: inode %d", ErrDiagNotFound, ino)
}

// Dump lists the Unix sockets whose state is in the bit mask states
// (1<<StateListen, ...).
func (d *Diag) Dump(states uint32, show uint32) ([]UnixSocket, error) {
	return d.query(states, 0, show, true)
}

func (d *Diag) query(states, ino, show uint32, dump bool) ([]UnixSocket, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.fd < 0 {
		return nil, errors.New("procid: sock_diag closed")
	}
	d.seq++
	seq := d.seq
	flags := uint16(unix.NLM_F_REQUEST)
	if dump {
		flags |= unix.NLM_F_DUMP
	}
	req := encodeRequest(seq, flags, states, ino, show)
	if err := unix.Sendto(d.fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("procid: sock_diag send: %w", err)
	}
	var out []UnixSocket
	for {
		n, from, err := unix.Recvfrom(d.fd, d.buf, 0)
		if err != nil {
			return nil, fmt.Errorf("procid: sock_diag recv: %w", err)
		}
		if sa, ok := from.(*unix.SockaddrNetlink); !ok || sa.Pid != 0 {
			continue // only the kernel answers
		}
		socks, done, err := parseDiag(d.buf[:n], seq)
		if err != nil {
			return nil, err
		}
		out = append(out, socks...)
		if done || (!dump && len(out) > 0) {
			return out, nil
		}
	}
}

// encodeRequest builds a netlink message carrying a unix_diag_req.
func encodeRequest(seq uint32, flags uint16, states, ino, show uint32) []byte {
	b := make([]byte, nlmsgHdrLen+unixDiagReqLen)
	ne := binary.NativeEndian
	ne.PutUint32(b[0:], uint32(len(b)))
	ne.PutUint16(b[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(b[6:], flags)
	ne.PutUint32(b[8:], seq)
	ne.PutUint32(b[12:], 0)
	r := b[nlmsgHdrLen:]
	r[0] = unix.AF_UNIX // sdiag_family
	r[1] = 0            // sdiag_protocol
	ne.PutUint32(r[4:], states)
	ne.PutUint32(r[8:], ino)
	ne.PutUint32(r[12:], show)
	// udiag_cookie = INET_DIAG_NOCOOKIE: do not check the socket cookie.
	ne.PutUint32(r[16:], ^uint32(0))
	ne.PutUint32(r[20:], ^uint32(0))
	return b
}

func align4(n int) int { return (n + 3) &^ 3 }

// parseDiag parses one datagram of netlink messages answering request seq.
// Messages for other sequence numbers (late answers to an abandoned
// request) are skipped. done is set by NLMSG_DONE; a kernel error comes
// back as an error (ENOENT as ErrDiagNotFound).
func parseDiag(b []byte, seq uint32) (socks []UnixSocket, done bool, err error) {
	ne := binary.NativeEndian
	for len(b) > 0 {
		if len(b) < nlmsgHdrLen {
			return nil, false, fmt.Errorf("procid: sock_diag: short netlink header (%d bytes)", len(b))
		}
		l := int(ne.Uint32(b[0:]))
		typ := ne.Uint16(b[4:])
		mseq := ne.Uint32(b[8:])
		if l < nlmsgHdrLen || l > len(b) {
			return nil, false, fmt.Errorf("procid: sock_diag: bad netlink length %d of %d", l, len(b))
		}
		body := b[nlmsgHdrLen:l]
		next := align4(l)
		if next > len(b) {
			next = len(b)
		}
		b = b[next:]
		if mseq != seq {
			continue
		}
		switch typ {
		case unix.NLMSG_DONE:
			return socks, true, nil
		case unix.NLMSG_ERROR:
			if len(body) < 4 {
				return nil, false, errors.New("procid: sock_diag: short error message")
			}
			e := -int32(ne.Uint32(body))
			if e == 0 {
				continue // an ack
			}
			if unix.Errno(e) == unix.ENOENT {
				return nil, false, ErrDiagNotFound
			}
			return nil, false, fmt.Errorf("procid: sock_diag: %w", unix.Errno(e))
		case unix.SOCK_DIAG_BY_FAMILY:
			s, err := parseUnixDiagMsg(body)
			if err != nil {
				return nil, false, err
			}
			socks = append(socks, s)
		}
	}
	return socks, false, nil
}

// parseUnixDiagMsg parses a unix_diag_msg and its attributes.
func parseUnixDiagMsg(b []byte) (UnixSocket, error) {
	ne := binary.NativeEndian
	if len(b) < unixDiagMsgLen {
		return UnixSocket{}, fmt.Errorf("procid: sock_diag: short unix_diag_msg (%d bytes)", len(b))
	}
	if b[0] != unix.AF_UNIX {
		return UnixSocket{}, fmt.Errorf("procid: sock_diag: family %d", b[0])
	}
	s := UnixSocket{Type: b[1], State: b[2], Ino: ne.Uint32(b[4:])}
	attrs := b[unixDiagMsgLen:]
	for len(attrs) >= 4 {
		al := int(ne.Uint16(attrs[0:]))
		at := ne.Uint16(attrs[2:]) & 0x3fff // strip NLA_F_NESTED / NLA_F_NET_BYTEORDER
		if al < 4 || al > len(attrs) {
			return UnixSocket{}, fmt.Errorf("procid: sock_diag: bad attribute length %d", al)
		}
		v := attrs[4:al]
		switch at {
		case unixDiagName:
			// Abstract names start with NUL; path names may be NUL-terminated.
			s.Name, s.HasName = strings.TrimRight(string(v), "\x00"), true
		case unixDiagVFS:
			if len(v) < 8 {
				return UnixSocket{}, errors.New("procid: sock_diag: short UNIX_DIAG_VFS")
			}
			s.VFSIno, s.VFSDev, s.HasVFS = ne.Uint32(v[0:]), ne.Uint32(v[4:]), true
		case unixDiagPeer:
			if len(v) < 4 {
				return UnixSocket{}, errors.New("procid: sock_diag: short UNIX_DIAG_PEER")
			}
			s.Peer, s.HasPeer = ne.Uint32(v), true
		case unixDiagIcons:
			s.Icons = make([]uint32, 0, len(v)/4)
			for i := 0; i+4 <= len(v); i += 4 {
				s.Icons = append(s.Icons, ne.Uint32(v[i:]))
			}
		}
		n := align4(al)
		if n > len(attrs) {
			n = len(attrs)
		}
		attrs = attrs[n:]
	}
	return s, nil
}

// ConnInode returns the sockfs inode of the Unix connection c's own socket
// (its identity for sock_diag and in /proc/<pid>/fd).
func ConnInode(c net.Conn) (uint32, error) {
	var st unix.Stat_t
	var serr error
	if err := control(c, func(fd int) { serr = unix.Fstat(fd, &st) }); err != nil {
		return 0, err
	}
	if serr != nil {
		return 0, fmt.Errorf("procid: fstat socket: %w", serr)
	}
	return uint32(st.Ino), nil
}

// FindSocketFD looks for the socket with inode ino among the file
// descriptors of pid and returns the fd number. hint, when >= 0, is tried
// first (where it was found before) so the common case is one readlink.
func FindSocketFD(pid int, ino uint32, hint int) (int, error) {
	want := "socket:[" + strconv.FormatUint(uint64(ino), 10) + "]"
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	if hint >= 0 {
		if l, err := os.Readlink(dir + "/" + strconv.Itoa(hint)); err == nil && l == want {
			return hint, nil
		}
	}
	f, err := os.Open(dir)
	if err != nil {
		return -1, fmt.Errorf("procid: fds of %d: %w", pid, err)
	}
	defer f.Close()
	for {
		names, err := f.Readdirnames(256)
		for _, n := range names {
			if l, err := os.Readlink(dir + "/" + n); err == nil && l == want {
				fd, _ := strconv.Atoi(n)
				return fd, nil
			}
		}
		if err != nil {
			break
		}
	}
	return -1, fmt.Errorf("procid: %w: socket %d is not among the fds of pid %d", ErrMismatch, ino, pid)
}
