package hostile

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/spacesbx/space/sdk"
)

// Escape: network, an address the host gains while sandboxes run. The
// worker's list of its own (always denied) addresses once came from a
// single listing at start, so an address added later (a new interface,
// DHCP, a VPN, another test's simulated internet) was "the internet" to
// a sandbox allowed out, and host services on the wildcard address were
// reachable through it. The test adds an address to the host's network
// namespace (on a veth pair of its own, removed at the end) while a
// sandbox with the internet open runs, and attacks it.
//
// Network safety: the address is on a link of the test's own in the
// host's namespace; every connection to it is local.
func TestEscapeNetworkHostGainsAddress(t *testing.T) {
	p := shared(t)
	t.Parallel()
	open := true
	created, err := p.client.CreateSandbox(context.Background(), sdk.CreateOptions{Timeout: 10 * time.Minute, AllowInternetAccess: &open})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { created.Kill(context.Background()) })
	s := &sandbox{created, p}
	s.upload(t)

	var accepted atomic.Int32
	ln, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			c.Close()
		}
	}()
	_, port, _ := net.SplitHostPort(ln.Addr().String())

	// TEST-NET-3 (203.0.113/24): not reserved by the policy (tests use it
	// as the internet), so only the host-address check stands in the way.
	b := make([]byte, 3)
	rand.Read(b)
	ip := net.IPv4(203, 0, 113, 10+b[0]%200)
	name := "spch" + hex.EncodeToString(b[1:])
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatalf("veth: %v", err)
	}
	t.Cleanup(func() { netlink.LinkDel(veth) })
	l, err := netlink.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: ip, Mask: net.CIDRMask(32, 32)}}); err != nil {
		t.Fatalf("address: %v", err)
	}
	if err := netlink.LinkSetUp(l); err != nil {
		t.Fatal(err)
	}
	// Control: the host itself reaches its new address (the listener
	// would count a sandbox's connection).
	c, err := net.DialTimeout("tcp", net.JoinHostPort(ip.String(), port), 3*time.Second)
	if err != nil {
		t.Fatalf("the host cannot reach its own new address: %v", err)
	}
	c.Close()
	waitFor(t, func() bool { return accepted.Load() == 1 })
	accepted.Store(0)

	target := net.JoinHostPort(ip.String(), port)
	for _, user := range []string{"root", "user"} {
		r := s.attack(t, user, "connect", target, fmt.Sprintf("[::ffff:%s]:%s", ip, port))
		for _, l := range lines(r.out) {
			if strings.HasPrefix(l.name, "connect ") && strings.HasPrefix(l.v, "ok") {
				t.Logf("as %s: %s completed a handshake (with the egress proxy)", user, l.name)
			}
		}
	}
	if n := accepted.Load(); n > 0 {
		t.Errorf("the host's new address %s accepted %d connections from a sandbox allowed out", ip, n)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 5s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
