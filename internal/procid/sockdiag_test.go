package procid

import (
	"bufio"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/spacesbx/space/internal/testenv"
	"golang.org/x/sys/unix"
)

func TestSockDiagListenerPeerAndFD(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	var st unix.Stat_t
	if err := unix.Stat(sock, &st); err != nil {
		t.Fatal(err)
	}
	d, err := NewDiagInNetns(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	// The listener, found by the inode of its path.
	socks, err := d.Dump(1<<StateListen, UDiagShowVFS|UDiagShowName)
	if err != nil {
		t.Fatal(err)
	}
	var listener *UnixSocket
	for i, s := range socks {
		if s.HasVFS && s.VFSIno == uint32(st.Ino) && s.VFSDev == KernelDev(st.Dev) {
			if listener != nil {
				t.Fatal("two listeners on one path inode")
			}
			listener = &socks[i]
		}
	}
	if listener == nil || listener.Name != sock || listener.State != StateListen {
		t.Fatalf("listener not found among %d sockets: %+v", len(socks), listener)
	}
	// Its inode is among this process's fds.
	if lin := listenerInode(t, l); lin != listener.Ino {
		t.Fatalf("listener inode %d, diag %d", lin, listener.Ino)
	}
	if _, err := FindSocketFD(os.Getpid(), listener.Ino, -1); err != nil {
		t.Fatal(err)
	}
	if _, err := FindSocketFD(os.Getpid(), listener.Ino+1_000_000, 3); !errors.Is(err, ErrMismatch) {
		t.Fatalf("unknown socket found: %v", err)
	}
	// Not accepted yet: our socket waits in the listener's queue, and our
	// peer has no inode yet.
	own, err := ConnInode(c)
	if err != nil {
		t.Fatal(err)
	}
	ls, err := d.Lookup(listener.Ino, UDiagShowIcons|UDiagShowVFS)
	if err != nil || !slices.Contains(ls.Icons, own) {
		t.Fatalf("pending connection not in the listener's queue: %+v %v", ls, err)
	}
	if me, err := d.Lookup(own, UDiagShowPeer); err != nil || !me.HasPeer || me.Peer != 0 {
		t.Fatalf("own socket before accept: %+v %v", me, err)
	}
	sc, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close()
	// Accepted: our peer is bound at the listener's path inode and names us back.
	me, err := d.Lookup(own, UDiagShowPeer)
	if err != nil || !me.HasPeer {
		t.Fatalf("own socket: %+v %v", me, err)
	}
	peer, err := d.Lookup(me.Peer, UDiagShowPeer|UDiagShowVFS)
	if err != nil {
		t.Fatal(err)
	}
	if !peer.HasVFS || peer.VFSIno != listener.VFSIno || peer.VFSDev != listener.VFSDev || peer.Peer != own || peer.State != StateEstablished {
		t.Fatalf("peer %+v, listener %+v, own %d", peer, listener, own)
	}
	if _, err := d.Lookup(0xfffffff0, UDiagShowPeer); !errors.Is(err, ErrDiagNotFound) {
		t.Fatalf("missing socket: %v", err)
	}
}

func listenerInode(t *testing.T, l net.Listener) uint32 {
	t.Helper()
	raw, err := l.(*net.UnixListener).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	raw.Control(func(fd uintptr) { unix.Fstat(int(fd), &st) })
	return uint32(st.Ino)
}

func TestKernelDev(t *testing.T) {
	if got := KernelDev(unix.Mkdev(8, 1)); got != 8<<20|1 {
		t.Fatalf("%x", got)
	}
	if got := KernelDev(unix.Mkdev(0, 300)); got != 300 {
		t.Fatalf("%x", got)
	}
}

// msg builds one netlink message of type typ and sequence seq.
func msg(typ uint16, seq uint32, body []byte) []byte {
	b := make([]byte, nlmsgHdrLen+len(body))
	ne := binary.NativeEndian
	ne.PutUint32(b, uint32(len(b)))
	ne.PutUint16(b[4:], typ)
	ne.PutUint32(b[8:], seq)
	copy(b[nlmsgHdrLen:], body)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

func diagMsg(ino uint32, state uint8, attrs ...[]byte) []byte {
	b := make([]byte, unixDiagMsgLen)
	b[0], b[1], b[2] = unix.AF_UNIX, unix.SOCK_STREAM, state
	binary.NativeEndian.PutUint32(b[4:], ino)
	for _, a := range attrs {
		b = append(b, a...)
	}
	return b
}

func attr(typ uint16, v []byte) []byte {
	b := make([]byte, 4, 4+len(v)+3)
	binary.NativeEndian.PutUint16(b, uint16(4+len(v)))
	binary.NativeEndian.PutUint16(b[2:], typ)
	b = append(b, v...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

func u32s(v ...uint32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.NativeEndian.PutUint32(b[4*i:], x)
	}
	return b
}

func TestParseDiag(t *testing.T) {
	var dgram []byte
	dgram = append(dgram, msg(unix.SOCK_DIAG_BY_FAMILY, 6, diagMsg(1, StateListen))...) // stale answer
	dgram = append(dgram, msg(unix.SOCK_DIAG_BY_FAMILY, 7, diagMsg(42, StateListen,
		attr(unixDiagName, []byte("/run/g.sock\x00")), attr(unixDiagVFS, u32s(99, 0x800001)), attr(unixDiagPeer, u32s(43)),
		attr(unixDiagIcons, u32s(5, 6)), attr(9, []byte{1})))...)
	dgram = append(dgram, msg(unix.NLMSG_DONE, 7, u32s(0))...)
	socks, done, err := parseDiag(dgram, 7)
	if err != nil || !done || len(socks) != 1 {
		t.Fatalf("%+v %v %v", socks, done, err)
	}
	s := socks[0]
	if s.Ino != 42 || s.State != StateListen || s.Name != "/run/g.sock" || s.VFSIno != 99 || s.VFSDev != 0x800001 || s.Peer != 43 || !slices.Equal(s.Icons, []uint32{5, 6}) {
		t.Fatalf("%+v", s)
	}
	enoent := make([]byte, 4)
	e := -int32(unix.ENOENT)
	binary.NativeEndian.PutUint32(enoent, uint32(e))
	if _, _, err := parseDiag(msg(unix.NLMSG_ERROR, 7, enoent), 7); !errors.Is(err, ErrDiagNotFound) {
		t.Fatalf("ENOENT: %v", err)
	}
	for name, bad := range map[string][]byte{
		"short header":  {1, 2, 3},
		"length > data": msg(unix.SOCK_DIAG_BY_FAMILY, 7, diagMsg(1, 1))[:20],
		"short diag":    msg(unix.SOCK_DIAG_BY_FAMILY, 7, []byte{1, 2}),
		"bad attr":      msg(unix.SOCK_DIAG_BY_FAMILY, 7, diagMsg(1, 1, []byte{2, 0, 1, 0})),
		"short vfs":     msg(unix.SOCK_DIAG_BY_FAMILY, 7, diagMsg(1, 1, attr(unixDiagVFS, u32s(1)))),
		"short error":   msg(unix.NLMSG_ERROR, 7, nil),
	} {
		if _, _, err := parseDiag(bad, 7); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func FuzzParseDiag(f *testing.F) {
	f.Add(msg(unix.SOCK_DIAG_BY_FAMILY, 1, diagMsg(42, StateListen, attr(unixDiagVFS, u32s(1, 2)), attr(unixDiagPeer, u32s(3)))))
	f.Add(msg(unix.NLMSG_DONE, 1, u32s(0)))
	f.Add(msg(unix.NLMSG_ERROR, 1, u32s(0xfffffffe)))
	f.Fuzz(func(t *testing.T, b []byte) {
		socks, _, err := parseDiag(b, 1)
		if err != nil && len(socks) > 0 {
			t.Fatal("sockets returned with an error")
		}
	})
}

func TestEncodeRequest(t *testing.T) {
	b := encodeRequest(9, unix.NLM_F_REQUEST, 1<<StateListen, 77, UDiagShowVFS)
	ne := binary.NativeEndian
	if len(b) != 40 || ne.Uint32(b) != 40 || ne.Uint16(b[4:]) != unix.SOCK_DIAG_BY_FAMILY || ne.Uint32(b[8:]) != 9 ||
		b[16] != unix.AF_UNIX || ne.Uint32(b[20:]) != 1<<StateListen || ne.Uint32(b[24:]) != 77 || ne.Uint32(b[28:]) != UDiagShowVFS ||
		ne.Uint32(b[32:]) != ^uint32(0) {
		t.Fatalf("% x", b)
	}
}

// A listener in another network namespace (as a sandbox's) is invisible to
// a sock_diag socket of ours and found by one opened in its namespace.
func TestSockDiagOtherNetns(t *testing.T) {
	testenv.RequireRoot(t, "a network namespace")
	sock := filepath.Join(t.TempDir(), "s")
	cmd := exec.Command("/proc/self/exe", "-test.run=^$")
	cmd.Env = append(os.Environ(), "PROCID_LISTEN="+sock)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	if l, _ := bufio.NewReader(out).ReadString('\n'); l != "ok\n" {
		t.Fatalf("helper: %q", l)
	}
	if same, err := SameNetns(cmd.Process.Pid); err != nil || same {
		t.Fatalf("same netns %v %v", same, err)
	}
	var st unix.Stat_t
	unix.Stat(sock, &st)
	find := func(d *Diag) bool {
		socks, err := d.Dump(1<<StateListen, UDiagShowVFS)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range socks {
			if s.HasVFS && s.VFSIno == uint32(st.Ino) && s.VFSDev == KernelDev(st.Dev) {
				if _, err := FindSocketFD(cmd.Process.Pid, s.Ino, 3); err != nil {
					t.Fatal(err)
				}
				return true
			}
		}
		return false
	}
	mine, err := NewDiag()
	if err != nil {
		t.Fatal(err)
	}
	defer mine.Close()
	if find(mine) {
		t.Fatal("listener of another netns visible from ours")
	}
	theirs, err := NewDiagInNetns(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	defer theirs.Close()
	if !find(theirs) {
		t.Fatal("listener not found in its own netns")
	}
	if same, _ := SameNetns(os.Getpid()); !same {
		t.Fatal("this thread was left in the other netns")
	}
}
