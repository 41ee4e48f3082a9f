package egress

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"

	"github.com/spacesbx/space/internal/netpolicy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// env is one proxy under test: fake original destinations, a dial table
// mapping pretend public destinations to loopback servers, a lookup table,
// and the denials and dials it saw.
type env struct {
	t   testing.TB
	p   *Proxy
	reg *prometheus.Registry
	ctx context.Context

	mu      sync.Mutex
	origDst map[string]netip.AddrPort // sandbox-side addr of a connection -> its destination
	routes  map[string]string         // pretend destination -> loopback server
	names   map[string][]netip.Addr
	dialed  []string
	denials []Denial
	wg      sync.WaitGroup
}

func newEnv(t testing.TB, mod func(*Config)) *env {
	t.Helper()
	e := &env{t: t, reg: prometheus.NewRegistry(), origDst: map[string]netip.AddrPort{},
		routes: map[string]string{}, names: map[string][]netip.Addr{}}
	cfg := Config{
		Upstreams:   []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:9")}, // never asked unless a test sets its own
		PeekTimeout: 300 * time.Millisecond,
		DialTimeout: 2 * time.Second,
		Registerer:  e.reg,
		Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
		Audit: func(d Denial) {
			e.mu.Lock()
			e.denials = append(e.denials, d)
			e.mu.Unlock()
		},
		Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
			e.mu.Lock()
			e.dialed = append(e.dialed, addr)
			to, ok := e.routes[addr]
			e.mu.Unlock()
			if !ok {
				// Never send a packet anywhere but loopback servers of the test.
				return nil, fmt.Errorf("test: no route to %s", addr)
			}
			var d net.Dialer
			return d.DialContext(ctx, network, to)
		},
		Lookup: func(ctx context.Context, name string) ([]netip.Addr, error) {
			e.mu.Lock()
			defer e.mu.Unlock()
			a, ok := e.names[name]
			if !ok {
				return nil, errors.New("test: nxdomain")
			}
			return a, nil
		},
	}
	if mod != nil {
		mod(&cfg)
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.p = p
	ctx, cancel := context.WithCancel(context.Background())
	e.ctx = ctx
	t.Cleanup(func() {
		cancel()
		p.Close()
		e.wg.Wait()
	})
	return e
}

// listen starts ServeTCP on gw (a loopback address) and returns the listener address.
func (e *env) listen(gw string) string {
	e.t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(gw, "0"))
	if err != nil {
		e.t.Fatal(err)
	}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		if err := e.p.ServeTCP(e.ctx, ln, e.orig); err != nil {
			e.t.Errorf("ServeTCP: %v", err)
		}
	}()
	return ln.Addr().String()
}

// orig is the fake SO_ORIGINAL_DST: the test registers the destination
// right after connecting, so wait a little for it.
func (e *env) orig(c net.Conn) (netip.AddrPort, error) {
	key := c.RemoteAddr().String()
	for i := 0; i < 200; i++ {
		e.mu.Lock()
		d, ok := e.origDst[key]
		e.mu.Unlock()
		if ok {
			return d, nil
		}
		time.Sleep(5 * time.Millisecond)
	}
	return netip.AddrPort{}, errors.New("test: no original destination")
}

// connect is a sandbox connecting to dst, redirected to the proxy at proxyAddr.
func (e *env) connect(proxyAddr, dst string) net.Conn {
	e.t.Helper()
	c, err := net.Dial("tcp", proxyAddr)
	if err != nil {
		e.t.Fatal(err)
	}
	e.mu.Lock()
	e.origDst[c.LocalAddr().String()] = netip.MustParseAddrPort(dst)
	e.mu.Unlock()
	e.t.Cleanup(func() { c.Close() })
	return c
}

func (e *env) route(dst, to string) {
	e.mu.Lock()
	e.routes[dst] = to
	e.mu.Unlock()
}

func (e *env) name(n string, addrs ...string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, a := range addrs {
		e.names[n] = append(e.names[n], netip.MustParseAddr(a))
	}
}

func (e *env) dials() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.dialed...)
}

// waitDenial waits for a denial with reason (and dest, when not "").
func (e *env) waitDenial(reason, dest string) Denial {
	e.t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		e.mu.Lock()
		for _, d := range e.denials {
			if d.Reason == reason && (dest == "" || d.Dest == dest) {
				e.mu.Unlock()
				return d
			}
		}
		e.mu.Unlock()
		time.Sleep(10 * time.Millisecond)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.t.Fatalf("no denial %q for %q; got %+v", reason, dest, e.denials)
	return Denial{}
}

func (e *env) set(gw string, id string, s netpolicy.Spec, d netpolicy.Defaults) {
	e.t.Helper()
	pol, err := netpolicy.Compile(s, d)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := e.p.Set(netip.MustParseAddr(gw), Sandbox{ID: id, Generation: 1, Policy: pol}); err != nil {
		e.t.Fatal(err)
	}
}

// counter reads a metric with the given labels (0 when absent).
func (e *env) counter(name string, labels ...string) float64 {
	e.t.Helper()
	mfs, err := e.reg.Gather()
	if err != nil {
		e.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				if !hasLabel(m, labels[i], labels[i+1]) {
					continue metric
				}
			}
			switch {
			case m.Counter != nil:
				return m.Counter.GetValue()
			case m.Gauge != nil:
				return m.Gauge.GetValue()
			case m.Histogram != nil:
				return float64(m.Histogram.GetSampleCount())
			}
		}
	}
	return 0
}

func hasLabel(m *dto.Metric, k, v string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == k && l.GetValue() == v {
			return true
		}
	}
	return false
}

// echoServer echoes every connection on a loopback listener, prefixing
// nothing; it stops at cleanup.
func echoServer(t testing.TB) string {
	t.Helper()
	return serveLoop(t, func(c net.Conn) { io.Copy(c, c) })
}

func serveLoop(t testing.TB, h func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				h(c)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

// expectClosed asserts the proxy closes c without sending anything.
func expectClosed(t testing.TB, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	b := make([]byte, 1)
	n, err := c.Read(b)
	if n != 0 || err == nil || isTimeout(err) {
		t.Fatalf("connection not closed: n=%d err=%v", n, err)
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// roundTrip writes msg and expects it echoed back.
func roundTrip(t testing.TB, c net.Conn, msg string) {
	t.Helper()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, len(msg))
	if _, err := io.ReadFull(c, b); err != nil {
		t.Fatalf("echo of %q: %v", msg, err)
	}
	if string(b) != msg {
		t.Fatalf("echo %q, want %q", b, msg)
	}
	c.SetDeadline(time.Time{})
}

// selfSigned makes a CA-less self-signed server certificate for names.
func selfSigned(t testing.TB, names ...string) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: names[0]},
		DNSNames: names, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(c)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: k}, pool
}

// tlsEchoServer terminates TLS with cert and echoes; it records SNIs.
func tlsEchoServer(t testing.TB, cert tls.Certificate) string {
	t.Helper()
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}}
	return serveLoop(t, func(c net.Conn) {
		tc := tls.Server(c, cfg)
		io.Copy(tc, tc)
	})
}

func allow(b bool) *bool { return &b }
