package netsim

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/testenv"
)

var (
	helperProcess = flag.Bool("netsim.helper", false, "run as a helper process of TestConcurrentProcesses")
	unprivHelper  = flag.Bool("netsim.unprivileged", false, "run as the unprivileged helper of TestUnprivileged")
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func needRoot(t testing.TB) {
	t.Helper()
	testenv.RequireRoot(t, "network namespaces, veths, routes")
}

func start(t testing.TB, opts Options) *Internet {
	t.Helper()
	needRoot(t)
	t0 := time.Now()
	n, err := Start(opts)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Logf("Start took %v: %s on %s", time.Since(t0), n.Prefix(), n.LinkName())
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return n
}

// httpClient trusts only n's CA and dials every name at addr (when valid).
func httpClient(t testing.TB, n *Internet, addr netip.Addr) *http.Client {
	t.Helper()
	tr := &http.Transport{
		TLSClientConfig:   &tls.Config{RootCAs: n.CAPool()},
		ForceAttemptHTTP2: true,
	}
	if addr.IsValid() {
		d := &net.Dialer{}
		tr.DialContext = func(ctx context.Context, network, a string) (net.Conn, error) {
			_, port, _ := net.SplitHostPort(a)
			return d.DialContext(ctx, network, net.JoinHostPort(addr.String(), port))
		}
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

func get(t testing.TB, c *http.Client, url string) (*http.Response, []byte) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: body: %v", url, err)
	}
	return resp, b
}

func dialTCP(t testing.TB, ap netip.AddrPort) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", ap.String(), 5*time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", ap, err)
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return c
}

func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestServicesOnEveryHost(t *testing.T) {
	n := start(t, Options{Zone: map[string][]netip.Addr{"Static.TEST.": {netip.MustParseAddr("192.0.2.200")}}})
	if got := len(n.Hosts()); got != DefaultHosts {
		t.Fatalf("hosts = %d, want %d", got, DefaultHosts)
	}
	if !n.Prefix().Contains(n.DNS().Addr()) || !n.Prefix().Contains(n.RootAddr()) || !simRange.Contains(n.Prefix().Addr()) {
		t.Fatalf("addresses outside the prefix: prefix %s dns %s root %s", n.Prefix(), n.DNS(), n.RootAddr())
	}
	plain := httpClient(t, n, netip.Addr{})
	for i, h := range n.Hosts() {
		if n.Host(i) != h {
			t.Fatalf("Host(%d) = %s, Hosts()[%d] = %s", i, n.Host(i), i, h)
		}
		t.Run(h.String(), func(t *testing.T) {
			// HTTP :80
			resp, body := get(t, plain, "http://"+h.String()+"/")
			if resp.StatusCode != 200 || string(body) != "hello from "+h.String() {
				t.Fatalf("GET / = %d %q", resp.StatusCode, body)
			}

			// HTTPS :443 by address (IP SAN) and by a name added after Start
			// (its own certificate, HTTP/2).
			_, body = get(t, plain, "https://"+h.String()+"/echo?x=1")
			var er EchoReply
			if err := json.Unmarshal(body, &er); err != nil {
				t.Fatalf("echo: %v: %q", err, body)
			}
			if er.Scheme != "https" || er.Host != h.String() || er.Path != "/echo" || er.RawQuery != "x=1" ||
				er.Local != netip.AddrPortFrom(h, 443).String() || er.Method != "GET" {
				t.Fatalf("echo = %+v", er)
			}
			name := fmt.Sprintf("h%d.example.test", i)
			if err := n.SetZone(name, h); err != nil {
				t.Fatal(err)
			}
			byName := httpClient(t, n, h)
			resp, body = get(t, byName, "https://"+name+"/echo")
			if err := json.Unmarshal(body, &er); err != nil {
				t.Fatalf("echo: %v: %q", err, body)
			}
			if er.SNI != name || er.Host != name || resp.Proto != "HTTP/2.0" || er.Proto != "HTTP/2.0" {
				t.Fatalf("echo by name = %+v (client proto %s)", er, resp.Proto)
			}

			// echo :7
			c := dialTCP(t, netip.AddrPortFrom(h, PortEcho))
			msg := []byte("ping " + h.String())
			if _, err := c.Write(msg); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, len(msg))
			if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
				t.Fatalf("echo read %q, %v", got, err)
			}
			c.Close()

			// discard :9 counts what it reads
			before := n.Discarded()
			c = dialTCP(t, netip.AddrPortFrom(h, PortDiscard))
			if _, err := c.Write(make([]byte, 100_000)); err != nil {
				t.Fatal(err)
			}
			c.Close()
			eventually(t, "discard to count 100000 bytes", func() bool { return n.Discarded() == before+100_000 })

			// chargen :19 writes until closed
			c = dialTCP(t, netip.AddrPortFrom(h, PortChargen))
			if k, err := io.CopyN(io.Discard, c, 1<<20); err != nil || k != 1<<20 {
				t.Fatalf("chargen read %d: %v", k, err)
			}
			c.Close()

			// DNS :53 over UDP and TCP on the host too
			for _, netw := range []string{"udp", "tcp"} {
				r := dnsExchange(t, netw, netip.AddrPortFrom(h, PortDNS), name+".", dns.TypeA)
				if r.Rcode != dns.RcodeSuccess || strings.Join(answers(r), ",") != h.String() {
					t.Fatalf("dns %s on %s: %v", netw, h, r)
				}
				qs := n.Queries()
				if q := qs[len(qs)-1]; q.Server != netip.AddrPortFrom(h, PortDNS) || q.Net != netw || q.Name != name {
					t.Fatalf("query %+v", q)
				}
			}
		})
	}
	if got := n.Accepted(PortDNS); got != DefaultHosts {
		t.Errorf("Accepted(53) = %d, want %d", got, DefaultHosts)
	}
	for _, port := range []int{PortEcho, PortDiscard, PortChargen} {
		if got := n.Accepted(port); got != DefaultHosts {
			t.Errorf("Accepted(%d) = %d, want %d", port, got, DefaultHosts)
		}
	}
	if n.Accepted(PortHTTP) < DefaultHosts || n.Accepted(PortHTTPS) < DefaultHosts {
		t.Errorf("Accepted(80) = %d, Accepted(443) = %d", n.Accepted(PortHTTP), n.Accepted(PortHTTPS))
	}
	reqs := n.Requests()
	if len(reqs) != 3*DefaultHosts {
		t.Fatalf("%d requests recorded, want %d: %+v", len(reqs), 3*DefaultHosts, reqs)
	}
	for _, r := range reqs {
		if r.RemoteAddr.Addr() != n.RootAddr() || !n.Prefix().Contains(r.LocalAddr.Addr()) || r.Method != "GET" {
			t.Errorf("request %+v: want from %s to the prefix", r, n.RootAddr())
		}
		if r.Scheme == "https" && r.LocalAddr.Port() != 443 || r.Scheme == "http" && r.LocalAddr.Port() != 80 {
			t.Errorf("request %+v: scheme and port disagree", r)
		}
	}
	if r := reqs[2]; r.SNI != "h0.example.test" || r.Host != "h0.example.test" || r.Proto != "HTTP/2.0" ||
		r.Header.Get("Accept-Encoding") != "gzip" {
		t.Errorf("request by name = %+v", r)
	}
	n.ResetRequests()
	if got := n.Requests(); len(got) != 0 {
		t.Fatalf("after ResetRequests: %d requests", len(got))
	}
}

func TestTLSRejects(t *testing.T) {
	n := start(t, Options{Hosts: 1, Zone: map[string][]netip.Addr{"known.test": nil}})
	h := n.Host(0)
	// A name not in the zone gets the address certificate: a mismatch.
	if _, err := httpClient(t, n, h).Get("https://unknown.test/"); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("unknown name: err = %v, want a certificate error", err)
	}
	// A client that does not trust the internet's CA refuses it.
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: nil}}
	defer tr.CloseIdleConnections()
	var uae x509.UnknownAuthorityError
	if _, err := (&http.Client{Transport: tr}).Get("https://" + h.String() + "/"); !errors.As(err, &uae) {
		t.Fatalf("untrusted CA: err = %v, want x509.UnknownAuthorityError", err)
	}
	// A name removed from the zone stops getting its certificate.
	if err := n.SetZone("gone.test", h); err != nil {
		t.Fatal(err)
	}
	if _, b := get(t, httpClient(t, n, h), "https://gone.test/"); string(b) != "hello from "+h.String() {
		t.Fatalf("gone.test before removal: %q", b)
	}
	if err := n.SetZone("gone.test"); err != nil {
		t.Fatal(err)
	}
	if _, err := httpClient(t, n, h).Get("https://gone.test/"); err == nil {
		t.Fatal("gone.test after removal: no error")
	}
	// The CA PEM is the pool's CA.
	if !bytes.Contains(n.CAPEM(), []byte("BEGIN CERTIFICATE")) {
		t.Fatalf("CAPEM = %q", n.CAPEM())
	}
}

func TestHTTPHandlers(t *testing.T) {
	n := start(t, Options{Hosts: 1})
	h := n.Host(0)
	c := httpClient(t, n, netip.Addr{})
	base := "http://" + h.String()

	// /bytes?n=N answers exactly N bytes; bad N is refused.
	resp, body := get(t, c, base+"/bytes?n=1000003")
	if resp.StatusCode != 200 || len(body) != 1000003 || resp.ContentLength != 1000003 {
		t.Fatalf("/bytes: %d, %d bytes, length %d", resp.StatusCode, len(body), resp.ContentLength)
	}
	for _, bad := range []string{"-1", "x", "", "1099511627777"} {
		if resp, _ := get(t, c, base+"/bytes?n="+bad); resp.StatusCode != http.StatusBadRequest {
			t.Errorf("/bytes?n=%s: %d, want 400", bad, resp.StatusCode)
		}
	}

	// /echo reflects the request.
	req, _ := http.NewRequest("POST", base+"/echo", strings.NewReader("twelve bytes"))
	req.Host = "virtual.test"
	req.Header.Set("X-Probe", "42")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var er EchoReply
	err = json.NewDecoder(resp.Body).Decode(&er)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if er.Method != "POST" || er.Host != "virtual.test" || er.Headers.Get("X-Probe") != "42" || er.BodyBytes != 12 ||
		er.Scheme != "http" || er.Remote == "" {
		t.Fatalf("echo = %+v", er)
	}

	// /hold streams until the client goes away, and then its handler ends.
	ctx, cancel := context.WithCancel(context.Background())
	req, _ = http.NewRequestWithContext(ctx, "GET", base+"/hold", nil)
	t0 := time.Now()
	resp, err = c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	for i := range 3 {
		if _, err := io.ReadFull(resp.Body, buf); err != nil {
			t.Fatalf("hold byte %d: %v", i, err)
		}
	}
	if d := time.Since(t0); d < 2*HoldInterval-20*time.Millisecond {
		t.Fatalf("3 hold bytes in %v: not paced", d)
	}
	eventually(t, "hold handler to run", func() bool { return handlersRunning(n) == 1 })
	cancel()
	resp.Body.Close()
	eventually(t, "hold handler to end", func() bool { return handlersRunning(n) == 0 })

	paths := []string{}
	for _, r := range n.Requests() {
		paths = append(paths, r.Method+" "+r.Path)
	}
	if want := "GET /bytes,GET /bytes,GET /bytes,GET /bytes,GET /bytes,POST /echo,GET /hold"; strings.Join(paths, ",") != want {
		t.Fatalf("requests %v, want %s", paths, want)
	}
}

func handlersRunning(n *Internet) int {
	n.handlers.mu.Lock()
	defer n.handlers.mu.Unlock()
	return n.handlers.n
}

func dnsExchange(t testing.TB, netw string, server netip.AddrPort, name string, qtype uint16) *dns.Msg {
	t.Helper()
	m := new(dns.Msg)
	m.SetQuestion(name, qtype)
	c := &dns.Client{Net: netw, Timeout: 5 * time.Second}
	r, _, err := c.Exchange(m, server.String())
	if err != nil {
		t.Fatalf("dns %s %s %s: %v", netw, name, dns.TypeToString[qtype], err)
	}
	return r
}

func answers(r *dns.Msg) []string {
	var out []string
	for _, rr := range r.Answer {
		switch rr := rr.(type) {
		case *dns.A:
			out = append(out, rr.A.String())
		case *dns.AAAA:
			out = append(out, rr.AAAA.String())
		}
	}
	return out
}

func TestDNS(t *testing.T) {
	v4, v6 := netip.MustParseAddr("192.0.2.7"), netip.MustParseAddr("2001:db8::7")
	n := start(t, Options{Zone: map[string][]netip.Addr{
		"dual.test":    {v4, v6, netip.MustParseAddr("::ffff:192.0.2.8")},
		"only6.test.":  {v6},
		"rebind.test":  {netip.MustParseAddr("192.0.2.9")},
		"Upper.Test":   {v4},
		"empty.test":   {},
		"metadata.gcp": {netip.MustParseAddr("169.254.169.254")},
	}})
	srv := n.DNS()
	if srv.Addr() != addrIn(n.Prefix(), 53) || srv.Port() != 53 {
		t.Fatalf("DNS() = %s", srv)
	}
	r := dnsExchange(t, "udp", srv, "dual.test.", dns.TypeA)
	if r.Rcode != dns.RcodeSuccess || !r.Authoritative || strings.Join(answers(r), ",") != "192.0.2.7,192.0.2.8" {
		t.Fatalf("dual A: %v", r)
	}
	if r.Answer[0].Header().Ttl != zoneTTL {
		t.Fatalf("ttl %d", r.Answer[0].Header().Ttl)
	}
	r = dnsExchange(t, "tcp", srv, "DUAL.test.", dns.TypeAAAA)
	if r.Rcode != dns.RcodeSuccess || strings.Join(answers(r), ",") != "2001:db8::7" || r.Answer[0].Header().Name != "DUAL.test." {
		t.Fatalf("dual AAAA over tcp: %v", r)
	}
	if n.Accepted(PortDNS) != 1 {
		t.Fatalf("Accepted(53) = %d after one TCP query", n.Accepted(PortDNS))
	}
	r = dnsExchange(t, "udp", srv, "only6.test.", dns.TypeA)
	if r.Rcode != dns.RcodeSuccess || len(r.Answer) != 0 {
		t.Fatalf("only6 A (want NODATA): %v", r)
	}
	r = dnsExchange(t, "udp", srv, "upper.test.", dns.TypeA)
	if strings.Join(answers(r), ",") != "192.0.2.7" {
		t.Fatalf("upper.test: %v", r)
	}
	r = dnsExchange(t, "udp", srv, "metadata.gcp.", dns.TypeA)
	if strings.Join(answers(r), ",") != "169.254.169.254" {
		t.Fatalf("metadata.gcp: %v", r)
	}
	for _, name := range []string{"nowhere.test.", "empty.test.", "test.", "sub.dual.test."} {
		if r := dnsExchange(t, "udp", srv, name, dns.TypeA); r.Rcode != dns.RcodeNameError || len(r.Answer) != 0 {
			t.Fatalf("%s: want NXDOMAIN, got %v", name, r)
		}
	}

	// Rebinding: the answer changes when the test says so.
	if err := n.SetZone("rebind.test", netip.MustParseAddr("127.0.0.1")); err != nil {
		t.Fatal(err)
	}
	if r := dnsExchange(t, "udp", srv, "rebind.test.", dns.TypeA); strings.Join(answers(r), ",") != "127.0.0.1" {
		t.Fatalf("rebind after SetZone: %v", r)
	}
	if err := n.SetZone("rebind.test"); err != nil {
		t.Fatal(err)
	}
	if r := dnsExchange(t, "udp", srv, "rebind.test.", dns.TypeA); r.Rcode != dns.RcodeNameError {
		t.Fatalf("rebind after removal: %v", r)
	}

	// Not a query: not implemented; two questions: format error.
	m := new(dns.Msg)
	m.SetNotify("dual.test.")
	if r, _, err := (&dns.Client{Timeout: 5 * time.Second}).Exchange(m, srv.String()); err != nil || r.Rcode != dns.RcodeNotImplemented {
		t.Fatalf("notify: %v, %v", r, err)
	}

	qs := n.Queries()
	want := []Query{
		{Name: "dual.test", Type: "A", Net: "udp"},
		{Name: "dual.test", Type: "AAAA", Net: "tcp"},
		{Name: "only6.test", Type: "A", Net: "udp"},
		{Name: "upper.test", Type: "A", Net: "udp"},
		{Name: "metadata.gcp", Type: "A", Net: "udp"},
	}
	if len(qs) < len(want) {
		t.Fatalf("queries %+v", qs)
	}
	for i, w := range want {
		q := qs[i]
		if q.Name != w.Name || q.Type != w.Type || q.Net != w.Net || q.Remote.Addr() != n.RootAddr() || q.Remote.Port() == 0 ||
			q.Server != srv {
			t.Errorf("query %d = %+v, want %+v from %s", i, q, w, n.RootAddr())
		}
	}
	n.ResetQueries()
	if len(n.Queries()) != 0 {
		t.Fatal("ResetQueries kept queries")
	}
}

func TestTwoInternets(t *testing.T) {
	a := start(t, Options{Hosts: 1, Zone: map[string][]netip.Addr{"a.test": {netip.MustParseAddr("192.0.2.1")}}})
	b := start(t, Options{Hosts: 2, Zone: map[string][]netip.Addr{"b.test": {netip.MustParseAddr("192.0.2.2")}}})
	if a.Prefix() == b.Prefix() || a.Prefix().Overlaps(b.Prefix()) || a.LinkName() == b.LinkName() {
		t.Fatalf("same network: %s %s, %s %s", a.Prefix(), a.LinkName(), b.Prefix(), b.LinkName())
	}
	c := httpClient(t, a, netip.Addr{})
	for _, h := range []netip.Addr{a.Host(0), b.Host(0), b.Host(1)} {
		if _, body := get(t, c, "http://"+h.String()+"/"); string(body) != "hello from "+h.String() {
			t.Fatalf("%s: %q", h, body)
		}
	}
	if len(a.Requests()) != 1 || len(b.Requests()) != 2 {
		t.Fatalf("requests: a %d, b %d", len(a.Requests()), len(b.Requests()))
	}
	if r := dnsExchange(t, "udp", a.DNS(), "b.test.", dns.TypeA); r.Rcode != dns.RcodeNameError {
		t.Fatalf("a answers b's zone: %v", r)
	}
	if r := dnsExchange(t, "udp", b.DNS(), "b.test.", dns.TypeA); strings.Join(answers(r), ",") != "192.0.2.2" {
		t.Fatalf("b.test: %v", r)
	}
}

// TestConcurrentStarts starts several Internets at once in this process.
func TestConcurrentStarts(t *testing.T) {
	needRoot(t)
	const k = 6
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		nets []*Internet
		errs []error
	)
	for range k {
		wg.Go(func() {
			t0 := time.Now()
			n, err := Start(Options{Hosts: 1})
			d := time.Since(t0)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			t.Logf("Start %v: %s", d, n.Prefix())
			nets = append(nets, n)
		})
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, n := range nets {
			if err := n.Close(); err != nil {
				t.Error(err)
			}
		}
	})
	if len(errs) > 0 {
		t.Fatal(errors.Join(errs...))
	}
	seen := map[netip.Prefix]bool{}
	c := httpClient(t, nets[0], netip.Addr{})
	for _, n := range nets {
		if seen[n.Prefix()] {
			t.Fatalf("prefix %s twice", n.Prefix())
		}
		seen[n.Prefix()] = true
		if _, body := get(t, c, "http://"+n.Host(0).String()+"/"); string(body) != "hello from "+n.Host(0).String() {
			t.Fatalf("%s: %q", n.Host(0), body)
		}
	}
}

// TestConcurrentProcesses runs Start/serve/Close in several processes at
// once, as go test does with packages that use netsim.
func TestConcurrentProcesses(t *testing.T) {
	needRoot(t)
	if *helperProcess {
		return // this process is one of the helpers (TestHelperProcess)
	}
	const procs = 3
	var wg sync.WaitGroup
	outs := make([][]byte, procs)
	errs := make([]error, procs)
	for i := range procs {
		wg.Go(func() {
			cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1", "-netsim.helper")
			outs[i], errs[i] = cmd.CombinedOutput()
		})
	}
	wg.Wait()
	for i := range procs {
		if errs[i] != nil || !bytes.Contains(outs[i], []byte("helper ok")) {
			t.Errorf("helper %d: %v\n%s", i, errs[i], outs[i])
		}
	}
}

func TestHelperProcess(t *testing.T) {
	if !*helperProcess {
		return // only as a helper process of TestConcurrentProcesses
	}
	for round := range 4 {
		n, err := Start(Options{Hosts: 2})
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		c := httpClient(t, n, netip.Addr{})
		for _, h := range n.Hosts() {
			if _, body := get(t, c, "http://"+h.String()+"/"); string(body) != "hello from "+h.String() {
				t.Fatalf("%s: %q", h, body)
			}
		}
		c.CloseIdleConnections()
		if err := n.Close(); err != nil {
			t.Fatal(err)
		}
	}
	fmt.Println("helper ok")
}

// nsInode returns the inode of the namespace n holds.
func nsInode(t testing.TB, n *Internet) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(int(n.nsFile.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// holdsNamespace reports whether any descriptor or thread of this process
// refers to the network namespace of inode ino.
func holdsNamespace(t testing.TB, ino uint64) []string {
	t.Helper()
	want := fmt.Sprintf("net:[%d]", ino)
	var found []string
	for _, glob := range []string{"/proc/self/fd/*", "/proc/self/task/*/ns/net"} {
		paths, _ := filepath.Glob(glob)
		for _, p := range paths {
			if l, err := os.Readlink(p); err == nil && l == want {
				found = append(found, p)
			}
		}
	}
	return found
}

func TestCloseLeavesNothing(t *testing.T) {
	needRoot(t)
	ignore := goleak.IgnoreCurrent()
	n, err := Start(Options{Zone: map[string][]netip.Addr{"x.test": {netip.MustParseAddr("192.0.2.1")}}})
	if err != nil {
		t.Fatal(err)
	}
	ino := nsInode(t, n)
	// The descriptor holds it (and, for a moment after Start, the
	// namespace's thread, which the runtime is ending).
	if held := holdsNamespace(t, ino); len(held) == 0 || !strings.HasPrefix(held[0], "/proc/self/fd/") {
		t.Fatalf("namespace held by %v, want a descriptor", held)
	}
	name, index, host := n.LinkName(), n.linkIndex, n.Host(0)

	// Connections that are open when Close runs: a held HTTP response,
	// an HTTPS one, chargen, echo, and DNS over TCP.
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: n.CAPool()}, ForceAttemptHTTP2: true}
	defer tr.CloseIdleConnections()
	var bodies []io.ReadCloser
	for _, u := range []string{"http://" + host.String() + "/hold", "https://" + host.String() + "/hold"} {
		resp, err := (&http.Client{Transport: tr}).Get(u)
		if err != nil {
			t.Fatal(err)
		}
		bodies = append(bodies, resp.Body)
	}
	chargen := dialTCP(t, netip.AddrPortFrom(host, PortChargen))
	echo := dialTCP(t, netip.AddrPortFrom(host, PortEcho))
	dnsConn, err := dns.DialTimeout("tcp", n.DNS().String(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(io.Discard, chargen, 1000); err != nil {
		t.Fatal(err)
	}
	eventually(t, "connections to be accepted", func() bool {
		return n.Accepted(PortEcho) == 1 && n.Accepted(PortDNS) == 1 && handlersRunning(n) == 2
	})

	t0 := time.Now()
	if err := n.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	t.Logf("Close took %v", time.Since(t0))
	if err := n.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}

	// Every open connection ended.
	for i, b := range bodies {
		if _, err := io.Copy(io.Discard, b); err == nil {
			t.Errorf("hold body %d ended cleanly, want an error (connection closed mid-body)", i)
		}
		b.Close()
	}
	if _, err := io.Copy(io.Discard, chargen); err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("chargen after Close: %v", err)
	}
	if _, err := echo.Read(make([]byte, 1)); err == nil {
		t.Error("echo connection still open")
	}
	chargen.Close()
	echo.Close()
	dnsConn.Close()

	// No veth, no namespace reference, no goroutine.
	assertLinkGone(t, name, index)
	eventually(t, "namespace to be released", func() bool { return len(holdsNamespace(t, ino)) == 0 })
	tr.CloseIdleConnections()
	goleak.VerifyNone(t, ignore)

	// The range stays unreachable: the old host has no route, and a dial
	// (made only once that is established) fails at once. Another test
	// process may have taken the free /24 already: then it is its link's.
	if routes, err := netlink.RouteGet(net.IP(host.AsSlice())); err == nil && len(routes) == 1 {
		if l, err := netlink.LinkByIndex(routes[0].LinkIndex); err == nil && l.Attrs().Name == name {
			t.Logf("%s was taken again (by another process) before the check", name)
			return
		}
	}
	assertUnreachable(t, host)
	d := net.Dialer{Timeout: 2 * time.Second}
	if _, err := d.Dial("tcp", netip.AddrPortFrom(host, 80).String()); !errors.Is(err, syscall.EHOSTUNREACH) {
		t.Fatalf("dial %s after Close: %v, want EHOSTUNREACH", host, err)
	}
}

// assertUnreachable checks, without sending anything, that addr is
// covered by the unreachable route.
func assertUnreachable(t testing.TB, addr netip.Addr) {
	t.Helper()
	routes, err := netlink.RouteGet(net.IP(addr.AsSlice()))
	if !errors.Is(err, syscall.EHOSTUNREACH) {
		t.Fatalf("route to %s: %v %v, want EHOSTUNREACH", addr, routes, err)
	}
}

func TestUnreachableRoute(t *testing.T) {
	n := start(t, Options{Hosts: 1})
	routes, err := netlink.RouteListFiltered(netlink.FAMILY_V4,
		&netlink.Route{Dst: prefixIPNet(simRange), Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_DST|netlink.RT_FILTER_TABLE)
	if err != nil {
		t.Fatal(err)
	}
	if len(routes) != 1 || routes[0].Type != unix.RTN_UNREACHABLE {
		t.Fatalf("routes for %s: %v", simRange, routes)
	}
	// Idempotent.
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := ensureUnreachable(h); err != nil {
		t.Fatalf("second ensureUnreachable: %v", err)
	}
	// The /24 beats it; an address of the range outside any Internet does not.
	routes, err = netlink.RouteGet(net.IP(n.Host(0).AsSlice()))
	if err != nil || len(routes) != 1 || routes[0].LinkIndex != n.linkIndex {
		t.Fatalf("route to %s: %v, %v", n.Host(0), routes, err)
	}
	assertUnreachable(t, netip.MustParseAddr("198.19.255.254"))
}

// TestRouteChecksReject drives the fail-closed checks in a namespace of
// the test's own (nothing is sent anywhere).
func TestRouteChecksReject(t *testing.T) {
	needRoot(t)
	thread, nsFile, err := newNSThread()
	if err != nil {
		t.Fatal(err)
	}
	defer thread.stop()
	defer nsFile.Close()
	err = thread.run(func() error {
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return err
		}
		defer h.Close()
		// dummy is not built into every kernel; veth is.
		if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "d0"}, PeerName: "d1"}); err != nil {
			return err
		}
		for _, name := range []string{"d1", "d0"} {
			l, err := h.LinkByName(name)
			if err != nil {
				return err
			}
			if err := h.LinkSetUp(l); err != nil {
				return err
			}
		}
		link, err := h.LinkByName("d0")
		if err != nil {
			return err
		}
		if err := h.AddrAdd(link, &netlink.Addr{IPNet: prefixIPNet(netip.MustParsePrefix("10.9.0.1/24"))}); err != nil {
			return err
		}
		// Someone routes the whole range to a gateway with metric 0:
		// refused, not replaced.
		gwRoute := &netlink.Route{Dst: prefixIPNet(simRange), Gw: net.ParseIP("10.9.0.2"), LinkIndex: link.Attrs().Index}
		if err := h.RouteAdd(gwRoute); err != nil {
			return err
		}
		if err := ensureUnreachable(h); !errors.Is(err, errdefs.ErrConflict) {
			return fmt.Errorf("ensureUnreachable over a gateway route: %v, want ErrConflict", err)
		}
		if err := h.RouteDel(gwRoute); err != nil {
			return err
		}
		// With a gateway route of a higher metric, ours is added and wins.
		gwRoute.Priority = 100
		if err := h.RouteAdd(gwRoute); err != nil {
			return err
		}
		if err := ensureUnreachable(h); err != nil {
			return fmt.Errorf("ensureUnreachable beside a metric-100 route: %v", err)
		}
		if _, err := h.RouteGet(net.ParseIP("198.18.7.10")); !errors.Is(err, syscall.EHOSTUNREACH) {
			return fmt.Errorf("route to 198.18.7.10: %v, want EHOSTUNREACH", err)
		}
		// A more specific route of someone else's for an Internet's /24:
		// checkRoutes refuses (the Internet's link would be the dummy's
		// index only if the route went through it directly).
		if err := h.RouteAdd(&netlink.Route{Dst: prefixIPNet(netip.MustParsePrefix("198.18.7.0/24")),
			Gw: net.ParseIP("10.9.0.2"), LinkIndex: link.Attrs().Index}); err != nil {
			return err
		}
		if err := checkRoutes(h, link.Attrs().Index, []netip.Addr{netip.MustParseAddr("198.18.7.10")}); !errors.Is(err, errdefs.ErrConflict) {
			return fmt.Errorf("checkRoutes via a gateway: %v, want ErrConflict", err)
		}
		if err := checkRoutes(h, link.Attrs().Index+1, []netip.Addr{netip.MustParseAddr("10.9.0.5")}); !errors.Is(err, errdefs.ErrConflict) {
			return fmt.Errorf("checkRoutes on another link: %v, want ErrConflict", err)
		}
		if err := checkRoutes(h, link.Attrs().Index, []netip.Addr{netip.MustParseAddr("198.18.8.1")}); err == nil {
			return errors.New("checkRoutes for an unreachable address: no error")
		}
		if err := checkRoutes(h, link.Attrs().Index, []netip.Addr{netip.MustParseAddr("10.9.0.5")}); err != nil {
			return fmt.Errorf("checkRoutes for a connected address: %v", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestValidate(t *testing.T) {
	bad := []Options{
		{Hosts: -1},
		{Hosts: MaxHosts + 1},
		{Zone: map[string][]netip.Addr{"": nil}},
		{Zone: map[string][]netip.Addr{".": nil}},
		{Zone: map[string][]netip.Addr{"..": nil}},
		{Zone: map[string][]netip.Addr{".a.test": nil}},
		{Zone: map[string][]netip.Addr{"a..b": nil}},
		{Zone: map[string][]netip.Addr{"has space.test": nil}},
		{Zone: map[string][]netip.Addr{"*.wild.test": nil}},
		{Zone: map[string][]netip.Addr{"caf\u00e9.test": nil}},
		{Zone: map[string][]netip.Addr{strings.Repeat("a", 64) + ".test": nil}},
		{Zone: map[string][]netip.Addr{"ok.test": {{}}}},
		{Zone: map[string][]netip.Addr{"ok.test": {netip.MustParseAddr("fe80::1%eth0")}}},
	}
	for _, o := range bad {
		if err := o.Validate(); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("Validate(%+v) = %v, want ErrInvalid", o, err)
		}
		if n, err := Start(o); !errors.Is(err, errdefs.ErrInvalid) || n != nil {
			t.Errorf("Start(%+v) = %v, %v, want ErrInvalid", o, n, err)
		}
	}
	good := Options{Hosts: MaxHosts, Zone: map[string][]netip.Addr{"OK.test.": {netip.MustParseAddr("::1")}, "x-y.z": nil}}
	if err := good.Validate(); err != nil {
		t.Fatalf("Validate(good) = %v", err)
	}
	n := start(t, Options{Hosts: MaxHosts})
	if n.Host(MaxHosts-1) != addrIn(n.Prefix(), 52) || n.Host(MaxHosts).IsValid() || n.Host(-1).IsValid() {
		t.Fatalf("Host range: %s %s %s", n.Host(MaxHosts-1), n.Host(MaxHosts), n.Host(-1))
	}
	if err := n.SetZone("bad name", n.Host(0)); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("SetZone(bad name) = %v", err)
	}
	if err := n.SetZone("ok.test", netip.Addr{}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("SetZone(invalid addr) = %v", err)
	}
	if _, body := get(t, httpClient(t, n, netip.Addr{}), "https://"+n.Host(MaxHosts-1).String()+"/"); string(body) != "hello from "+n.Host(MaxHosts-1).String() {
		t.Fatalf("last host: %q", body)
	}
}

// FuzzAnswer feeds arbitrary DNS messages to the DNS handler: it must
// answer every parsable message with one that packs, and never panic.
func FuzzAnswer(f *testing.F) {
	for _, q := range []struct {
		name string
		t    uint16
	}{{"a.test.", dns.TypeA}, {"A.TEST.", dns.TypeAAAA}, {"nx.test.", dns.TypeMX}, {".", dns.TypeANY}} {
		m := new(dns.Msg)
		m.SetQuestion(q.name, q.t)
		m.SetEdns0(4096, false)
		b, _ := m.Pack()
		f.Add(b)
	}
	n := &Internet{zone: map[string][]netip.Addr{
		"a.test": {netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("2001:db8::1")},
		"big.test": func() []netip.Addr {
			var out []netip.Addr
			for i := range 200 {
				out = append(out, netip.AddrFrom4([4]byte{192, 0, 2, byte(i)}))
			}
			return out
		}(),
	}}
	remotes := []net.Addr{&net.UDPAddr{IP: net.IPv4(198, 18, 0, 1), Port: 5353}, &net.TCPAddr{IP: net.IPv4(198, 18, 0, 1), Port: 5353}}
	f.Fuzz(func(t *testing.T, b []byte) {
		req := new(dns.Msg)
		if err := req.Unpack(b); err != nil {
			return
		}
		for _, remote := range remotes {
			r := n.answer(req, remote, remote)
			packed, err := r.Pack()
			if err != nil {
				t.Fatalf("answer does not pack: %v\n%v", err, r)
			}
			if _, ok := remote.(*net.UDPAddr); ok && len(packed) > 65535 {
				t.Fatalf("udp answer of %d bytes", len(packed))
			}
			if r.Id != req.Id || !r.Response {
				t.Fatalf("answer %v to %v", r, req)
			}
		}
		n.ResetQueries()
	})
}

// FuzzNormalizeName: an accepted name is lower-case, without trailing dot,
// a DNS name, and one a certificate can carry.
func FuzzNormalizeName(f *testing.F) {
	for _, s := range []string{"a.test", "A.Test.", "", ".", "a..b", "x_y.test", "caf\u00e9", "*.a"} {
		f.Add(s)
	}
	ca, err := newAuthority("fuzz")
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, s string) {
		norm, err := normalizeName(s)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("%q: untyped error %v", s, err)
			}
			return
		}
		if norm != strings.ToLower(norm) || strings.HasSuffix(norm, ".") || norm == "" {
			t.Fatalf("%q -> %q", s, norm)
		}
		if _, ok := dns.IsDomainName(norm); !ok {
			t.Fatalf("%q -> %q: not a domain name", s, norm)
		}
		if _, err := ca.issue([]string{norm}, nil); err != nil {
			t.Fatalf("%q -> %q: no certificate: %v", s, norm, err)
		}
	})
}

// TestUnprivileged: without the privileges Start fails with ErrDenied and
// creates nothing.
func TestUnprivileged(t *testing.T) {
	needRoot(t)
	if *unprivHelper {
		return // this process is the helper (TestHelperUnprivileged)
	}
	// A copy of the test binary that uid 65534 can run (t.TempDir is
	// <tmp>/<test><random>/<nnn>, both 0700).
	dir := t.TempDir()
	for _, d := range []string{dir, filepath.Dir(dir)} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	bin := filepath.Join(dir, "netsim.test")
	src, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, src, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-test.run=^TestHelperUnprivileged$", "-test.count=1", "-netsim.unprivileged")
	cmd.Dir = dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("unprivileged ok")) {
		t.Fatalf("unprivileged helper: %v\n%s", err, out)
	}
}

func TestHelperUnprivileged(t *testing.T) {
	if !*unprivHelper {
		return // only as the helper process of TestUnprivileged
	}
	n, err := Start(Options{})
	if !errors.Is(err, errdefs.ErrDenied) || n != nil {
		t.Fatalf("Start unprivileged: %v, %v; want ErrDenied", n, err)
	}
	t.Log(err)
	fmt.Println("unprivileged ok")
}

// TestStartFailureCleansUp: a Start that fails part way leaves no link,
// namespace or goroutine behind.
func TestStartFailureCleansUp(t *testing.T) {
	needRoot(t)
	defer func() { testHookStart = nil }()
	for _, stage := range []string{"link", "listen", "serve"} {
		t.Run(stage, func(t *testing.T) {
			ignore := goleak.IgnoreCurrent()
			var (
				name  string
				index int
				ino   uint64
			)
			injected := errors.New("injected")
			testHookStart = func(n *Internet, s string) error {
				if s != stage {
					return nil
				}
				name, index, ino = n.LinkName(), n.linkIndex, nsInode(t, n)
				if _, err := netlink.LinkByName(name); err != nil {
					t.Errorf("link %s missing at stage %s: %v", name, s, err)
				}
				return injected
			}
			n, err := Start(Options{Zone: map[string][]netip.Addr{"a.test": {netip.MustParseAddr("192.0.2.1")}}})
			testHookStart = nil
			if !errors.Is(err, injected) || n != nil {
				t.Fatalf("Start = %v, %v; want the injected error", n, err)
			}
			if name == "" {
				t.Fatal("hook not run")
			}
			assertLinkGone(t, name, index)
			// The namespace's thread ends right after its goroutine (the
			// runtime ends it): allow it a moment.
			eventually(t, "namespace to be released", func() bool { return len(holdsNamespace(t, ino)) == 0 })
			goleak.VerifyNone(t, ignore)
		})
	}
}

// assertLinkGone checks that the link an Internet had is gone. By index:
// another test process may already have taken the free name.
func assertLinkGone(t testing.TB, name string, index int) {
	t.Helper()
	l, err := netlink.LinkByIndex(index)
	if err == nil {
		t.Errorf("link %s (index %d) still exists: %s", name, index, l.Attrs().Name)
		return
	}
	if !errors.As(err, new(netlink.LinkNotFoundError)) && !errors.Is(err, syscall.ENODEV) {
		t.Errorf("link %s (index %d): %v", name, index, err)
	}
}
