package egress

import (
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/netpolicy"
)

const dnsTypeA = dns.TypeA

// fakeUpstream is a DNS server on loopback (UDP and TCP on one port)
// answering A/AAAA from records; other names: NOERROR, no answer.
func fakeUpstream(t *testing.T, records map[string][]string) netip.AddrPort {
	t.Helper()
	h := dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		q := r.Question[0]
		if q.Qtype == dns.TypeHTTPS {
			rr, _ := dns.NewRR(q.Name + " 60 IN HTTPS 1 . alpn=h2 ipv4hint=203.0.113.9,169.254.169.254 ipv6hint=::1")
			m.Answer = append(m.Answer, rr)
		}
		for _, a := range records[strings.ToLower(q.Name)] {
			ip := netip.MustParseAddr(a)
			switch {
			case ip.Is4() && q.Qtype == dns.TypeA:
				rr, _ := dns.NewRR(fmt.Sprintf("%s 60 IN A %s", q.Name, a))
				m.Answer = append(m.Answer, rr)
			case ip.Is6() && q.Qtype == dns.TypeAAAA:
				rr, _ := dns.NewRR(fmt.Sprintf("%s 60 IN AAAA %s", q.Name, a))
				m.Answer = append(m.Answer, rr)
			}
		}
		w.WriteMsg(m)
	})
	return startDNS(t, h)
}

// startDNS serves h on loopback, UDP and TCP on one port.
func startDNS(t *testing.T, h dns.Handler) netip.AddrPort {
	t.Helper()
	var pc net.PacketConn
	var ln net.Listener
	for i := 0; ; i++ {
		var err error
		if pc, err = net.ListenPacket("udp4", "127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		if ln, err = net.Listen("tcp4", pc.LocalAddr().String()); err == nil {
			break
		}
		pc.Close()
		if i > 20 {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	var servers []*dns.Server
	for _, s := range []*dns.Server{{PacketConn: pc, Handler: h}, {Listener: ln, Handler: h}} {
		started := make(chan struct{})
		s.NotifyStartedFunc = func() { close(started) }
		servers = append(servers, s)
		wg.Add(1)
		go func() { defer wg.Done(); s.ActivateAndServe() }()
		<-started
	}
	t.Cleanup(func() {
		for _, s := range servers {
			s.Shutdown()
		}
		wg.Wait()
	})
	return netip.MustParseAddrPort(pc.LocalAddr().String())
}

// serveDNS runs ServeDNS on gw (UDP and TCP on one port).
func (e *env) serveDNS(gw string) string {
	e.t.Helper()
	for i := 0; ; i++ {
		uc, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr(gw), 0)))
		if err != nil {
			e.t.Fatal(err)
		}
		ln, err := net.Listen("tcp4", uc.LocalAddr().String())
		if err != nil {
			uc.Close()
			if i > 20 {
				e.t.Fatal(err)
			}
			continue
		}
		e.goServeDNS(uc, ln)
		return uc.LocalAddr().String()
	}
}

func (e *env) goServeDNS(uc *net.UDPConn, ln net.Listener) {
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		if err := e.p.ServeDNS(e.ctx, uc, ln); err != nil {
			e.t.Errorf("ServeDNS: %v", err)
		}
	}()
}

func query(t *testing.T, server, name string, qtype uint16, tcp bool) *dns.Msg {
	t.Helper()
	r, err := tryQuery(server, name, qtype, tcp, 0)
	if err != nil {
		t.Fatalf("query %s %s: %v", name, dns.TypeToString[qtype], err)
	}
	return r
}

func tryQuery(server, name string, qtype uint16, tcp bool, edns uint16) (*dns.Msg, error) {
	c := &dns.Client{Timeout: 2 * time.Second}
	if tcp {
		c.Net = "tcp"
	}
	m := new(dns.Msg)
	m.SetQuestion(name, qtype)
	if edns > 0 {
		m.SetEdns0(edns, false)
	}
	r, _, err := c.Exchange(m, server)
	return r, err
}

func answers(r *dns.Msg) []string {
	var out []string
	for _, rr := range r.Answer {
		if a, ok := rrAddr(rr); ok {
			out = append(out, a.String())
		}
	}
	return out
}

var dnsRecords = map[string][]string{
	"ok.example.com.":     {"203.0.113.5", "127.0.0.1", "10.1.1.1", "169.254.169.254"},
	"rebind.example.com.": {"169.254.169.254", "127.0.0.53"},
	"bad.example.com.":    {"203.0.113.6"},
	"x.cdn.example.com.":  {"203.0.113.7"},
}

func TestDNSAllowList(t *testing.T) {
	up := fakeUpstream(t, dnsRecords)
	e := newEnv(t, func(c *Config) { c.Upstreams = []netip.AddrPort{up} })
	srv := e.serveDNS("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"ok.example.com", "*.cdn.example.com", "rebind.example.com"}}, denyAll)

	for _, tcp := range []bool{false, true} {
		r := query(t, srv, "OK.example.com.", dns.TypeA, tcp)
		if r.Rcode != dns.RcodeSuccess || !slices.Equal(answers(r), []string{"203.0.113.5"}) {
			t.Fatalf("tcp=%v ok.example.com: %v", tcp, r)
		}
	}
	if r := query(t, srv, "x.cdn.example.com.", dns.TypeA, false); !slices.Equal(answers(r), []string{"203.0.113.7"}) {
		t.Fatalf("wildcard: %v", r)
	}
	for _, q := range []struct {
		name  string
		qtype uint16
	}{
		{"bad.example.com.", dns.TypeA},
		{"cdn.example.com.", dns.TypeA},
		{"5.113.0.203.in-addr.arpa.", dns.TypePTR},
		{"ok.example.com.", dns.TypeANY},
		{"ok.example.com.", dns.TypePTR},
	} {
		r := query(t, srv, q.name, q.qtype, false)
		if r.Rcode != dns.RcodeRefused || len(r.Answer) != 0 {
			t.Errorf("%s %s: %v", q.name, dns.TypeToString[q.qtype], r)
		}
	}
	d := e.waitDenial("no-domain-match", "bad.example.com")
	if d.Kind != "dns" || d.SandboxID != "sb1" {
		t.Fatalf("denial %+v", d)
	}
	e.waitDenial("refused-qtype", "5.113.0.203.in-addr.arpa")

	// Allowed, but every address reserved: NOERROR and nothing.
	r := query(t, srv, "rebind.example.com.", dns.TypeA, false)
	if r.Rcode != dns.RcodeSuccess || len(r.Answer) != 0 {
		t.Fatalf("rebind: %v", r)
	}
	e.waitDenial("rebinding", "rebind.example.com")

	if got := e.counter("space_egress_dns_queries_total", "verdict", "allow", "reason", "allow-domain"); got != 3 {
		t.Fatalf("allowed queries counted %v", got)
	}
	if got := e.counter("space_egress_dns_queries_total", "verdict", "deny", "reason", "no-domain-match"); got != 2 {
		t.Fatalf("refused queries counted %v", got)
	}
}

func TestDNSForwardsWithoutAllowList(t *testing.T) {
	up := fakeUpstream(t, dnsRecords)
	e := newEnv(t, func(c *Config) { c.Upstreams = []netip.AddrPort{up} })
	srv := e.serveDNS("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"ok.example.com"}}, netpolicy.Defaults{Allow: true})
	if r := query(t, srv, "bad.example.com.", dns.TypeA, false); !slices.Equal(answers(r), []string{"203.0.113.6"}) {
		t.Fatalf("bad.example.com: %v", r)
	}
	// Reserved answers are stripped whatever the policy.
	if r := query(t, srv, "ok.example.com.", dns.TypeA, false); !slices.Equal(answers(r), []string{"203.0.113.5"}) {
		t.Fatalf("ok.example.com: %v", r)
	}
	r := query(t, srv, "ok.example.com.", dns.TypeHTTPS, false)
	if len(r.Answer) != 1 || !strings.Contains(r.Answer[0].String(), "ipv4hint=\"203.0.113.9\"") ||
		strings.Contains(r.Answer[0].String(), "169.254") || strings.Contains(r.Answer[0].String(), "ipv6hint") {
		t.Fatalf("HTTPS hints: %v", r.Answer)
	}
	if r := query(t, srv, "5.113.0.203.in-addr.arpa.", dns.TypePTR, false); r.Rcode != dns.RcodeSuccess {
		t.Fatalf("PTR: %v", r)
	}
	// Only allowed names are learned: bad.example.com's address is not.
	st, _, _ := e.p.lookupSandbox(netip.MustParseAddr("127.0.0.2"))
	pol := st.sb.Policy
	if n := st.learned.allowed(netip.MustParseAddr("203.0.113.6"), pol, time.Now()); n != "" {
		t.Fatalf("learned %q for a name not allowed", n)
	}
	if n := st.learned.allowed(netip.MustParseAddr("203.0.113.5"), pol, time.Now()); n != "ok.example.com" {
		t.Fatalf("learned %q", n)
	}
}

func TestDNSUnknownSandboxNoAnswer(t *testing.T) {
	up := fakeUpstream(t, dnsRecords)
	e := newEnv(t, func(c *Config) { c.Upstreams = []netip.AddrPort{up} })
	srv := e.serveDNS("127.0.0.4")
	c := &dns.Client{Timeout: 300 * time.Millisecond}
	m := new(dns.Msg)
	m.SetQuestion("ok.example.com.", dns.TypeA)
	if r, _, err := c.Exchange(m, srv); err == nil {
		t.Fatalf("unknown sandbox answered: %v", r)
	}
	e.waitDenial("unknown-sandbox", "ok.example.com")
}

func TestDNSSizeLimits(t *testing.T) {
	var big []string
	for i := 1; i <= 60; i++ {
		big = append(big, fmt.Sprintf("203.0.113.%d", i))
	}
	up := fakeUpstream(t, map[string][]string{"big.example.com.": big})
	e := newEnv(t, func(c *Config) { c.Upstreams = []netip.AddrPort{up} })
	srv := e.serveDNS("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{}, netpolicy.Defaults{Allow: true})

	r, err := tryQuery(srv, "big.example.com.", dns.TypeA, false, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !r.Truncated || len(answers(r)) >= 60 {
		t.Fatalf("plain UDP: truncated=%v answers=%d", r.Truncated, len(answers(r)))
	}
	if r.IsEdns0() != nil {
		t.Fatal("OPT in an answer to a query without one")
	}
	for _, tcp := range []bool{false, true} {
		edns := uint16(4096)
		if tcp {
			edns = 0
		}
		r, err := tryQuery(srv, "big.example.com.", dns.TypeA, tcp, edns)
		if err != nil || r.Truncated || len(answers(r)) != 60 {
			t.Fatalf("tcp=%v: %v truncated=%v answers=%d", tcp, err, r != nil && r.Truncated, len(answers(r)))
		}
	}
}

func TestDNSUpstreamDown(t *testing.T) {
	// Port 9 on loopback with nothing listening: refused at once.
	e := newEnv(t, nil)
	srv := e.serveDNS("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{}, netpolicy.Defaults{Allow: true})
	if r := query(t, srv, "ok.example.com.", dns.TypeA, false); r.Rcode != dns.RcodeServerFailure {
		t.Fatalf("%v", r)
	}
	if e.counter("space_egress_dns_queries_total", "verdict", "error", "reason", "upstream-failed") != 1 {
		t.Fatal("upstream failure not counted")
	}
}

func TestDNSGarbageDropped(t *testing.T) {
	e := newEnv(t, nil)
	srv := e.serveDNS("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{}, netpolicy.Defaults{Allow: true})
	c, err := net.Dial("udp4", srv)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte{1, 2, 3})
	c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := c.Read(make([]byte, 512)); err == nil {
		t.Fatalf("garbage answered with %d bytes", n)
	}
	waitFor(t, func() bool {
		return e.counter("space_egress_dns_queries_total", "verdict", "error", "reason", "malformed") == 1
	})
}

// TestDNSAttributesByPacketDestination: one UDP socket bound to the
// wildcard address (as in production) serves two sandboxes; each query is
// attributed by the packet's destination (IP_PKTINFO), not by the socket's
// local address. Runs in a network namespace of its own, so the wildcard
// socket is reachable from nowhere else.
func TestDNSAttributesByPacketDestination(t *testing.T) {
	up := fakeUpstream(t, dnsRecords)
	e := newEnv(t, func(c *Config) { c.Upstreams = []netip.AddrPort{up} })

	type socks struct {
		srv, srv6 *net.UDPConn
		clients   []net.Conn
		err       error
	}
	ch := make(chan socks)
	go func() {
		// This thread moves to a new netns and is never given back to Go's
		// pool (no UnlockOSThread: the thread exits with the goroutine).
		runtime.LockOSThread()
		var s socks
		defer func() { ch <- s }()
		if s.err = unix.Unshare(unix.CLONE_NEWNET); s.err != nil {
			return
		}
		if s.err = loUp(); s.err != nil {
			return
		}
		if s.srv, s.err = net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4zero, Port: 5353}); s.err != nil {
			return
		}
		// A dual-stack socket sees IPv4 queries as v4-mapped.
		if s.srv6, s.err = net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv6zero, Port: 5354}); s.err != nil {
			return
		}
		for _, dst := range []string{"127.0.0.2:5353", "127.0.0.3:5353", "127.0.0.4:5353", "127.0.0.2:5354", "127.0.0.3:5354"} {
			c, err := net.Dial("udp4", dst)
			if err != nil {
				s.err = err
				return
			}
			s.clients = append(s.clients, c)
		}
	}()
	s := <-ch
	if s.err != nil {
		t.Fatalf("netns setup: %v", s.err)
	}
	for _, c := range s.clients {
		defer c.Close()
	}
	e.goServeDNS(s.srv, nil)
	e.goServeDNS(s.srv6, nil)
	e.set("127.0.0.2", "sb2", netpolicy.Spec{AllowOut: []string{"ok.example.com"}}, denyAll)
	e.set("127.0.0.3", "sb3", netpolicy.Spec{AllowOut: []string{"bad.example.com"}}, denyAll)

	ask := func(c net.Conn) (*dns.Msg, error) {
		co := &dns.Conn{Conn: c}
		m := new(dns.Msg)
		m.SetQuestion("ok.example.com.", dns.TypeA)
		c.SetDeadline(time.Now().Add(500 * time.Millisecond))
		if err := co.WriteMsg(m); err != nil {
			return nil, err
		}
		return co.ReadMsg()
	}
	if r, err := ask(s.clients[0]); err != nil || !slices.Equal(answers(r), []string{"203.0.113.5"}) {
		t.Fatalf("sb2: %v %v", r, err)
	}
	if r, err := ask(s.clients[1]); err != nil || r.Rcode != dns.RcodeRefused {
		t.Fatalf("sb3: %v %v", r, err)
	}
	if r, err := ask(s.clients[2]); err == nil {
		t.Fatalf("unregistered 127.0.0.4 answered: %v", r)
	}
	if r, err := ask(s.clients[3]); err != nil || !slices.Equal(answers(r), []string{"203.0.113.5"}) {
		t.Fatalf("sb2 on the dual-stack socket: %v %v", r, err)
	}
	if r, err := ask(s.clients[4]); err != nil || r.Rcode != dns.RcodeRefused {
		t.Fatalf("sb3 on the dual-stack socket: %v %v", r, err)
	}
}

// loUp brings up lo in the calling thread's network namespace.
func loUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

func TestResolvConf(t *testing.T) {
	ups, err := parseResolvConf(strings.NewReader("# c\nsearch x\nnameserver 192.0.2.53\nnameserver bogus\nnameserver fe80::1%eth0\noptions ndots:1\nnameserver ::ffff:198.51.100.1\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"192.0.2.53:53", "[fe80::1%eth0]:53", "198.51.100.1:53"}
	var got []string
	for _, u := range ups {
		got = append(got, u.String())
	}
	if !slices.Equal(got, want) {
		t.Fatalf("%v", got)
	}
	if _, err := parseResolvConf(strings.NewReader("search x\n")); err == nil {
		t.Fatal("no nameserver accepted")
	}
}

func TestLearnedTTLAndBounds(t *testing.T) {
	pol, _ := netpolicy.Compile(netpolicy.Spec{AllowOut: []string{"a.example.com", "b.example.com"}}, denyAll)
	l := newLearned()
	now := time.Now()
	a := netip.MustParseAddr("203.0.113.1")
	l.add(a, "zzz.example.com", time.Hour, now) // not allowed by pol
	l.add(a, "b.example.com", 0, now)           // TTL 0: floor
	if n := l.allowed(a, pol, now.Add(learnedMinTTL-time.Second)); n != "b.example.com" {
		t.Fatalf("got %q", n)
	}
	if n := l.allowed(a, pol, now.Add(learnedMinTTL+time.Second)); n != "" {
		t.Fatalf("expired entry used: %q", n)
	}
	l.add(a, "a.example.com", 24*time.Hour, now) // capped at 10 min
	if n := l.allowed(a, pol, now.Add(learnedMaxTTL+time.Second)); n != "" {
		t.Fatalf("TTL not capped: %q", n)
	}
	for i := 0; i < 3*learnedMaxAddr; i++ {
		l.add(netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)}), "a.example.com", time.Minute, now)
	}
	for i := 0; i < 3*learnedMaxName; i++ {
		l.add(a, fmt.Sprintf("n%d.example.com", i), time.Minute, now)
	}
	if len(l.m) > learnedMaxAddr || len(l.m[a]) > learnedMaxName {
		t.Fatalf("unbounded: %d addrs, %d names", len(l.m), len(l.m[a]))
	}
}

func TestDNSTCPUnknownSandboxClosed(t *testing.T) {
	up := fakeUpstream(t, dnsRecords)
	e := newEnv(t, func(c *Config) { c.Upstreams = []netip.AddrPort{up} })
	srv := e.serveDNS("127.0.0.4")
	if r, err := tryQuery(srv, "ok.example.com.", dns.TypeA, true, 0); err == nil {
		t.Fatalf("unknown sandbox answered over TCP: %v", r)
	}
	e.waitDenial("unknown-sandbox", "ok.example.com")
}

// TestOwnResolution: without Config.Lookup the proxy asks the upstreams
// (A and AAAA) itself, caches the answer, and still drops reserved ones.
func TestOwnResolution(t *testing.T) {
	var mu sync.Mutex
	queries := 0
	records := map[string][]string{"api.example.com.": {"203.0.113.10", "2001:db8::10", "127.0.0.1"}}
	h := dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		mu.Lock()
		queries++
		mu.Unlock()
		m := new(dns.Msg)
		m.SetReply(r)
		q := r.Question[0]
		for _, a := range records[q.Name] {
			ip := netip.MustParseAddr(a)
			if ip.Is4() == (q.Qtype == dns.TypeA) {
				rr, _ := dns.NewRR(fmt.Sprintf("%s 60 IN %s %s", q.Name, dns.TypeToString[q.Qtype], a))
				m.Answer = append(m.Answer, rr)
			}
		}
		w.WriteMsg(m)
	})
	up := startDNS(t, h)
	e := newEnv(t, func(c *Config) { c.Upstreams = []netip.AddrPort{up}; c.Lookup = nil })
	addr := e.listen("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"api.example.com"}}, denyAll)
	e.route("203.0.113.10:80", echoServer(t))
	for i := 0; i < 3; i++ {
		c := e.connect(addr, "203.0.113.99:80")
		roundTrip(t, c, "GET / HTTP/1.1\r\nHost: api.example.com\r\n\r\n")
	}
	// The sandbox's address (IPv4) picks the IPv4 answer, never 127.0.0.1.
	for _, d := range e.dials() {
		if d != "203.0.113.10:80" {
			t.Fatalf("dialed %s", d)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if queries != 2 {
		t.Fatalf("%d upstream queries for 3 connections, want 2 (A+AAAA, then cached)", queries)
	}
}
