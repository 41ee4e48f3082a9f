//go:build linux

package microvm

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

// hostLink is the host side of a test VM's link: a tap in a network
// namespace of the test's own, holding gateway addresses, each with a TCP
// listener. Nothing in it reaches anywhere else.
type hostLink struct {
	tap       *os.File
	listeners map[netip.Addr]net.Listener
}

// newHostLink makes the tap "sbx0" with the gateway addresses gws (each
// /30) in a new network namespace, up, and a listener on each address.
func newHostLink(t *testing.T, gws ...netip.Prefix) *hostLink {
	t.Helper()
	testenv.RequireRoot(t, "creates a network namespace and a tap")
	hl := &hostLink{listeners: map[netip.Addr]net.Listener{}}
	errc := make(chan error, 1)
	go func() { errc <- hl.setupInNewNetns(gws) }() // sends once its thread is back
	if err := <-errc; err != nil {
		hl.close()
		t.Fatalf("host link: %v", err)
	}
	t.Cleanup(hl.close)
	return hl
}

// setupInNewNetns runs setup on this goroutine's thread, locked, in a
// new network namespace, and moves the thread back (or leaves it locked,
// to end with the goroutine).
func (hl *hostLink) setupInNewNetns(gws []netip.Prefix) error {
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer unix.Close(orig)
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer func() {
		if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		}
	}()
	return hl.setup(gws)
}

// setup runs in the new namespace.
func (hl *hostLink) setup(gws []netip.Prefix) error {
	fd, err := unix.Open(tunDevice, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	ifr, err := unix.NewIfreq("sbx0")
	if err != nil {
		unix.Close(fd)
		return err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return err
	}
	hl.tap = os.NewFile(uintptr(fd), "sbx0")
	sock, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(sock)
	for i, gw := range gws {
		name := "sbx0"
		if i > 0 {
			name = fmt.Sprintf("sbx0:%d", i) // a second address, the old way
		}
		a := gw.Addr().As4()
		m := net.CIDRMask(gw.Bits(), 32)
		for _, op := range []struct {
			req uint
			v   []byte
		}{{unix.SIOCSIFADDR, a[:]}, {unix.SIOCSIFNETMASK, m}} {
			r, err := unix.NewIfreq(name)
			if err != nil {
				return err
			}
			if err := r.SetInet4Addr(op.v); err != nil {
				return err
			}
			if err := unix.IoctlIfreq(sock, op.req, r); err != nil {
				return fmt.Errorf("%s: ioctl %#x: %w", name, op.req, err)
			}
		}
	}
	r, err := unix.NewIfreq("sbx0")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(sock, unix.SIOCGIFFLAGS, r); err != nil {
		return err
	}
	r.SetUint16(r.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(sock, unix.SIOCSIFFLAGS, r); err != nil {
		return err
	}
	for _, gw := range gws {
		l, err := net.Listen("tcp4", netip.AddrPortFrom(gw.Addr(), 0).String())
		if err != nil {
			return err
		}
		hl.listeners[gw.Addr()] = l
	}
	return nil
}

func (hl *hostLink) close() {
	if hl.tap != nil {
		hl.tap.Close()
	}
	for _, l := range hl.listeners {
		l.Close()
	}
}

// serveOnce accepts one connection on gw's listener, reads a line and
// answers "pong"; it reports the line and the client's address.
func (hl *hostLink) serveOnce(gw netip.Addr) <-chan string {
	l := hl.listeners[gw]
	out := make(chan string, 1)
	go func() { // ends with the accept's deadline at the latest
		l.(*net.TCPListener).SetDeadline(time.Now().Add(2 * time.Minute))
		c, err := l.Accept()
		if err != nil {
			out <- "accept: " + err.Error()
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(30 * time.Second))
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			out <- "read: " + err.Error()
			return
		}
		c.Write([]byte("pong\n"))
		host, _, _ := net.SplitHostPort(c.RemoteAddr().String())
		out <- strings.TrimSpace(line) + " from " + host
	}()
	return out
}

func (hl *hostLink) port(gw netip.Addr) int {
	return hl.listeners[gw].Addr().(*net.TCPAddr).Port
}

func testCA(t *testing.T) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "space egress test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
}

// TestVMNetwork: a clone of a template (booted on a throwaway tap) gets a
// real tap whose host side is in the test's namespace; the agent
// configures the NIC at activation (MAC, address, route, resolver, CA)
// and the guest reaches a listener on the gateway from its address. A
// second activation (as after a move) replaces address and route, and a
// worker that adopts the VM finds its link still there.
func TestVMNetwork(t *testing.T) {
	s, agent, ctx := agentSubstrate(t)
	gw1, gw2 := netip.MustParsePrefix("10.203.0.1/30"), netip.MustParsePrefix("10.203.0.5/30")
	hl := newHostLink(t, gw1, gw2)
	mac := net.HardwareAddr{0x02, 0x53, 0x50, 0x00, 0x00, 0x07}
	r1 := testRoute("n1")
	spec := substrate.Spec{
		Route: r1, Template: "base", Dir: filepath.Join(t.TempDir(), "n1"), AgentPath: agent,
		Network: &substrate.Network{Addr: netip.MustParsePrefix("10.203.0.2/30"), Gateway: gw1.Addr(), Tap: hl.tap, MAC: mac},
	}
	t0 := time.Now()
	inst, err := s.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { inst.Stop(context.Background()) }()
	// The caller's copy goes: QEMU's keeps the link.
	hl.tap.Close()
	hl.tap = nil
	ca := testCA(t)
	network := func(addr string, gw netip.Prefix) map[string]any {
		return map[string]any{"network": map[string]any{
			"address": addr, "gateway": gw.Addr().String(), "dns": gw.Addr().String(),
			"mac": mac.String(), "mtu": 1400, "ca_cert": ca,
		}}
	}
	a := activateWith(t, ctx, inst, r1, network("10.203.0.2/30", gw1))
	t.Logf("clone started and activated with its network in %s", time.Since(t0).Round(time.Millisecond))

	probe := func(a *agentSession, gw netip.Prefix, wantFrom string) {
		t.Helper()
		got := hl.serveOnce(gw.Addr())
		out := a.run(t, ctx, fmt.Sprintf(`cat /sys/class/net/eth0/address /sys/class/net/eth0/mtu
			echo ping | nc %s %d
			cat /etc/resolv.conf
			grep -c '^# space-egress-ca begin$' /etc/ssl/certs/ca-certificates.crt
			sha256sum < /usr/local/share/ca-certificates/space-egress.crt | cut -d' ' -f1
			ip -4 -o addr show dev eth0 | awk '{print $4}'
			ip route | grep ^default`, gw.Addr(), hl.port(gw.Addr())))
		want := fmt.Sprintf("%s\n1400\npong\nnameserver %s\n1\n%x\n%s\ndefault via %s dev eth0",
			mac, gw.Addr(), sha256.Sum256([]byte(ca)), wantFrom+"/30", gw.Addr())
		var lines []string
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			lines = append(lines, strings.TrimSpace(l))
		}
		if strings.Join(lines, "\n") != want {
			t.Errorf("guest:\n%s\nwant\n%s", out, want)
		}
		select {
		case line := <-got:
			if line != "ping from "+wantFrom {
				t.Errorf("host side got %q, want %q", line, "ping from "+wantFrom)
			}
		case <-ctx.Done():
			t.Fatal("host side: no connection")
		}
	}
	probe(a, gw1, "10.203.0.2")

	// A new activation (a move gives a new address and gateway).
	a.close()
	r2 := r1
	r2.ActivationID = "n2"
	a2 := activateWith(t, ctx, inst, r2, network("10.203.0.6/30", gw2))
	probe(a2, gw2, "10.203.0.6")

	// A worker restart: the adopting substrate finds the link with QEMU.
	state := inst.(substrate.Adoptable).AdoptState()
	inst.(substrate.Adoptable).Detach()
	cfg := s.cfg
	cfg.Accel = s.Accel()
	s2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	spec.Route = r1 // the adoption record's route
	inst2, err := s2.Adopt(ctx, spec, state)
	if err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	inst = inst2
	probe(a2, gw2, "10.203.0.6")
	if err := inst2.Stop(ctx); err != nil {
		t.Fatal(err)
	}
}
