package egress

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/egress/intercept"
	"github.com/spacesbx/space/internal/netpolicy"
)

var denyAll = netpolicy.Defaults{}

func TestUnknownSandboxClosed(t *testing.T) {
	e := newEnv(t, nil)
	addr := e.listen("127.0.0.9") // no sandbox registered at 127.0.0.9
	e.route("203.0.113.1:80", echoServer(t))
	c := e.connect(addr, "203.0.113.1:80")
	c.Write([]byte("hello"))
	expectClosed(t, c)
	d := e.waitDenial("unknown-sandbox", "203.0.113.1:80")
	if d.SandboxID != "" {
		t.Fatalf("denial %+v", d)
	}
	if len(e.dials()) != 0 {
		t.Fatalf("dialed %v", e.dials())
	}
	if e.counter("space_egress_connections_total", "verdict", "deny", "reason", "unknown-sandbox") != 1 {
		t.Fatal("unknown-sandbox not counted")
	}
}

func TestAllowedCIDRBothWays(t *testing.T) {
	e := newEnv(t, nil)
	addr := e.listen("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"203.0.113.0/24"}}, denyAll)
	e.route("203.0.113.7:5000", echoServer(t))
	c := e.connect(addr, "203.0.113.7:5000")
	roundTrip(t, c, "ping")
	roundTrip(t, c, strings.Repeat("x", 100000))
	if got := e.dials(); !slices.Equal(got, []string{"203.0.113.7:5000"}) {
		t.Fatalf("dials %v", got)
	}
	if e.counter("space_egress_connections_total", "verdict", "allow", "reason", "allow-cidr") != 1 {
		t.Fatal("allow not counted")
	}
	if e.counter("space_egress_active_connections") != 1 {
		t.Fatal("active gauge not 1")
	}
	// Half-close passes through: the echo server sees EOF and closes.
	c.(*net.TCPConn).CloseWrite()
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("after half-close: %d %v", n, err)
	}
	waitFor(t, func() bool { return e.counter("space_egress_active_connections") == 0 })
	if out := e.counter("space_egress_bytes_total", "direction", "out"); out != 100004 {
		t.Fatalf("bytes out %v", out)
	}
	if in := e.counter("space_egress_bytes_total", "direction", "in"); in != 100004 {
		t.Fatalf("bytes in %v", in)
	}
	if e.counter("space_egress_dial_seconds") != 1 {
		t.Fatal("dial not observed")
	}
}

func waitFor(t *testing.T, f func() bool) {
	t.Helper()
	for i := 0; i < 300; i++ {
		if f() {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("condition not reached")
}

func TestDeniedCIDRClosedAndReported(t *testing.T) {
	e := newEnv(t, nil)
	addr := e.listen("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowInternetAccess: allow(true), DenyOut: []string{"203.0.113.0/24"}}, denyAll)
	e.route("203.0.113.7:80", echoServer(t))
	c := e.connect(addr, "203.0.113.7:80")
	expectClosed(t, c)
	d := e.waitDenial("deny-cidr", "203.0.113.7:80")
	if d.SandboxID != "sb1" || d.Kind != "tcp" || d.Generation != 1 {
		t.Fatalf("denial %+v", d)
	}
	if len(e.dials()) != 0 {
		t.Fatalf("dialed %v", e.dials())
	}
}

func TestReservedDeniedUnderAllowAll(t *testing.T) {
	e := newEnv(t, func(c *Config) { c.Defaults.Denied = []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")} })
	addr := e.listen("127.0.0.2")
	all := netpolicy.Defaults{Allow: true, Denied: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}}
	e.set("127.0.0.2", "sb1", netpolicy.Spec{}, all)
	// Another sandbox's gateway at an address no range reserves.
	e.set("198.51.100.1", "sb2", netpolicy.Spec{}, all)
	echo := echoServer(t)
	for _, dst := range []string{"127.0.0.1:80", "169.254.169.254:80", "10.1.2.3:80", "198.51.100.1:80", "192.0.2.5:80", "[::1]:80"} {
		e.route(dst, echo)
		c := e.connect(addr, dst)
		expectClosed(t, c)
		e.waitDenial("reserved", dst)
	}
	if len(e.dials()) != 0 {
		t.Fatalf("dialed %v", e.dials())
	}
	// Control: an ordinary public address passes under the same policy.
	e.route("203.0.113.1:80", echo)
	roundTrip(t, e.connect(addr, "203.0.113.1:80"), "ok")
}

// tlsDial runs a TLS client for sni over c and echoes once.
func tlsEcho(t *testing.T, c net.Conn, sni string, roots *x509.CertPool, msg string) error {
	t.Helper()
	cfg := &tls.Config{ServerName: sni, RootCAs: roots}
	if sni == "" {
		cfg.InsecureSkipVerify = true // no SNI is sent
	}
	tc := tls.Client(c, cfg)
	tc.SetDeadline(time.Now().Add(3 * time.Second))
	if err := tc.Handshake(); err != nil {
		return err
	}
	if _, err := tc.Write([]byte(msg)); err != nil {
		return err
	}
	b := make([]byte, len(msg))
	if _, err := io.ReadFull(tc, b); err != nil {
		return err
	}
	if string(b) != msg {
		return fmt.Errorf("echo %q", b)
	}
	return nil
}

func TestDomainBySNIDialsOwnResolution(t *testing.T) {
	e := newEnv(t, nil)
	addr := e.listen("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"api.example.com"}}, denyAll)
	cert, roots := selfSigned(t, "api.example.com", "other.example.com")
	srv := tlsEchoServer(t, cert)
	e.name("api.example.com", "203.0.113.10")
	e.route("203.0.113.10:443", srv)
	e.route("203.0.113.66:443", srv) // the sandbox's own (wrong) choice: must not be dialed

	c := e.connect(addr, "203.0.113.66:443")
	if err := tlsEcho(t, c, "api.example.com", roots, "secret"); err != nil {
		t.Fatal(err)
	}
	if got := e.dials(); !slices.Equal(got, []string{"203.0.113.10:443"}) {
		t.Fatalf("dials %v: the proxy must dial its own resolution", got)
	}
	// A name the policy does not list is refused at the same address.
	c = e.connect(addr, "203.0.113.66:443")
	if err := tlsEcho(t, c, "other.example.com", roots, "x"); err == nil {
		t.Fatal("other.example.com passed")
	}
	e.waitDenial("no-domain-match", "203.0.113.66:443")
	// No SNI at all (an IP-literal TLS client) is decided by address: denied.
	c = e.connect(addr, "203.0.113.66:443")
	if err := tlsEcho(t, c, "", roots, "x"); err == nil {
		t.Fatal("TLS without SNI passed")
	}
	e.waitDenial("default-deny", "203.0.113.66:443")
}

func TestDomainByHTTPHost(t *testing.T) {
	e := newEnv(t, nil)
	addr := e.listen("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"api.example.com"}}, denyAll)
	srv := serveLoop(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(req.Host), req.Host)
	})
	e.name("api.example.com", "203.0.113.10")
	e.route("203.0.113.10:80", srv)

	get := func(host string) (string, error) {
		c := e.connect(addr, "203.0.113.99:80")
		c.SetDeadline(time.Now().Add(3 * time.Second))
		fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\n\r\n", host)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return "", err
		}
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	}
	if got, err := get("API.example.com:80"); err != nil || got != "API.example.com:80" {
		t.Fatalf("allowed host: %q %v", got, err)
	}
	if _, err := get("evil.example.net"); err == nil {
		t.Fatal("evil.example.net passed")
	}
	e.waitDenial("no-domain-match", "203.0.113.99:80")
}

func TestWildcardSubdomainNotApex(t *testing.T) {
	e := newEnv(t, nil)
	addr := e.listen("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"*.example.org"}}, denyAll)
	cert, roots := selfSigned(t, "a.b.example.org", "example.org")
	srv := tlsEchoServer(t, cert)
	e.name("a.b.example.org", "203.0.113.10")
	e.name("example.org", "203.0.113.10")
	e.route("203.0.113.10:443", srv)
	if err := tlsEcho(t, e.connect(addr, "203.0.113.10:443"), "a.b.example.org", roots, "sub"); err != nil {
		t.Fatalf("subdomain: %v", err)
	}
	if err := tlsEcho(t, e.connect(addr, "203.0.113.10:443"), "example.org", roots, "apex"); err == nil {
		t.Fatal("apex passed")
	}
	d := e.waitDenial("no-domain-match", "203.0.113.10:443")
	if d.Name != "example.org" {
		t.Fatalf("denial %+v", d)
	}
}

func TestRebindingDenied(t *testing.T) {
	e := newEnv(t, nil)
	addr := e.listen("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"evil.example.com"}}, denyAll)
	e.name("evil.example.com", "127.0.0.1", "169.254.169.254", "10.0.0.1", "::1")
	cert, roots := selfSigned(t, "evil.example.com")
	e.route("203.0.113.10:443", tlsEchoServer(t, cert))
	if err := tlsEcho(t, e.connect(addr, "203.0.113.10:443"), "evil.example.com", roots, "x"); err == nil {
		t.Fatal("rebinding passed")
	}
	e.waitDenial("rebinding", "203.0.113.10:443")
	if len(e.dials()) != 0 {
		t.Fatalf("dialed %v", e.dials())
	}
}

// dnsQuery sends one UDP query to server and returns the reply.
func TestDNSLearnedAllowsNonTLS(t *testing.T) {
	up := fakeUpstream(t, map[string][]string{"git.example.com.": {"203.0.113.20"}})
	e := newEnv(t, func(c *Config) { c.Upstreams = []netip.AddrPort{up} })
	addr := e.listen("127.0.0.2")
	dnsAddr := e.serveDNS("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"git.example.com"}}, denyAll)
	e.route("203.0.113.20:22", echoServer(t))
	e.route("203.0.113.20:80", echoServer(t))

	// Before the sandbox resolved the name, the address is just denied.
	c := e.connect(addr, "203.0.113.20:22")
	c.Write([]byte("SSH-2.0-test\r\n"))
	expectClosed(t, c)
	e.waitDenial("default-deny", "203.0.113.20:22")

	r := query(t, dnsAddr, "git.example.com.", dnsTypeA, false)
	if got := answers(r); !slices.Equal(got, []string{"203.0.113.20"}) {
		t.Fatalf("answers %v", got)
	}
	c = e.connect(addr, "203.0.113.20:22")
	roundTrip(t, c, "SSH-2.0-test\r\n")
	if e.counter("space_egress_connections_total", "verdict", "allow", "reason", "dns-learned") != 1 {
		t.Fatal("dns-learned not counted")
	}
	// Plain HTTP to the learned address for another host: no.
	c = e.connect(addr, "203.0.113.20:80")
	c.Write([]byte("GET / HTTP/1.1\r\nHost: other.example.net\r\n\r\n"))
	expectClosed(t, c)
	e.waitDenial("host-mismatch", "203.0.113.20:80")
	// TLS to the learned address with another server name (domain
	// fronting): no.
	e.route("203.0.113.20:443", echoServer(t))
	c = e.connect(addr, "203.0.113.20:443")
	c.Write(clientHello(t, "other.example.net"))
	expectClosed(t, c)
	e.waitDenial("host-mismatch", "203.0.113.20:443")
	// Plain HTTP naming the address itself is the address: allowed.
	c = e.connect(addr, "203.0.113.20:80")
	roundTrip(t, c, "GET / HTTP/1.1\r\nHost: 203.0.113.20\r\n\r\n")
	// Another sandbox did not learn it.
	addr3 := e.listen("127.0.0.3")
	e.set("127.0.0.3", "sb3", netpolicy.Spec{AllowOut: []string{"git.example.com"}}, denyAll)
	c = e.connect(addr3, "203.0.113.20:22")
	c.Write([]byte("SSH-2.0-test\r\n"))
	expectClosed(t, c)
}

func TestSetCutsDeniedKeepsAllowed(t *testing.T) {
	e := newEnv(t, nil)
	addr := e.listen("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"203.0.113.10", "203.0.113.11"}}, denyAll)
	echo := echoServer(t)
	e.route("203.0.113.10:80", echo)
	e.route("203.0.113.11:80", echo)
	keep := e.connect(addr, "203.0.113.10:80")
	cut := e.connect(addr, "203.0.113.11:80")
	roundTrip(t, keep, "a")
	roundTrip(t, cut, "b")

	pol, err := netpolicy.Compile(netpolicy.Spec{AllowOut: []string{"203.0.113.10"}}, denyAll)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.p.Set(netip.MustParseAddr("127.0.0.2"), Sandbox{ID: "sb1", Generation: 2, Policy: pol}); err != nil {
		t.Fatal(err)
	}
	// Closed before Set returned: the read sees the end at once.
	cut.SetReadDeadline(time.Now().Add(time.Second))
	if n, err := cut.Read(make([]byte, 1)); n != 0 || err == nil || isTimeout(err) {
		t.Fatalf("denied connection survived Set: %d %v", n, err)
	}
	roundTrip(t, keep, "still here")
	// New connections follow the new policy.
	expectClosed(t, e.connect(addr, "203.0.113.11:80"))

	// Remove closes the rest.
	e.p.Remove(netip.MustParseAddr("127.0.0.2"))
	keep.SetReadDeadline(time.Now().Add(time.Second))
	if n, err := keep.Read(make([]byte, 1)); n != 0 || err == nil || isTimeout(err) {
		t.Fatalf("connection survived Remove: %d %v", n, err)
	}
	expectClosed(t, e.connect(addr, "203.0.113.10:80"))
	e.waitDenial("unknown-sandbox", "203.0.113.10:80")
}

func TestSetReplacingSandboxCutsAll(t *testing.T) {
	e := newEnv(t, nil)
	addr := e.listen("127.0.0.2")
	all := netpolicy.Defaults{Allow: true}
	e.set("127.0.0.2", "sb1", netpolicy.Spec{}, all)
	e.route("203.0.113.10:80", echoServer(t))
	c := e.connect(addr, "203.0.113.10:80")
	roundTrip(t, c, "a")
	e.set("127.0.0.2", "sb-new", netpolicy.Spec{}, all)
	c.SetReadDeadline(time.Now().Add(time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil || isTimeout(err) {
		t.Fatalf("old sandbox's connection survived: %d %v", n, err)
	}
}

func TestSOCKS5Chain(t *testing.T) {
	e := newEnv(t, nil)
	addr := e.listen("127.0.0.2")
	e.route("203.0.113.10:80", echoServer(t))
	gotDest := make(chan string, 4)
	socks := serveLoop(t, func(c net.Conn) {
		dest, err := socksAccept(c)
		if err != nil {
			return
		}
		gotDest <- dest
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		u, err := e.p.cfg.Dial(ctx, "tcp", dest) // through the test's route table
		cancel()
		if err != nil {
			return
		}
		defer u.Close()
		c.Write([]byte{5, 0, 0, 1, 0, 0, 0, 0, 0, 0})
		done := make(chan struct{})
		go func() { io.Copy(u, c); u.Close(); close(done) }()
		io.Copy(c, u)
		c.Close()
		<-done
	})
	e.route("203.0.113.99:1080", socks)
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"203.0.113.10"},
		EgressProxy: &netpolicy.EgressProxy{Address: "203.0.113.99:1080", Username: "u", Password: "p"}}, denyAll)
	roundTrip(t, e.connect(addr, "203.0.113.10:80"), "via socks")
	if d := <-gotDest; d != "203.0.113.10:80" {
		t.Fatalf("socks destination %v", d)
	}

	// A proxy at a reserved address is refused, not dialed.
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"203.0.113.10"},
		EgressProxy: &netpolicy.EgressProxy{Address: "127.0.0.1:1080"}}, denyAll)
	n := len(e.dials())
	expectClosed(t, e.connect(addr, "203.0.113.10:80"))
	e.waitDenial("reserved-proxy", "203.0.113.10:80")
	if len(e.dials()) != n {
		t.Fatalf("dialed %v", e.dials()[n:])
	}
}

// socksAccept is a minimal SOCKS5 server handshake (user/pass "u"/"p").
func socksAccept(c net.Conn) (string, error) {
	c.SetDeadline(time.Now().Add(3 * time.Second))
	defer c.SetDeadline(time.Time{})
	h := make([]byte, 2)
	if _, err := io.ReadFull(c, h); err != nil {
		return "", err
	}
	methods := make([]byte, h[1])
	io.ReadFull(c, methods)
	c.Write([]byte{5, 2})
	io.ReadFull(c, h)
	user := make([]byte, h[1])
	io.ReadFull(c, user)
	pl := make([]byte, 1)
	io.ReadFull(c, pl)
	pass := make([]byte, pl[0])
	io.ReadFull(c, pass)
	if string(user) != "u" || string(pass) != "p" {
		c.Write([]byte{1, 1})
		return "", fmt.Errorf("bad auth")
	}
	c.Write([]byte{1, 0})
	req := make([]byte, 4)
	if _, err := io.ReadFull(c, req); err != nil || req[3] != 1 {
		return "", fmt.Errorf("bad request")
	}
	a := make([]byte, 6)
	io.ReadFull(c, a)
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte(a[:4])), binary.BigEndian.Uint16(a[4:])).String(), nil
}

func TestInterceptInjectsHeaders(t *testing.T) {
	upCert, upRoots := selfSigned(t, "api.example.com")
	e := newEnv(t, func(c *Config) { c.RootCAs = upRoots })
	addr := e.listen("127.0.0.2")
	gotHeader := make(chan string, 1)
	srv := serveLoop(t, func(c net.Conn) {
		tc := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{upCert}, NextProtos: []string{"http/1.1"}})
		br := bufio.NewReader(tc)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			gotHeader <- req.Header.Get("X-Token")
			io.WriteString(tc, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	e.name("api.example.com", "203.0.113.10")
	e.route("203.0.113.10:443", srv)
	caPEM, keyPEM, err := intercept.NewCA("sb1")
	if err != nil {
		t.Fatal(err)
	}
	pol, err := netpolicy.Compile(netpolicy.Spec{AllowOut: []string{"api.example.com"},
		Rules: map[string][]netpolicy.Rule{"api.example.com": {{Transform: &netpolicy.Transform{Headers: map[string]string{"X-Token": "s3cret"}}}}}}, denyAll)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.p.Set(netip.MustParseAddr("127.0.0.2"), Sandbox{ID: "sb1", Policy: pol, CACertPEM: caPEM, CAKeyPEM: keyPEM}); err != nil {
		t.Fatal(err)
	}
	sbRoots := x509.NewCertPool()
	sbRoots.AppendCertsFromPEM(caPEM)
	c := e.connect(addr, "203.0.113.10:443")
	tc := tls.Client(c, &tls.Config{ServerName: "api.example.com", RootCAs: sbRoots})
	tc.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(tc, "GET / HTTP/1.1\r\nHost: api.example.com\r\nX-Token: mine\r\n\r\n")
	br := bufio.NewReader(tc)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("through interception: %v", err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if h := <-gotHeader; h != "s3cret" {
		t.Fatalf("upstream saw X-Token %q", h)
	}
	// The same transform recompiled keeps the intercepted connection...
	set := func(headers map[string]string, ca bool) {
		t.Helper()
		pol, err := netpolicy.Compile(netpolicy.Spec{AllowOut: []string{"api.example.com"},
			Rules: map[string][]netpolicy.Rule{"api.example.com": {{Transform: &netpolicy.Transform{Headers: headers}}}}}, denyAll)
		if err != nil {
			t.Fatal(err)
		}
		sb := Sandbox{ID: "sb1", Policy: pol}
		if ca {
			sb.CACertPEM, sb.CAKeyPEM = caPEM, keyPEM
		}
		if err := e.p.Set(netip.MustParseAddr("127.0.0.2"), sb); err != nil {
			t.Fatal(err)
		}
	}
	set(map[string]string{"x-token": "s3cret"}, true)
	io.WriteString(tc, "GET / HTTP/1.1\r\nHost: api.example.com\r\n\r\n")
	if resp, err = http.ReadResponse(br, nil); err != nil {
		t.Fatalf("second request after an unchanged Set: %v", err)
	}
	io.Copy(io.Discard, resp.Body)
	<-gotHeader
	// ...another header value cuts it (the secret changed).
	set(map[string]string{"x-token": "rotated"}, true)
	tc.SetDeadline(time.Now().Add(time.Second))
	if _, err := tc.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("intercepted connection survived a header change: %v", err)
	}
	// Without a CA the same policy passes TLS through untouched: the client
	// then sees the origin's certificate.
	if err := e.p.Set(netip.MustParseAddr("127.0.0.2"), Sandbox{ID: "sb1", Policy: pol}); err != nil {
		t.Fatal(err)
	}
	c = e.connect(addr, "203.0.113.10:443")
	tc = tls.Client(c, &tls.Config{ServerName: "api.example.com", RootCAs: upRoots})
	tc.SetDeadline(time.Now().Add(5 * time.Second))
	if err := tc.Handshake(); err != nil {
		t.Fatalf("pass-through: %v", err)
	}
	io.WriteString(tc, "GET / HTTP/1.1\r\nHost: api.example.com\r\nX-Token: mine\r\n\r\n")
	if h := <-gotHeader; h != "mine" {
		t.Fatalf("pass-through changed the header: %q", h)
	}
}

func TestPlainTCPFastPathDoesNotPeek(t *testing.T) {
	// A server-speaks-first protocol under a CIDR-only policy: no peek wait.
	e := newEnv(t, func(c *Config) { c.PeekTimeout = 10 * time.Second })
	addr := e.listen("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"203.0.113.0/24"}}, denyAll)
	e.route("203.0.113.5:25", serveLoop(t, func(c net.Conn) { io.WriteString(c, "220 hello\r\n"); io.Copy(io.Discard, c) }))
	c := e.connect(addr, "203.0.113.5:25")
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	b := make([]byte, 11)
	if _, err := io.ReadFull(c, b); err != nil || string(b) != "220 hello\r\n" {
		t.Fatalf("banner %q %v", b, err)
	}
}

func TestSetValidation(t *testing.T) {
	e := newEnv(t, nil)
	pol, _ := netpolicy.Compile(netpolicy.Spec{}, denyAll)
	for _, tc := range []struct {
		gw netip.Addr
		sb Sandbox
	}{
		{netip.Addr{}, Sandbox{ID: "a", Policy: pol}},
		{netip.MustParseAddr("127.0.0.2"), Sandbox{Policy: pol}},
		{netip.MustParseAddr("127.0.0.2"), Sandbox{ID: "a"}},
		{netip.MustParseAddr("127.0.0.2"), Sandbox{ID: "a", Policy: pol, CACertPEM: []byte("junk"), CAKeyPEM: []byte("junk")}},
	} {
		if err := e.p.Set(tc.gw, tc.sb); err == nil {
			t.Errorf("Set(%v, %+v) accepted", tc.gw, tc.sb)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []Config{
		{DialTimeout: -1},
		{Upstreams: []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:0")}},
		{Upstreams: []netip.AddrPort{{}}},
		{Defaults: netpolicy.Defaults{Denied: []netip.Prefix{{}}}},
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
	if _, err := New(Config{ResolvConfPath: t.TempDir() + "/missing"}); err == nil {
		t.Error("New without any resolver accepted")
	}
}

func TestCloseEndsEverything(t *testing.T) {
	e := newEnv(t, nil)
	addr := e.listen("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"203.0.113.0/24"}}, denyAll)
	e.route("203.0.113.7:80", echoServer(t))
	c := e.connect(addr, "203.0.113.7:80")
	roundTrip(t, c, "x")
	pol, _ := netpolicy.Compile(netpolicy.Spec{}, denyAll)
	done := make(chan struct{})
	go func() { e.p.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung")
	}
	c.SetReadDeadline(time.Now().Add(time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil || isTimeout(err) {
		t.Fatalf("connection survived Close: %d %v", n, err)
	}
	if err := e.p.Set(netip.MustParseAddr("127.0.0.2"), Sandbox{ID: "x", Policy: pol}); err == nil {
		t.Fatal("Set after Close accepted")
	}
}

func TestIdleTimeoutCuts(t *testing.T) {
	e := newEnv(t, func(c *Config) { c.IdleTimeout = 200 * time.Millisecond })
	addr := e.listen("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"203.0.113.0/24"}}, denyAll)
	e.route("203.0.113.7:80", echoServer(t))
	c := e.connect(addr, "203.0.113.7:80")
	// Traffic in one direction only keeps the connection: the echo keeps
	// both busy here, for longer than the timeout in total.
	for i := 0; i < 6; i++ {
		roundTrip(t, c, "tick")
		time.Sleep(80 * time.Millisecond)
	}
	start := time.Now()
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil || isTimeout(err) {
		t.Fatalf("idle connection not cut: %d %v", n, err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("cut after %v", d)
	}
}

// TestSetDuringDecision: a connection whose decision was taken under the
// old policy while Set installed a new one is checked against the new one.
func TestSetDuringDecision(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	e := newEnv(t, func(c *Config) {
		c.Lookup = func(ctx context.Context, name string) ([]netip.Addr, error) {
			entered <- struct{}{}
			<-release
			return []netip.Addr{netip.MustParseAddr("203.0.113.10")}, nil
		}
	})
	addr := e.listen("127.0.0.2")
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"api.example.com"}}, denyAll)
	e.route("203.0.113.10:80", echoServer(t))
	c := e.connect(addr, "203.0.113.10:80")
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: api.example.com\r\n\r\n")
	<-entered
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"other.example.com"}}, denyAll)
	close(release)
	expectClosed(t, c)
	e.waitDenial("policy-changed", "203.0.113.10:80")
	if len(e.dials()) != 0 {
		t.Fatalf("dialed %v", e.dials())
	}
}

func TestServeTCPContextEndsConnections(t *testing.T) {
	e := newEnv(t, nil)
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.p.ServeTCP(ctx, ln, e.orig) }()
	e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"203.0.113.0/24"}}, denyAll)
	e.route("203.0.113.7:80", echoServer(t))
	c := e.connect(ln.Addr().String(), "203.0.113.7:80")
	roundTrip(t, c, "x")
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil || isTimeout(err) {
		t.Fatalf("connection survived ServeTCP's end: %d %v", n, err)
	}
	if _, err := net.Dial("tcp", ln.Addr().String()); err == nil {
		t.Fatal("listener still open")
	}
}
