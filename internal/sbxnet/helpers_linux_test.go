package sbxnet

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netns"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/testenv"
)

// Network safety: every address dialled below is either inside a namespace
// made by the test (a sandbox, the egress netns) or a TEST-NET address
// dialled from inside a sandbox, whose only way out is the egress netns:
// it has no other link and forwards nothing, so no packet leaves.

// homeNetns is the process's netns before any test ran: where every thread
// must be whenever no operation is in flight.
var homeNetns string

func TestMain(m *testing.M) {
	var err error
	if homeNetns, err = os.Readlink("/proc/self/ns/net"); err != nil {
		panic(err)
	}
	goleak.VerifyTestMain(m)
}

const (
	testNet1 = "203.0.113.9"
	testNet2 = "192.0.2.1"
	quiet    = 300 * time.Millisecond // how long "nothing arrives" is watched
)

func needRoot(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t, "network namespaces, veths, nftables")
}

// openNet opens an egress netns on a temp path and destroys it at the end;
// it also checks, at the end, that no thread of the process was left in
// another netns.
func openNet(t *testing.T, cfg Config) *Net {
	t.Helper()
	needRoot(t)
	if cfg.NetnsPath == "" {
		cfg.NetnsPath = filepath.Join(t.TempDir(), "egress.netns")
	}
	n, err := Open(cfg)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() {
		destroyAll(t, cfg.NetnsPath)
		checkThreadsHome(t)
	})
	return n
}

// destroyAll removes whatever egress netns is mounted at path, whichever
// *Net a test left open.
func destroyAll(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Lstat(path); errors.Is(err, os.ErrNotExist) {
		return
	}
	n, err := Open(Config{NetnsPath: path})
	if err != nil {
		t.Errorf("cleanup open: %v", err)
		unix.Unmount(path, unix.MNT_DETACH)
		return
	}
	if err := n.Destroy(); err != nil {
		t.Errorf("cleanup destroy: %v", err)
	}
}

// checkThreadsHome fails if any thread of the process is in a netns other
// than the process's own.
func checkThreadsHome(t *testing.T) {
	t.Helper()
	home := homeNetns
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		ns, err := os.Readlink("/proc/self/task/" + task.Name() + "/ns/net")
		if err != nil {
			continue // the thread just exited
		}
		if ns != home {
			t.Errorf("thread %s is in %s, not %s", task.Name(), ns, home)
		}
	}
}

// sandbox is a sleeping child in a new netns of its own.
type sandbox struct {
	pid int
	ns  netns.NsHandle
}

func startSandbox(t *testing.T) *sandbox {
	t.Helper()
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start sandbox: %v", err)
	}
	ns, err := netns.GetFromPid(cmd.Process.Pid)
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ns.Close()
		cmd.Process.Kill()
		cmd.Wait()
	})
	return &sandbox{pid: cmd.Process.Pid, ns: ns}
}

func attach(t *testing.T, n *Net, s *sandbox) Link {
	t.Helper()
	l, err := n.AttachVeth(s.pid)
	if err != nil {
		t.Fatalf("AttachVeth: %v", err)
	}
	return l
}

func dialIn(ns netns.NsHandle, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := inNetns(ns, func() error {
		var err error
		c, err = (&net.Dialer{Timeout: 3 * time.Second}).Dial(network, addr)
		return err
	})
	return c, err
}

func listenIn(t *testing.T, ns netns.NsHandle, addr string) *net.TCPListener {
	t.Helper()
	var ln *net.TCPListener
	err := inNetns(ns, func() error {
		l, err := net.Listen("tcp4", addr)
		if err == nil {
			ln = l.(*net.TCPListener)
		}
		return err
	})
	if err != nil {
		t.Fatalf("listen %s: %v", addr, err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

func listenUDPIn(t *testing.T, ns netns.NsHandle, addr string) *net.UDPConn {
	t.Helper()
	var c *net.UDPConn
	err := inNetns(ns, func() error {
		pc, err := net.ListenPacket("udp4", addr)
		if err == nil {
			c = pc.(*net.UDPConn)
		}
		return err
	})
	if err != nil {
		t.Fatalf("listen udp %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// noAccept fails if ln accepts a connection within quiet.
func noAccept(t *testing.T, ln *net.TCPListener, what string) {
	t.Helper()
	ln.SetDeadline(time.Now().Add(quiet))
	if c, err := ln.Accept(); err == nil {
		c.Close()
		t.Errorf("%s: a connection got through", what)
	}
}

// noPacket fails if c receives a packet within quiet.
func noPacket(t *testing.T, c *net.UDPConn, what string) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(quiet))
	buf := make([]byte, 1500)
	if n, from, err := c.ReadFromUDP(buf); err == nil {
		t.Errorf("%s: got %q from %s", what, buf[:n], from)
	}
}

type accepted struct {
	c   net.Conn
	dst netip.AddrPort
	err error
}

// acceptor is a listener served by serve.
type acceptor struct {
	ch   <-chan accepted
	port uint16
}

// serve accepts on ln until the test ends, reporting each connection with
// its original destination.
func serve(t *testing.T, ln net.Listener) acceptor {
	ch := make(chan accepted, 32)
	go func() {
		defer close(ch)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			d, err := OriginalDst(c)
			ch <- accepted{c, d, err}
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		for a := range ch {
			a.c.Close()
		}
	})
	return acceptor{ch, addrPort(ln.Addr()).Port()}
}

func next(t *testing.T, ac acceptor, what string) accepted {
	t.Helper()
	select {
	case a := <-ac.ch:
		t.Cleanup(func() { a.c.Close() })
		return a
	case <-time.After(3 * time.Second):
		t.Fatalf("%s: nothing accepted", what)
	}
	return accepted{}
}

func nothingMore(t *testing.T, ac acceptor, what string) {
	t.Helper()
	select {
	case a := <-ac.ch:
		a.c.Close()
		t.Errorf("%s: unexpected connection from %s to %s", what, a.c.RemoteAddr(), a.dst)
	default:
	}
}

func addrPort(a net.Addr) netip.AddrPort {
	switch a := a.(type) {
	case *net.TCPAddr:
		return a.AddrPort()
	case *net.UDPAddr:
		return a.AddrPort()
	}
	return netip.AddrPort{}
}

// viaProxy dials dst from inside s and checks the connection arrives at the
// proxy listener, at l's gateway, from l's address, with dst as its original
// destination, and carries bytes both ways.
func viaProxy(t *testing.T, s *sandbox, l Link, proxy acceptor, dst string) {
	t.Helper()
	c, err := dialIn(s.ns, "tcp4", dst)
	if err != nil {
		t.Fatalf("dial %s from sandbox: %v", dst, err)
	}
	defer c.Close()
	a := next(t, proxy, dst)
	if a.err != nil {
		t.Fatalf("%s: OriginalDst: %v", dst, a.err)
	}
	if a.dst != netip.MustParseAddrPort(dst) {
		t.Errorf("OriginalDst = %s, want %s", a.dst, dst)
	}
	if got := addrPort(a.c.LocalAddr()); got.Addr() != l.Gateway || got.Port() != proxy.port {
		t.Errorf("%s: proxy local address %s, want %s:%d", dst, got, l.Gateway, proxy.port)
	}
	if got := addrPort(a.c.RemoteAddr()).Addr(); got != l.Addr.Addr() {
		t.Errorf("%s: proxy sees the peer as %s, want %s", dst, got, l.Addr.Addr())
	}
	if got := addrPort(c.RemoteAddr()); got != netip.MustParseAddrPort(dst) {
		t.Errorf("%s: the sandbox sees its peer as %s", dst, got)
	}
	c.Write([]byte("ping"))
	buf := make([]byte, 4)
	a.c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := io.ReadFull(a.c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("%s: proxy read %q, %v", dst, buf, err)
	}
	a.c.Write([]byte("pong"))
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "pong" {
		t.Fatalf("%s: sandbox read %q, %v", dst, buf, err)
	}
}

func readSysctl(t *testing.T, ns netns.NsHandle, key string) string {
	t.Helper()
	var v []byte
	if err := inNetns(ns, func() error {
		var err error
		v, err = os.ReadFile("/proc/sys/" + key)
		return err
	}); err != nil {
		t.Fatalf("sysctl %s: %v", key, err)
	}
	return strings.TrimSpace(string(v))
}

func inode(t *testing.T, fd int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// ruleCounts returns the number of rules per chain of our table in ns
// (nil: no table).
func ruleCounts(t *testing.T, ns netns.NsHandle) map[string]int {
	t.Helper()
	c, err := nftConn(ns)
	if err != nil {
		t.Fatal(err)
	}
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, tb := range tables {
		found = found || tb.Name == TableName
	}
	if !found {
		return nil
	}
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, ch := range chains {
		if ch.Table.Name != TableName {
			continue
		}
		rules, err := c.GetRules(ch.Table, ch)
		if err != nil {
			t.Fatal(err)
		}
		out[ch.Name] = len(rules)
		if ch.Name != "prerouting" && (ch.Policy == nil || *ch.Policy != nftables.ChainPolicyDrop) {
			t.Errorf("chain %s: policy is not drop", ch.Name)
		}
	}
	return out
}

func wantRules(t *testing.T, ns netns.NsHandle) {
	t.Helper()
	got := ruleCounts(t, ns)
	want := map[string]int{"prerouting": 3, "input": 5, "forward": 0}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("ruleset chains/rules = %v, want %v", got, want)
	}
}

func hostLinks(t *testing.T, ns netns.NsHandle) []string {
	t.Helper()
	h, err := handleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	links, err := linkList(h)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, l := range links {
		names = append(names, l.Attrs().Name)
	}
	return names
}

func pktinfoDst(t *testing.T, oob []byte) netip.Addr {
	t.Helper()
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range msgs {
		if m.Header.Level == unix.IPPROTO_IP && m.Header.Type == unix.IP_PKTINFO && len(m.Data) >= unix.SizeofInet4Pktinfo {
			var pi unix.Inet4Pktinfo
			if err := binary.Read(bytes.NewReader(m.Data), binary.NativeEndian, &pi); err != nil {
				t.Fatal(err)
			}
			return netip.AddrFrom4(pi.Addr)
		}
	}
	t.Fatal("no IP_PKTINFO")
	return netip.Addr{}
}

// ping sends an ICMP echo request to dst from inside ns and reports
// whether a reply came back within quiet.
func ping(t *testing.T, ns netns.NsHandle, dst netip.Addr) bool {
	t.Helper()
	var fd int
	if err := inNetns(ns, func() error {
		var err error
		fd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_ICMP)
		return err
	}); err != nil {
		t.Fatalf("icmp socket: %v", err)
	}
	defer unix.Close(fd)
	tv := unix.NsecToTimeval(int64(50 * time.Millisecond))
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		t.Fatal(err)
	}
	const id = 0x5b5b
	req := []byte{8, 0, 0, 0, id >> 8, id & 0xff, 0, 1, 's', 'p', 'a', 'c', 'e'}
	sum := uint32(0)
	for i := 0; i+1 < len(req); i += 2 {
		sum += uint32(req[i])<<8 | uint32(req[i+1])
	}
	sum += uint32(req[len(req)-1]) << 8 // odd length
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	binary.BigEndian.PutUint16(req[2:], ^uint16(sum))
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrInet4{Addr: dst.As4()}); err != nil {
		return false // unreachable: no reply either
	}
	deadline := time.Now().Add(quiet)
	buf := make([]byte, 1500)
	for time.Now().Before(deadline) {
		nb, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			continue
		}
		ihl := int(buf[0]&0x0f) * 4
		if nb >= ihl+8 && buf[ihl] == 0 && binary.BigEndian.Uint16(buf[ihl+4:]) == id {
			return true
		}
	}
	return false
}

func arpGateway(t *testing.T, f *os.File, l Link) net.HardwareAddr {
	t.Helper()
	frame := make([]byte, 0, 42)
	frame = append(frame, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff)
	frame = append(frame, l.MAC...)
	frame = append(frame, 0x08, 0x06)             // ARP
	frame = append(frame, 0, 1, 8, 0, 6, 4, 0, 1) // ethernet/ipv4 request
	sip, gw := l.Addr.Addr().As4(), l.Gateway.As4()
	frame = append(frame, l.MAC...)
	frame = append(frame, sip[:]...)
	frame = append(frame, 0, 0, 0, 0, 0, 0)
	frame = append(frame, gw[:]...)
	if _, err := f.Write(frame); err != nil {
		t.Fatalf("write to tap: %v", err)
	}
	fd := int(f.Fd())
	deadline := time.Now().Add(3 * time.Second)
	buf := make([]byte, 2048)
	for time.Now().Before(deadline) {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if k, err := unix.Poll(pfd, 200); err != nil || k == 0 {
			continue
		}
		nb, err := unix.Read(fd, buf)
		if err != nil {
			t.Fatalf("read tap: %v", err)
		}
		p := buf[:nb]
		if nb >= 42 && p[12] == 0x08 && p[13] == 0x06 && p[21] == 2 && bytes.Equal(p[28:32], gw[:]) {
			return net.HardwareAddr(bytes.Clone(p[22:28]))
		}
	}
	t.Fatal("no ARP answer from the gateway")
	return nil
}
