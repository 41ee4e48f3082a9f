package egress

import (
	"net"
	"net/netip"
	"sync"
	"testing"

	"github.com/spacesbx/space/internal/netpolicy"
)

// hostSet is a host address set that changes while the proxy runs, as
// hostaddr.Watcher's does.
type hostSet struct {
	mu sync.Mutex
	m  map[netip.Addr]bool
}

func (h *hostSet) Contains(a netip.Addr) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.m[a]
}

func (h *hostSet) add(a string) {
	h.mu.Lock()
	h.m[netip.MustParseAddr(a)] = true
	h.mu.Unlock()
}

// An address the host gains after the proxy started is denied from then
// on, for sandboxes whose policy was compiled before, under allow-all,
// and in its IPv4-mapped form; the DNS answers of the proxy drop it too.
func TestHostAddressGainedLaterIsDenied(t *testing.T) {
	host := &hostSet{m: map[netip.Addr]bool{}}
	e := newEnv(t, func(c *Config) { c.Defaults.Host = host })
	addr := e.listen("127.0.0.2")
	all := netpolicy.Defaults{Allow: true, Host: host}
	e.set("127.0.0.2", "sb1", netpolicy.Spec{}, all)
	echo := echoServer(t)
	dst := "198.51.100.7:80"
	e.route(dst, echo)
	roundTrip(t, e.connect(addr, dst), "before")

	host.add("198.51.100.7")
	for _, to := range []string{dst, "[::ffff:198.51.100.7]:80"} {
		e.route(to, echo)
		expectClosed(t, e.connect(addr, to))
		e.waitDenial("reserved", dst) // reported unmapped
	}
	if n := len(e.dials()); n != 1 {
		t.Fatalf("dialed %v: want only the connection made before the address was the host's", e.dials())
	}
}

// fakeConn has the addresses of a dialled TCP socket.
type fakeConn struct {
	net.Conn
	l, r net.Addr
}

func (f fakeConn) LocalAddr() net.Addr  { return f.l }
func (f fakeConn) RemoteAddr() net.Addr { return f.r }

// The backstop behind the decision: a socket the kernel connected to the
// host itself (source == destination) or to an address the host gained
// while it was dialled.
func TestLocalConnBackstop(t *testing.T) {
	host := &hostSet{m: map[netip.Addr]bool{}}
	e := newEnv(t, func(c *Config) { c.Defaults.Host = host })
	tcp := func(s string) *net.TCPAddr { return net.TCPAddrFromAddrPort(netip.MustParseAddrPort(s)) }
	for _, c := range []struct {
		l, r, want string
	}{
		{"198.51.100.7:40000", "198.51.100.7:80", "this host"},
		{"[::ffff:198.51.100.7]:40000", "198.51.100.7:80", "this host"},
		{"[2001:db8::1]:40000", "[2001:db8::1]:443", "this host"},
		{"10.0.0.5:40000", "198.51.100.8:80", "reserved"}, // gained meanwhile (below)
		{"10.0.0.5:40000", "203.0.113.9:80", ""},
	} {
		host.add("198.51.100.8")
		got := e.p.localConn(fakeConn{l: tcp(c.l), r: tcp(c.r)})
		if got != c.want {
			t.Errorf("local %s remote %s: %q, want %q", c.l, c.r, got, c.want)
		}
	}
	// Not a TCP socket: nothing to compare, left to the decision.
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if got := e.p.localConn(a); got != "" {
		t.Errorf("a pipe: %q", got)
	}
}
