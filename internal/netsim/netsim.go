// Package netsim is a simulated internet for tests and benchmarks: a
// network namespace of its own, linked to the caller's by a veth, whose
// addresses serve HTTP, HTTPS (under a CA of its own), TCP echo, discard
// and chargen, and an authoritative DNS server that answers a zone the test
// chooses and records every query.
//
// It lives outside _test files because the egress proxy's tests, the
// sandbox network tests and the benchmark all need the same internet.
//
// Addressing: every Internet gets a /24 of 198.18.0.0/15 (RFC 2544's
// benchmarking range) that is unique on the machine: the root-side veth is
// named "nsim<k>" for 198.18.k.0/24 (198.19.(k-256).0/24 from k=256), and
// the kernel's refusal to create a second link of one name is the lock, so
// concurrent test processes never share a /24 and a crashed one leaves
// nothing behind (the namespace is held by file descriptors only; when the
// process dies the kernel deletes the namespace and with it both veth ends).
// A route that makes the whole 198.18.0.0/15 unreachable is added to the
// caller's namespace before anything else and never removed: an address of
// an Internet that is gone can then never be sent to the real default
// gateway. The connected /24 of a live Internet is more specific, so it
// wins over that route.
package netsim

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"

	"github.com/spacesbx/space/internal/errdefs"
)

// Limits and fixed addresses.
const (
	// DefaultHosts is the number of serving addresses when Options.Hosts is 0.
	DefaultHosts = 3
	// MaxHosts is the most serving addresses one Internet has: they are
	// .10 up to .52 of its /24 (.53 is the DNS server).
	MaxHosts = 43
	// MaxInternets is how many Internets the machine can hold at once
	// (512 /24s in 198.18.0.0/15).
	MaxInternets = 512

	firstHostOctet = 10
	dnsOctet       = 53
	rootOctet      = 1
	linkPrefix     = "nsim"
)

// simRange is the address range every Internet's /24 comes from.
var simRange = netip.MustParsePrefix("198.18.0.0/15")

// Range returns the address range every Internet's /24 comes from
// (198.18.0.0/15). The caller's namespace routes all of it to nowhere
// (unreachable) except the /24s of live Internets.
func Range() netip.Prefix { return simRange }

// Ports of the services every host address serves.
const (
	PortEcho    = 7
	PortDiscard = 9
	PortChargen = 19
	PortDNS     = 53
	PortHTTP    = 80
	PortHTTPS   = 443
)

// Options configures Start.
type Options struct {
	// Zone maps DNS names (lower-case, no trailing dot; others are
	// normalized) to the addresses the simulated DNS answers (A for IPv4,
	// AAAA for IPv6; a name with no address of the asked type gets an
	// empty NOERROR answer, a name not in the zone or with no address
	// NXDOMAIN; subdomains are not implied; every answer has a TTL of 1 s,
	// so SetZone takes effect at once). Names may map
	// to any address (e.g. "rebind.test" -> 127.0.0.1 or 169.254.169.254 to
	// test DNS rebinding). Host(i) addresses are the ones that actually
	// serve; since they are known only after Start, SetZone adds or
	// changes names later.
	Zone map[string][]netip.Addr
	// Hosts is the number of serving addresses, 1 to MaxHosts (default
	// DefaultHosts).
	Hosts int
}

// Validate reports whether the options can be used.
func (o Options) Validate() error {
	if o.Hosts < 0 || o.Hosts > MaxHosts {
		return fmt.Errorf("netsim: hosts %d: %w: want 0 (default) to %d", o.Hosts, errdefs.ErrInvalid, MaxHosts)
	}
	for name, addrs := range o.Zone {
		if _, err := normalizeName(name); err != nil {
			return err
		}
		if err := checkAddrs(name, addrs); err != nil {
			return err
		}
	}
	return nil
}

// Request is one HTTP or HTTPS request an Internet received.
type Request struct {
	Method string
	Scheme string // "http" or "https"
	Host   string // the Host header (HTTP/2: :authority)
	Path   string
	// RawQuery is the URL's query without the '?'.
	RawQuery string
	Proto    string      // "HTTP/1.1", "HTTP/2.0"
	Header   http.Header // a copy
	// SNI is the TLS server name the client sent (HTTPS only).
	SNI        string
	RemoteAddr netip.AddrPort
	LocalAddr  netip.AddrPort
}

// Query is one DNS question the Internet's DNS server received.
type Query struct {
	Name   string // lower-case, no trailing dot
	Type   string // "A", "AAAA", ... (dns.TypeToString; "TYPE<n>" when unknown)
	Net    string // "udp" or "tcp"
	Remote netip.AddrPort
	// Server is the address the query was sent to: DNS() or a host's :53.
	Server netip.AddrPort
}

// EchoReply is the JSON body "/echo" answers.
type EchoReply struct {
	Method    string      `json:"method"`
	Scheme    string      `json:"scheme"`
	Host      string      `json:"host"`
	Path      string      `json:"path"`
	RawQuery  string      `json:"rawQuery,omitempty"`
	Proto     string      `json:"proto"`
	Headers   http.Header `json:"headers"`
	SNI       string      `json:"sni,omitempty"`
	Remote    string      `json:"remote"`
	Local     string      `json:"local"`
	BodyBytes int64       `json:"bodyBytes"`
}

// Internet is one running simulated internet. Its methods are safe for
// concurrent use.
type Internet struct {
	index     int // k of nsim<k>
	linkName  string
	linkIndex int
	prefix    netip.Prefix
	rootAddr  netip.Addr
	hosts     []netip.Addr
	dnsAddr   netip.Addr

	ca     *authority
	caPool *x509.CertPool
	tlsCfg *tls.Config

	nsFile *os.File // holds the internet namespace
	root   *netlink.Handle

	httpSrv  *http.Server
	dnsSrvs  []*dns.Server
	wg       sync.WaitGroup // accept loops, connections of the TCP services, Serve calls
	httpWG   sync.WaitGroup // HTTP connections (ConnState new -> closed/hijacked)
	handlers tracker        // HTTP handlers (HTTP/2 runs them outside the connection's goroutine)

	discarded atomic.Int64

	mu        sync.Mutex
	closed    bool
	zone      map[string][]netip.Addr
	requests  []Request
	queries   []Query
	accepted  map[int]int
	tcpConns  map[*trackedConn]struct{} // accepted, not yet closed
	listeners []closer

	closeOnce sync.Once
	closeErr  error
}

type closer interface{ Close() error }

// Host returns the i-th serving address, or the zero Addr when i is out of
// range.
func (n *Internet) Host(i int) netip.Addr {
	if i < 0 || i >= len(n.hosts) {
		return netip.Addr{}
	}
	return n.hosts[i]
}

// Hosts returns every serving address.
func (n *Internet) Hosts() []netip.Addr { return slices.Clone(n.hosts) }

// DNS returns the DNS server's address (UDP and TCP).
func (n *Internet) DNS() netip.AddrPort { return netip.AddrPortFrom(n.dnsAddr, PortDNS) }

// Prefix returns the Internet's /24.
func (n *Internet) Prefix() netip.Prefix { return n.prefix }

// RootAddr returns the caller's side of the link (.1): the source address
// of connections from the caller's namespace.
func (n *Internet) RootAddr() netip.Addr { return n.rootAddr }

// LinkName returns the name of the caller's side of the veth ("nsim<k>").
func (n *Internet) LinkName() string { return n.linkName }

// CAPEM returns the PEM of the CA that signs the HTTPS certificates.
func (n *Internet) CAPEM() []byte { return slices.Clone(n.ca.certPEM) }

// CAPool returns a pool holding only the Internet's CA.
func (n *Internet) CAPool() *x509.CertPool { return n.caPool.Clone() }

// SetZone makes the DNS server answer name with addrs from now on (no
// addresses: the name is removed and answers NXDOMAIN). HTTPS serves a
// certificate for every name in the zone at the time of the handshake.
func (n *Internet) SetZone(name string, addrs ...netip.Addr) error {
	norm, err := normalizeName(name)
	if err != nil {
		return err
	}
	if err := checkAddrs(name, addrs); err != nil {
		return err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(addrs) == 0 {
		delete(n.zone, norm)
		return nil
	}
	n.zone[norm] = unmapAll(addrs)
	return nil
}

func (n *Internet) lookupZone(name string) ([]netip.Addr, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	a, ok := n.zone[name]
	return a, ok
}

// Requests returns the HTTP(S) requests seen so far, oldest first.
func (n *Internet) Requests() []Request {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]Request, len(n.requests))
	for i, r := range n.requests {
		r.Header = r.Header.Clone()
		out[i] = r
	}
	return out
}

// ResetRequests forgets the requests seen so far.
func (n *Internet) ResetRequests() {
	n.mu.Lock()
	n.requests = nil
	n.mu.Unlock()
}

// Queries returns the DNS queries seen so far, oldest first.
func (n *Internet) Queries() []Query {
	n.mu.Lock()
	defer n.mu.Unlock()
	return slices.Clone(n.queries)
}

// ResetQueries forgets the DNS queries seen so far.
func (n *Internet) ResetQueries() {
	n.mu.Lock()
	n.queries = nil
	n.mu.Unlock()
}

// Accepted returns how many TCP connections were accepted on port, over
// every address of the Internet (53 counts DNS over TCP; HTTPS counts
// before the TLS handshake).
func (n *Internet) Accepted(port int) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.accepted[port]
}

// Discarded returns how many bytes the discard service (:9) has read.
func (n *Internet) Discarded() int64 { return n.discarded.Load() }

// normalizeName lower-cases name and drops one trailing dot; it rejects
// names DNS cannot carry.
func normalizeName(name string) (string, error) {
	norm := strings.TrimSuffix(strings.ToLower(name), ".")
	if norm == "" || strings.HasPrefix(norm, ".") || strings.HasSuffix(norm, ".") {
		return "", fmt.Errorf("netsim: zone name %q: %w: empty label", name, errdefs.ErrInvalid)
	}
	if _, ok := dns.IsDomainName(norm); !ok || strings.ContainsAny(norm, " \t\\\"*") {
		return "", fmt.Errorf("netsim: zone name %q: %w: not a domain name", name, errdefs.ErrInvalid)
	}
	for i := 0; i < len(norm); i++ {
		if c := norm[i]; c <= ' ' || c >= 0x7f {
			return "", fmt.Errorf("netsim: zone name %q: %w: not ASCII", name, errdefs.ErrInvalid)
		}
	}
	return norm, nil
}

func checkAddrs(name string, addrs []netip.Addr) error {
	for _, a := range addrs {
		if !a.IsValid() {
			return fmt.Errorf("netsim: zone name %q: %w: invalid address", name, errdefs.ErrInvalid)
		}
		if a.Zone() != "" {
			return fmt.Errorf("netsim: zone name %q: %w: address %s has a zone", name, errdefs.ErrInvalid, a)
		}
	}
	return nil
}

func unmapAll(addrs []netip.Addr) []netip.Addr {
	out := make([]netip.Addr, len(addrs))
	for i, a := range addrs {
		out[i] = a.Unmap()
	}
	return out
}

// tracker counts running work that Close must wait for, and refuses new
// work once closed (a sync.WaitGroup may not be Added to while Waited on
// from zero).
type tracker struct {
	mu     sync.Mutex
	n      int
	closed bool
	zero   chan struct{}
}

func (t *tracker) add() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	t.n++
	return true
}

func (t *tracker) done() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.n--
	if t.n == 0 && t.zero != nil {
		close(t.zero)
		t.zero = nil
	}
}

// close refuses new work and returns a channel closed once none runs.
func (t *tracker) close() <-chan struct{} {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	ch := make(chan struct{})
	if t.n == 0 {
		close(ch)
	} else {
		t.zero = ch
	}
	return ch
}
