package sbxnet

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

func TestOpenCreatesNetnsAndRuleset(t *testing.T) {
	needRoot(t)
	keys := []string{"net/ipv4/ip_forward", "net/ipv4/conf/all/rp_filter", "net/ipv4/conf/all/arp_ignore", "net/ipv6/conf/all/disable_ipv6"}
	rootBefore := map[string]string{}
	for _, k := range keys {
		b, _ := os.ReadFile("/proc/sys/" + k)
		rootBefore[k] = string(b)
	}
	n := openNet(t, Config{})
	for _, k := range keys {
		if b, _ := os.ReadFile("/proc/sys/" + k); string(b) != rootBefore[k] {
			t.Errorf("the worker's own %s changed: %q -> %q", k, rootBefore[k], b)
		}
	}
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

// Reopening with other ports replaces the ruleset: the old proxy port no
// longer receives anything.
func TestReopenReplacesRuleset(t *testing.T) {
	needRoot(t)
	path := filepath.Join(t.TempDir(), "egress.netns")
	n := openNet(t, Config{NetnsPath: path})
	s := startSandbox(t)
	l := attach(t, n, s)
	n.Close()

	n2, err := Open(Config{NetnsPath: path, ProxyPort: 16001, DNSPort: 16053})
	if err != nil {
		t.Fatal(err)
	}
	defer n2.Close()
	wantRules(t, n2.ns)
	old := listenIn(t, n2.ns, fmt.Sprintf("0.0.0.0:%d", DefaultProxyPort))
	ln, err := n2.ListenTCP()
	if err != nil {
		t.Fatal(err)
	}
	proxy := serve(t, ln)
	if proxy.port != 16001 {
		t.Fatalf("proxy listens on %d", proxy.port)
	}
	viaProxy(t, s, l, proxy, testNet1+":443")
	noAccept(t, old, "the old proxy port")
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

	// A name taken behind our back (a persistent tap nobody holds, which
	// TUNSETIFF would attach to) is skipped, not adopted.
	next, _ := n.Slot(l2.Slot + 1)
	// (Made by hand in the egress netns: netlink's Tuntap LinkAdd opens
	// /dev/net/tun in the calling thread's namespace, not the handle's.)
	if err := inNetns(n.ns, func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		ifr, err := unix.NewIfreq(next.HostName)
		if err != nil {
			return err
		}
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			return err
		}
		return unix.IoctlSetInt(fd, unix.TUNSETPERSIST, 1)
	}); err != nil {
		t.Fatal(err)
	}
	f3, l3, err := n.CreateTap()
	if err != nil {
		t.Fatal(err)
	}
	defer f3.Close()
	if l3.Slot == next.Slot {
		t.Errorf("took over the foreign tap %s", next.HostName)
	}
	if got, _ := n.InUse(); fmt.Sprint(got) != fmt.Sprint([]int{next.Slot, l3.Slot}) {
		t.Errorf("InUse = %v", got)
	}
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

func FuzzParseSockaddrIn(f *testing.F) {
	ok := make([]byte, 16)
	binary.NativeEndian.PutUint16(ok, unix.AF_INET)
	copy(ok[2:], []byte{0x01, 0xbb, 203, 0, 113, 9})
	f.Add(ok)
	f.Add([]byte{})
	f.Add([]byte{10, 0, 0, 53, 1, 2, 3, 4})
	f.Fuzz(func(t *testing.T, b []byte) {
		ap, err := parseSockaddrIn(b)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("unclassed error %v", err)
			}
			return
		}
		if !ap.Addr().Is4() || netip.AddrFrom4([4]byte(b[4:8])) != ap.Addr() || binary.BigEndian.Uint16(b[2:4]) != ap.Port() {
			t.Fatalf("%x parsed as %s", b, ap)
		}
	})
}
