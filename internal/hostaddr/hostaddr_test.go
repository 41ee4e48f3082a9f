package hostaddr

import (
	"context"
	"net"
	"net/netip"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"go.uber.org/goleak"

	"github.com/spacesbx/space/internal/testenv"
)

// Network safety: every address below is put on a veth inside a
// network namespace the test makes; nothing is dialled.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// scratchNetns starts a process in a new network namespace and returns
// its namespace's path and a netlink handle into it.
func scratchNetns(t *testing.T) (string, *netlink.Handle) {
	t.Helper()
	testenv.RequireRoot(t, "a network namespace of the test's own")
	cmd := exec.Command("unshare", "-n", "sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	path := "/proc/" + strconv.Itoa(cmd.Process.Pid) + "/ns/net"
	// unshare execs sleep once the namespace is made: wait for it.
	self, _ := netns.GetFromPath("/proc/self/ns/net")
	defer self.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		ns, err := netns.GetFromPath(path)
		if err == nil {
			same := ns.Equal(self)
			if !same {
				h, err := netlink.NewHandleAt(ns)
				ns.Close()
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(h.Close)
				return path, h
			}
			ns.Close()
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never got a namespace of its own", path)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// addLink makes a veth pair (the dummy driver is not on every host) and
// returns one end, up.
func addLink(t *testing.T, h *netlink.Handle, name string) netlink.Link {
	t.Helper()
	if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"}); err != nil {
		t.Fatal(err)
	}
	l, err := h.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetUp(l); err != nil {
		t.Fatal(err)
	}
	return l
}

func addrOn(t *testing.T, h *netlink.Handle, l netlink.Link, p string) {
	t.Helper()
	pp := netip.MustParsePrefix(p)
	a := &netlink.Addr{IPNet: &net.IPNet{IP: pp.Addr().AsSlice(), Mask: net.CIDRMask(pp.Bits(), pp.Addr().BitLen())}}
	if err := h.AddrAdd(l, a); err != nil {
		t.Fatal(err)
	}
}

func addrOff(t *testing.T, h *netlink.Handle, l netlink.Link, p string) {
	t.Helper()
	pp := netip.MustParsePrefix(p)
	a := &netlink.Addr{IPNet: &net.IPNet{IP: pp.Addr().AsSlice(), Mask: net.CIDRMask(pp.Bits(), pp.Addr().BitLen())}}
	if err := h.AddrDel(l, a); err != nil {
		t.Fatal(err)
	}
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after 5s: %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func run(t *testing.T, w *Watcher) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); w.Run(ctx) }()
	t.Cleanup(func() { cancel(); wg.Wait(); w.Close() })
}

func TestFollowsAddresses(t *testing.T) {
	path, h := scratchNetns(t)
	l := addLink(t, h, "d0")
	addrOn(t, h, l, "203.0.113.7/24")
	w, err := New(Config{NetnsPath: path})
	if err != nil {
		t.Fatal(err)
	}
	run(t, w)
	at := netip.MustParseAddr
	if !w.Contains(at("203.0.113.7")) {
		t.Fatalf("an address present at start is missing: %v", w.Addrs())
	}
	if w.Contains(at("203.0.113.8")) || w.Contains(at("198.51.100.1")) {
		t.Fatalf("an address the namespace does not have is contained: %v", w.Addrs())
	}
	// Gained while running: v4 and v6, and in IPv4-mapped form.
	addrOn(t, h, l, "198.51.100.1/32")
	addrOn(t, h, l, "2001:db8::5/64")
	eventually(t, "198.51.100.1 added", func() bool { return w.Contains(at("198.51.100.1")) })
	eventually(t, "2001:db8::5 added", func() bool { return w.Contains(at("2001:db8::5")) })
	if !w.Contains(at("::ffff:198.51.100.1")) {
		t.Error("the IPv4-mapped form of a host address is not contained")
	}
	// Lost while running.
	addrOff(t, h, l, "198.51.100.1/32")
	eventually(t, "198.51.100.1 removed", func() bool { return !w.Contains(at("198.51.100.1")) })
	// A link that goes takes its addresses.
	if err := h.LinkDel(l); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the deleted link's addresses removed", func() bool { return !w.Contains(at("203.0.113.7")) })
	// Another namespace's addresses are not this one's.
	if w.Contains(at("127.0.0.2")) {
		t.Error("127.0.0.2 is contained though lo is down in the scratch namespace")
	}
}

// A Watcher whose set is unknown contains every address (fail closed).
func TestUnknownContainsAll(t *testing.T) {
	path, _ := scratchNetns(t)
	w, err := New(Config{NetnsPath: path})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if w.Contains(netip.MustParseAddr("198.51.100.9")) {
		t.Fatal("contained before the set was lost")
	}
	w.set.Store(nil)
	for _, a := range []string{"198.51.100.9", "2001:db8::1", "8.8.8.8"} {
		if !w.Contains(netip.MustParseAddr(a)) {
			t.Errorf("%s not contained while the set is unknown", a)
		}
	}
	if w.Addrs() != nil {
		t.Error("Addrs is not nil while the set is unknown")
	}
}

func TestConfigRejects(t *testing.T) {
	if _, err := New(Config{Resync: -time.Second}); err == nil {
		t.Error("a negative resync interval was accepted")
	}
	if _, err := New(Config{NetnsPath: "/nonexistent/ns"}); err == nil {
		t.Error("a namespace path that does not exist was accepted")
	}
}

// A lost subscription (its context ending is the one way to stop it
// from outside; a resync racing a removal is the other path) leaves no
// goroutine behind: goleak in TestMain checks every test.
func TestRunStopsPromptly(t *testing.T) {
	path, h := scratchNetns(t)
	w, err := New(Config{NetnsPath: path, Resync: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); w.Run(ctx) }()
	// Flood events while stopping, so netlink's goroutine may be blocked
	// on the channel when the subscription closes.
	l := addLink(t, h, "d1")
	for i := range 50 {
		addrOn(t, h, l, "198.51.100."+strconv.Itoa(i+1)+"/32")
	}
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return within 5s of its context ending")
	}
	w.Close()
}
