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
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// Network safety: every address dialled below is either inside a namespace
// made by the test (a sandbox, the egress netns) or a TEST-NET address
// dialled from inside a sandbox, whose only way out is the egress netns:
// it has no other link and forwards nothing, so no packet leaves.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	testNet1 = "203.0.113.9"
	testNet2 = "192.0.2.1"
	quiet    = 300 * time.Millisecond // how long "nothing arrives" is watched
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces, nftables)")
	}
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
	home, err := os.Readlink("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
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

// serve accepts on ln until the test ends, reporting each connection with
// its original destination.
func serve(t *testing.T, ln net.Listener) <-chan accepted {
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
	return ch
}

func next(t *testing.T, ch <-chan accepted, what string) accepted {
	t.Helper()
	select {
	case a := <-ch:
		t.Cleanup(func() { a.c.Close() })
		return a
	case <-time.After(3 * time.Second):
		t.Fatalf("%s: nothing accepted", what)
	}
	return accepted{}
}

func nothingMore(t *testing.T, ch <-chan accepted, what string) {
	t.Helper()
	select {
	case a := <-ch:
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
func viaProxy(t *testing.T, s *sandbox, l Link, proxy <-chan accepted, dst string) {
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
	if got := addrPort(a.c.LocalAddr()); got.Addr() != l.Gateway || got.Port() != DefaultProxyPort {
		t.Errorf("%s: proxy local address %s, want %s:%d", dst, got, l.Gateway, DefaultProxyPort)
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
	links, err := h.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, l := range links {
		names = append(names, l.Attrs().Name)
	}
	return names
}

func TestOpenCreatesNetnsAndRuleset(t *testing.T) {
	n := openNet(t, Config{})
	fi, err := os.Lstat(n.cfg.NetnsPath)
	if err != nil || !fi.Mode().IsRegular() {
		t.Fatalf("netns path: %v, %v", fi, err)
	}
	if ok, err := isNetns(int(n.ns)); !ok || err != nil {
		t.Fatalf("not a netns: %v", err)
	}
	self, err := netns.GetFromPath("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer self.Close()
	if self.Equal(n.ns) {
		t.Fatal("the egress netns is the worker's own")
	}
	for key, want := range map[string]string{
		"net/ipv4/ip_forward":                "0",
		"net/ipv4/conf/all/rp_filter":        "1",
		"net/ipv4/conf/default/rp_filter":    "1",
		"net/ipv4/conf/all/arp_ignore":       "1",
		"net/ipv6/conf/all/disable_ipv6":     "1",
		"net/ipv6/conf/default/disable_ipv6": "1",
	} {
		if got := readSysctl(t, n.ns, key); got != want {
			t.Errorf("egress %s = %s, want %s", key, got, want)
		}
	}
	lo, err := n.h.LinkByName("lo")
	if err != nil || lo.Attrs().Flags&net.FlagUp == 0 {
		t.Errorf("egress lo not up: %v", err)
	}
	wantRules(t, n.ns)
	if got, err := n.InUse(); err != nil || len(got) != 0 {
		t.Errorf("InUse on a new netns = %v, %v", got, err)
	}
	if names := hostLinks(t, n.ns); fmt.Sprint(names) != "[lo]" {
		t.Errorf("egress links %v", names)
	}
}

func TestOpenReopensAndAdopts(t *testing.T) {
	needRoot(t)
	path := filepath.Join(t.TempDir(), "egress.netns")
	n := openNet(t, Config{NetnsPath: path})
	ino := inode(t, int(n.ns))
	s := startSandbox(t)
	l := attach(t, n, s)
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := n.InUse(); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("InUse after Close: %v", err)
	}
	if _, err := n.AttachVeth(s.pid); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("AttachVeth after Close: %v", err)
	}

	n2, err := Open(Config{NetnsPath: path})
	if err != nil {
		t.Fatalf("reopen: %v", err)
	}
	defer n2.Close()
	if got := inode(t, int(n2.ns)); got != ino {
		t.Errorf("reopened netns inode %d, want %d", got, ino)
	}
	if got, err := n2.InUse(); err != nil || fmt.Sprint(got) != fmt.Sprint([]int{l.Slot}) {
		t.Errorf("InUse after reopen = %v, %v; want [%d]", got, err, l.Slot)
	}
	wantRules(t, n2.ns) // replaced, not doubled

	// The adopted link still works, and its slot is not handed out again.
	proxy, err := n2.ListenTCP()
	if err != nil {
		t.Fatal(err)
	}
	viaProxy(t, s, l, serve(t, proxy), testNet1+":443")
	l2 := attach(t, n2, startSandbox(t))
	if l2.Slot == l.Slot {
		t.Errorf("adopted slot %d handed out again", l.Slot)
	}
}

func TestOpenRejectsForeignFiles(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	full := filepath.Join(dir, "full")
	if err := os.WriteFile(full, []byte("not a netns"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(Config{NetnsPath: full}); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("non-empty file: %v, want ErrConflict", err)
	}
	if b, _ := os.ReadFile(full); string(b) != "not a netns" {
		t.Errorf("the file was touched: %q", b)
	}
	if _, err := Open(Config{NetnsPath: dir}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("directory: %v, want ErrInvalid", err)
	}
	// A mount namespace file is a namespace, but not a network one.
	mnt := filepath.Join(dir, "mnt")
	if err := os.WriteFile(mnt, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("/proc/self/ns/uts", mnt, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(mnt, unix.MNT_DETACH)
	if _, err := Open(Config{NetnsPath: mnt}); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("uts namespace: %v, want ErrConflict", err)
	}
	if _, err := Open(Config{NetnsPath: "rel"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("relative path: %v", err)
	}
	// An empty file (a mount point left by a reboot) is reused.
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	n := openNet(t, Config{NetnsPath: empty})
	if ok, _ := isNetns(int(n.ns)); !ok {
		t.Error("empty file: no netns mounted")
	}
}

func TestAttachVeth(t *testing.T) {
	n := openNet(t, Config{MTU: 1400})
	s := startSandbox(t)
	l := attach(t, n, s)
	want, _ := n.Slot(l.Slot)
	if fmt.Sprint(l) != fmt.Sprint(want) {
		t.Errorf("link %+v, Slot says %+v", l, want)
	}

	sh, err := handleAt(s.ns)
	if err != nil {
		t.Fatal(err)
	}
	defer sh.Close()
	eth0, err := sh.LinkByName("eth0")
	if err != nil {
		t.Fatalf("sandbox eth0: %v", err)
	}
	a := eth0.Attrs()
	if a.HardwareAddr.String() != l.MAC.String() || a.MTU != 1400 || a.Flags&net.FlagUp == 0 {
		t.Errorf("eth0: mac %s mtu %d flags %v; want %s 1400 up", a.HardwareAddr, a.MTU, a.Flags, l.MAC)
	}
	addrs, err := sh.AddrList(eth0, netlink.FAMILY_V4)
	if err != nil || len(addrs) != 1 || addrs[0].IPNet.String() != l.Addr.String() {
		t.Errorf("eth0 addresses %v, %v; want %s", addrs, err, l.Addr)
	}
	routes, err := sh.RouteList(nil, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	def := false
	for _, r := range routes {
		if (r.Dst == nil || r.Dst.String() == "0.0.0.0/0") && r.Gw.Equal(l.Gateway.AsSlice()) && r.LinkIndex == a.Index {
			def = true
		}
	}
	if !def {
		t.Errorf("no default route via %s in %v", l.Gateway, routes)
	}
	lo, err := sh.LinkByName("lo")
	if err != nil || lo.Attrs().Flags&net.FlagUp == 0 {
		t.Errorf("sandbox lo not up: %v", err)
	}

	host, err := n.h.LinkByName(l.HostName)
	if err != nil {
		t.Fatalf("host end: %v", err)
	}
	if host.Type() != "veth" || host.Attrs().MTU != 1400 || host.Attrs().Flags&net.FlagUp == 0 {
		t.Errorf("host end: type %s mtu %d flags %v", host.Type(), host.Attrs().MTU, host.Attrs().Flags)
	}
	haddrs, err := n.h.AddrList(host, netlink.FAMILY_V4)
	if err != nil || len(haddrs) != 1 || haddrs[0].IPNet.String() != netip.PrefixFrom(l.Gateway, 30).String() {
		t.Errorf("host addresses %v, %v", haddrs, err)
	}
	if got, _ := n.InUse(); fmt.Sprint(got) != fmt.Sprint([]int{l.Slot}) {
		t.Errorf("InUse = %v", got)
	}
	// Nothing landed in the worker's own netns.
	if _, err := netlink.LinkByName(l.HostName); err == nil {
		t.Errorf("%s exists in the worker's netns", l.HostName)
	}
}

func TestAttachVethConcurrent(t *testing.T) {
	n := openNet(t, Config{})
	const k = 4
	sbs := make([]*sandbox, k)
	for i := range sbs {
		sbs[i] = startSandbox(t)
	}
	links := make([]Link, k)
	errs := make([]error, k)
	var wg sync.WaitGroup
	for i := range sbs {
		wg.Go(func() { links[i], errs[i] = n.AttachVeth(sbs[i].pid) })
	}
	wg.Wait()
	seen := map[int]bool{}
	for i, l := range links {
		if errs[i] != nil {
			t.Fatalf("attach %d: %v", i, errs[i])
		}
		if seen[l.Slot] {
			t.Errorf("slot %d handed out twice", l.Slot)
		}
		seen[l.Slot] = true
	}
	if got, _ := n.InUse(); len(got) != k {
		t.Errorf("InUse = %v", got)
	}
}

func TestAttachRejects(t *testing.T) {
	n := openNet(t, Config{})
	if _, err := n.AttachVeth(0); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("pid 0: %v", err)
	}
	if _, err := n.AttachVeth(1 << 30); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("no such pid: %v", err)
	}
	if _, err := n.AttachVeth(os.Getpid()); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("the worker's own netns: %v", err)
	}
	if names := hostLinks(t, n.ns); fmt.Sprint(names) != "[lo]" {
		t.Errorf("egress links after rejections: %v", names)
	}

	// A netns that already has an eth0.
	s := startSandbox(t)
	sh, err := handleAt(s.ns)
	if err != nil {
		t.Fatal(err)
	}
	defer sh.Close()
	if err := sh.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "eth1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := n.AttachVeth(s.pid); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("eth0 taken: %v", err)
	}
	if names := hostLinks(t, n.ns); fmt.Sprint(names) != "[lo]" {
		t.Errorf("egress links after a conflict: %v", names)
	}

	// A failure half-way removes the veth (both ends) and frees the slot.
	s2 := startSandbox(t)
	testHookAttach = func(Link) error { return errors.New("injected") }
	_, err = n.AttachVeth(s2.pid)
	testHookAttach = nil
	if err == nil || !strings.Contains(err.Error(), "injected") {
		t.Fatalf("injected failure: %v", err)
	}
	if names := hostLinks(t, n.ns); fmt.Sprint(names) != "[lo]" {
		t.Errorf("egress links after a failed attach: %v", names)
	}
	if names := hostLinks(t, s2.ns); fmt.Sprint(names) != "[lo]" {
		t.Errorf("sandbox links after a failed attach: %v", names)
	}
	n.mu.Lock()
	used := len(n.used)
	n.mu.Unlock()
	if used != 0 {
		t.Errorf("%d slots still marked used", used)
	}
	// And the sandbox can still be attached.
	attach(t, n, s2)
}

func TestSlotsRunOut(t *testing.T) {
	n := openNet(t, Config{Pool: netip.MustParsePrefix("10.201.7.0/29")}) // one slot
	l := attach(t, n, startSandbox(t))
	if l.Slot != 1 || l.Gateway != netip.MustParseAddr("10.201.7.5") {
		t.Fatalf("link %+v", l)
	}
	s := startSandbox(t)
	if _, err := n.AttachVeth(s.pid); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("no slot left: %v", err)
	}
	if _, _, err := n.CreateTap(); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("no slot left for a tap: %v", err)
	}
	if names := hostLinks(t, s.ns); fmt.Sprint(names) != "[lo]" {
		t.Errorf("sandbox links: %v", names)
	}
	if err := n.Release(l.Slot); err != nil {
		t.Fatal(err)
	}
	if l2 := attach(t, n, s); l2.Slot != 1 {
		t.Errorf("the only slot, once free: got %d", l2.Slot)
	}
}

func TestReleaseAndRoundRobin(t *testing.T) {
	n := openNet(t, Config{})
	a := startSandbox(t)
	la := attach(t, n, a)
	if err := n.Release(la.Slot); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if names := hostLinks(t, n.ns); fmt.Sprint(names) != "[lo]" {
		t.Errorf("egress links after Release: %v", names)
	}
	if names := hostLinks(t, a.ns); fmt.Sprint(names) != "[lo]" {
		t.Errorf("sandbox links after Release (the peer should go too): %v", names)
	}
	if got, _ := n.InUse(); len(got) != 0 {
		t.Errorf("InUse = %v", got)
	}
	if err := n.Release(la.Slot); err != nil {
		t.Errorf("Release of a gone link: %v", err)
	}
	if err := n.Release(0); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("Release(0): %v", err)
	}
	lb := attach(t, n, startSandbox(t))
	if lb.Slot == la.Slot {
		t.Errorf("slot %d reused at once", la.Slot)
	}
	// The released sandbox can get a link again (a new slot).
	if la2 := attach(t, n, a); la2.Slot == la.Slot || la2.Slot == lb.Slot {
		t.Errorf("reattach got slot %d", la2.Slot)
	}
}

func TestRedirectAndIsolation(t *testing.T) {
	n := openNet(t, Config{})
	ln, err := n.ListenTCP()
	if err != nil {
		t.Fatal(err)
	}
	proxy := serve(t, ln)
	udp, dnsTCP, err := n.ListenDNS()
	if err != nil {
		t.Fatal(err)
	}
	defer udp.Close()
	dns := serve(t, dnsTCP)
	a, b := startSandbox(t), startSandbox(t)
	la, lb := attach(t, n, a), attach(t, n, b)

	t.Run("tcp anywhere reaches the proxy", func(t *testing.T) {
		viaProxy(t, a, la, proxy, testNet1+":443")
		viaProxy(t, a, la, proxy, testNet2+":80")
		viaProxy(t, b, lb, proxy, testNet1+":443") // the gateway names the sandbox
	})
	t.Run("the egress netns itself is not reachable", func(t *testing.T) {
		other := listenIn(t, n.ns, "0.0.0.0:2222")
		viaProxy(t, a, la, proxy, la.Gateway.String()+":22")
		viaProxy(t, a, la, proxy, la.Gateway.String()+":2222")
		noAccept(t, other, "gateway:2222")
		viaProxy(t, a, la, proxy, lb.Gateway.String()+":2222") // another sandbox's gateway
		noAccept(t, other, "other gateway:2222")
	})
	t.Run("sandboxes cannot reach each other", func(t *testing.T) {
		bln := listenIn(t, b.ns, lb.Addr.Addr().String()+":8080")
		viaProxy(t, a, la, proxy, lb.Addr.Addr().String()+":8080")
		noAccept(t, bln, "sandbox B")
		bu := listenUDPIn(t, b.ns, "0.0.0.0:9999")
		c, err := dialIn(a.ns, "udp4", lb.Addr.Addr().String()+":9999")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.Write([]byte("hello b"))
		noPacket(t, bu, "udp to sandbox B")
	})
	t.Run("udp dns reaches the resolver socket", func(t *testing.T) {
		c, err := dialIn(a.ns, "udp4", testNet1+":53")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := c.Write([]byte("query")); err != nil {
			t.Fatal(err)
		}
		buf, oob := make([]byte, 512), make([]byte, 512)
		udp.SetReadDeadline(time.Now().Add(3 * time.Second))
		nb, noob, _, from, err := udp.ReadMsgUDP(buf, oob)
		if err != nil {
			t.Fatalf("resolver read: %v", err)
		}
		if string(buf[:nb]) != "query" || from.AddrPort().Addr() != la.Addr.Addr() {
			t.Errorf("resolver got %q from %s", buf[:nb], from)
		}
		if dst := pktinfoDst(t, oob[:noob]); dst != la.Gateway {
			t.Errorf("IP_PKTINFO destination %s, want the gateway %s", dst, la.Gateway)
		}
		if _, err := udp.WriteToUDP([]byte("answer"), from); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(3 * time.Second))
		nb, err = c.Read(buf)
		if err != nil || string(buf[:nb]) != "answer" {
			t.Errorf("sandbox read %q, %v (the answer must come back from %s:53)", buf[:nb], err, testNet1)
		}
		// From sandbox B: the destination names B.
		cb, err := dialIn(b.ns, "udp4", testNet2+":53")
		if err != nil {
			t.Fatal(err)
		}
		defer cb.Close()
		cb.Write([]byte("query b"))
		udp.SetReadDeadline(time.Now().Add(3 * time.Second))
		_, noob, _, _, err = udp.ReadMsgUDP(buf, oob)
		if err != nil {
			t.Fatal(err)
		}
		if dst := pktinfoDst(t, oob[:noob]); dst != lb.Gateway {
			t.Errorf("B's query arrived at %s, want %s", dst, lb.Gateway)
		}
	})
	t.Run("tcp dns reaches the resolver listener", func(t *testing.T) {
		c, err := dialIn(a.ns, "tcp4", testNet2+":53")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		d := next(t, dns, "tcp dns")
		if d.err != nil || d.dst != netip.MustParseAddrPort(testNet2+":53") {
			t.Errorf("tcp dns original destination %s, %v", d.dst, d.err)
		}
		if got := addrPort(d.c.LocalAddr()); got.Addr() != la.Gateway || got.Port() != DefaultDNSPort {
			t.Errorf("tcp dns local address %s", got)
		}
		nothingMore(t, proxy, "tcp dns")
	})
	t.Run("other udp and icmp get nothing", func(t *testing.T) {
		other := listenUDPIn(t, n.ns, "0.0.0.0:5353")
		for _, dst := range []string{la.Gateway.String() + ":5353", testNet1 + ":5353", testNet1 + ":123"} {
			c, err := dialIn(a.ns, "udp4", dst)
			if err != nil {
				t.Fatal(err)
			}
			c.Write([]byte("x"))
			c.Close()
		}
		noPacket(t, other, "udp to the egress netns")
		udp.SetReadDeadline(time.Now().Add(quiet))
		if _, _, _, from, err := udp.ReadMsgUDP(make([]byte, 64), nil); err == nil {
			t.Errorf("resolver got a non-dns packet from %s", from)
		}
		if ping(t, a.ns, la.Gateway) {
			t.Error("the gateway answers ping")
		}
		if ping(t, a.ns, lb.Addr.Addr()) {
			t.Error("sandbox B answers ping from A")
		}
		// The probe itself works: a sandbox's own loopback answers.
		if !ping(t, a.ns, netip.MustParseAddr("127.0.0.1")) {
			t.Error("ping probe broken: no answer from the sandbox's loopback")
		}
	})
	nothingMore(t, proxy, "end")
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

func TestFailsClosedWithoutListeners(t *testing.T) {
	n := openNet(t, Config{})
	s := startSandbox(t)
	l := attach(t, n, s)
	other := listenIn(t, n.ns, "0.0.0.0:2222")
	for _, dst := range []string{testNet1 + ":443", l.Gateway.String() + ":2222", l.Gateway.String() + ":53", testNet2 + ":53"} {
		c, err := dialIn(s.ns, "tcp4", dst)
		if err == nil {
			c.Close()
			t.Errorf("%s: connected with no proxy listening", dst)
		} else if !errors.Is(err, unix.ECONNREFUSED) {
			t.Errorf("%s: %v, want connection refused", dst, err)
		}
	}
	noAccept(t, other, "a listener in the egress netns")

	// Control: without our ruleset the same listener is reachable, so
	// the refusals above are the ruleset's doing.
	if err := deleteRuleset(n.ns); err != nil {
		t.Fatal(err)
	}
	c, err := dialIn(s.ns, "tcp4", l.Gateway.String()+":2222")
	if err != nil {
		t.Fatalf("control dial without the ruleset: %v", err)
	}
	c.Close()
	other.SetDeadline(time.Now().Add(3 * time.Second))
	if ac, err := other.Accept(); err != nil {
		t.Errorf("control: %v", err)
	} else {
		ac.Close()
	}
	if ruleCounts(t, n.ns) != nil {
		t.Error("ruleset still there")
	}
}

// The forward chain drops even if something turns forwarding on in the
// egress netns behind our back.
func TestForwardDropsEvenWithIPForward(t *testing.T) {
	n := openNet(t, Config{})
	a, b := startSandbox(t), startSandbox(t)
	attach(t, n, a)
	lb := attach(t, n, b)
	if err := writeSysctls(n.ns, [][2]string{{"net/ipv4/ip_forward", "1"}}, func(string) bool { return false }); err != nil {
		t.Fatal(err)
	}
	bu := listenUDPIn(t, b.ns, "0.0.0.0:9999")
	send := func() {
		c, err := dialIn(a.ns, "udp4", lb.Addr.Addr().String()+":9999")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.Write([]byte("hello b"))
	}
	send()
	noPacket(t, bu, "udp from A to B with ip_forward=1")

	// Control: without the ruleset the packet is forwarded.
	if err := deleteRuleset(n.ns); err != nil {
		t.Fatal(err)
	}
	send()
	bu.SetReadDeadline(time.Now().Add(3 * time.Second))
	if _, _, err := bu.ReadFromUDP(make([]byte, 64)); err != nil {
		t.Errorf("control: nothing forwarded without the ruleset: %v", err)
	}
}

func TestCreateTap(t *testing.T) {
	n := openNet(t, Config{MTU: 1400})
	f, l, err := n.CreateTap()
	if err != nil {
		t.Fatalf("CreateTap: %v", err)
	}
	defer f.Close()
	host, err := n.h.LinkByName(l.HostName)
	if err != nil {
		t.Fatalf("tap: %v", err)
	}
	tt, ok := host.(*netlink.Tuntap)
	if !ok || tt.Mode != netlink.TUNTAP_MODE_TAP {
		t.Fatalf("%s is %T %+v", l.HostName, host, host)
	}
	if host.Attrs().MTU != 1400 || host.Attrs().Flags&net.FlagUp == 0 {
		t.Errorf("tap mtu %d flags %v", host.Attrs().MTU, host.Attrs().Flags)
	}
	ifr, err := unix.NewIfreq("")
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.IoctlIfreq(int(f.Fd()), unix.TUNGETIFF, ifr); err != nil {
		t.Fatal(err)
	}
	if flags := ifr.Uint16(); flags&(unix.IFF_TAP|unix.IFF_NO_PI|unix.IFF_VNET_HDR) != unix.IFF_TAP|unix.IFF_NO_PI || ifr.Name() != l.HostName {
		t.Errorf("tap %s flags %#x", ifr.Name(), flags)
	}
	// Usable: an ARP request for the gateway, written as the VM would,
	// gets the gateway's answer on the same fd.
	if mac := arpGateway(t, f, l); mac.String() != host.Attrs().HardwareAddr.String() {
		t.Errorf("ARP answer %s, want the tap's %s", mac, host.Attrs().HardwareAddr)
	}
	if got, _ := n.InUse(); fmt.Sprint(got) != fmt.Sprint([]int{l.Slot}) {
		t.Errorf("InUse = %v", got)
	}
	if err := n.Release(l.Slot); err != nil {
		t.Fatal(err)
	}
	if names := hostLinks(t, n.ns); fmt.Sprint(names) != "[lo]" {
		t.Errorf("links after Release: %v", names)
	}
	// A tap nobody holds goes by itself.
	f2, l2, err := n.CreateTap()
	if err != nil {
		t.Fatal(err)
	}
	if l2.Slot == l.Slot {
		t.Errorf("slot %d reused at once", l.Slot)
	}
	f2.Close()
	if names := hostLinks(t, n.ns); fmt.Sprint(names) != "[lo]" {
		t.Errorf("links after closing the tap fd: %v", names)
	}
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

func TestDestroyLeavesNothing(t *testing.T) {
	n := openNet(t, Config{})
	path := n.cfg.NetnsPath
	s := startSandbox(t)
	attach(t, n, s)
	f, _, err := n.CreateTap()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	held, err := netns.GetFromPath(path) // to look inside afterwards
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	if err := n.Destroy(); err != nil {
		t.Fatalf("Destroy: %v", err)
	}
	if err := n.Destroy(); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("second Destroy: %v", err)
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("netns path still there: %v", err)
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(mi), path) {
		t.Errorf("%s still mounted", path)
	}
	if names := hostLinks(t, held); fmt.Sprint(names) != "[lo]" {
		t.Errorf("links left in the egress netns: %v", names)
	}
	if ruleCounts(t, held) != nil {
		t.Error("ruleset left in the egress netns")
	}
	if names := hostLinks(t, s.ns); fmt.Sprint(names) != "[lo]" {
		t.Errorf("links left in the sandbox: %v", names)
	}
}

func TestOriginalDstRejects(t *testing.T) {
	p1, p2 := net.Pipe()
	defer p1.Close()
	defer p2.Close()
	if _, err := OriginalDst(p1); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("pipe: %v", err)
	}
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	sc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close()
	if _, err := OriginalDst(sc); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("a connection that was not redirected: %v", err)
	}
}

func TestParseSockaddrIn(t *testing.T) {
	if _, err := parseSockaddrIn([]byte{1, 2, 3}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("short: %v", err)
	}
	b := make([]byte, 16)
	binary.NativeEndian.PutUint16(b, unix.AF_INET6)
	if _, err := parseSockaddrIn(b); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("AF_INET6: %v", err)
	}
	binary.NativeEndian.PutUint16(b, unix.AF_INET)
	copy(b[2:], []byte{0x01, 0xbb, 203, 0, 113, 9})
	if got, err := parseSockaddrIn(b); err != nil || got != netip.MustParseAddrPort("203.0.113.9:443") {
		t.Errorf("parse = %s, %v", got, err)
	}
}
