package edge

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/edgecert"
)

// tlsHarness serves the harness's edge over HTTPS with a local CA (as
// space up does) and returns a client that trusts only that CA and
// resolves every name to the edge's listener (as *.localhost resolves to
// the loopback).
func tlsHarness(t *testing.T) (*harness, *http.Client, string) {
	t.Helper()
	certs, err := edgecert.New(edgecert.Config{Domain: "localhost", Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, func(c *Config) { c.TLS = certs.TLSConfig() })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.edge.ServeTLS(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("ServeTLS: %v", err)
		}
	})
	pem, err := os.ReadFile(certs.CAFile())
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	addr := ln.Addr().String()
	tr := &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		},
	}
	t.Cleanup(tr.CloseIdleConnections)
	_, port, _ := net.SplitHostPort(addr)
	return h, &http.Client{Transport: tr}, port
}

// TestDirectURLsOverTLS: https://<port>-<sandbox>.<domain>:<port> reaches
// the sandbox's service ports and envd (signed /files URLs with no access
// token included), from the Host name alone.
func TestDirectURLsOverTLS(t *testing.T) {
	h, cl, port := tlsHarness(t)
	h.sandbox("sbx1")

	res, err := cl.Get("https://8000-sbx1.localhost:" + port + "/hello")
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(t, res)
	if res.StatusCode != 200 || !strings.Contains(body, `"path":"/hello"`) || res.TLS == nil {
		t.Fatalf("service port over TLS: %d %s", res.StatusCode, body)
	}
	calls := h.node.callsCopy()
	if len(calls) != 1 || calls[0].Path != "/hello" {
		t.Fatalf("node calls: %+v", calls)
	}

	h.cp.mu.Lock()
	h.cp.tokens["sbx1"] = "tok"
	h.cp.mu.Unlock()
	q := url.Values{"path": {"/home/user/f"}, "username": {"user"}, "signature": {"sig-tok"}}
	res, err = cl.Get("https://49983-sbx1.localhost:" + port + "/files?" + q.Encode())
	if err != nil {
		t.Fatal(err)
	}
	if readAll(t, res); res.StatusCode != 200 {
		t.Fatalf("signed /files over TLS: %d", res.StatusCode)
	}
	cps := h.cp.callsCopy()
	if last := cps[len(cps)-1]; last.Sandbox != "sbx1" || last.AccessToken != "" || last.Query.Get("signature") != "sig-tok" || last.Query.Get("operation") != "read" {
		t.Fatalf("capability request: %+v", last)
	}
}

// TestDirectURLRejections: each way a direct URL can be wrong has its own
// answer: no certificate for a name outside <label>.<domain>, 400 for a
// label that is not <port>-<sandbox>, 502 sandbox_not_found for an unknown
// sandbox, 401 for a bad signature, and plain HTTP is not served.
func TestDirectURLRejections(t *testing.T) {
	h, cl, port := tlsHarness(t)
	h.sandbox("sbx1")
	h.cp.tokens["sbx1"] = "tok"
	for _, host := range []string{"a.b.localhost", "8000-sbx1.example.com", "8000-sbx1.localhost.evil"} {
		if res, err := cl.Get("https://" + host + ":" + port + "/"); err == nil {
			res.Body.Close()
			t.Errorf("%s: served (%d)", host, res.StatusCode)
		} else if !strings.Contains(err.Error(), "tls") {
			t.Errorf("%s: %v, want a TLS failure", host, err)
		}
	}
	for host, want := range map[string]struct {
		status int
		reason string
	}{
		"nodash.localhost":         {400, reasonBadRequest},
		"99999-sbx1.localhost":     {400, reasonBadRequest},
		"8000-UPPER_.localhost":    {400, reasonBadRequest},
		"8000-nosuch.localhost":    {502, reasonSandboxNotFound},
		"49983-nosuch.localhost/f": {502, reasonSandboxNotFound},
		"localhost":                {400, "no_sandbox"},
		"49983-sbx1.localhost/bad": {401, ""},
	} {
		path := "/files?path=/x&signature=sig-wrong"
		host, rest, _ := strings.Cut(host, "/")
		if rest == "" {
			path = "/"
		}
		res, err := cl.Get("https://" + host + ":" + port + path)
		if err != nil {
			if host == "8000-UPPER_.localhost" {
				continue // no certificate for it either: refused at the handshake
			}
			t.Fatalf("%s: %v", host, err)
		}
		var e spacev1.Error
		raw := readAll(t, res)
		if json.Unmarshal([]byte(raw), &e) != nil || res.StatusCode != want.status || e.Code != want.status || (want.reason != "" && e.Reason != want.reason) {
			t.Errorf("%s%s: %d %s, want %d %s", host, path, res.StatusCode, raw, want.status, want.reason)
		}
	}
	// Plain HTTP on the TLS port.
	res, err := (&http.Client{Transport: &http.Transport{DialContext: cl.Transport.(*http.Transport).DialContext}}).Get("http://8000-sbx1.localhost:" + port + "/")
	if err == nil {
		readAll(t, res)
		if res.StatusCode != 400 {
			t.Errorf("plain HTTP on the TLS port: %d", res.StatusCode)
		}
	}
}

// TestServeTLSNeedsConfig: without Config.TLS there is nothing to serve
// HTTPS with.
func TestServeTLSNeedsConfig(t *testing.T) {
	h := newHarness(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.edge.ServeTLS(context.Background(), ln); err == nil {
		t.Fatal("ServeTLS without TLS: no error")
	}
	if _, err := net.Dial("tcp", ln.Addr().String()); err == nil {
		t.Fatal("listener left open")
	}
}

// TestRunTLSAddrInUse: Run fails when its HTTPS address is taken, and
// releases the plain one.
func TestRunTLSAddrInUse(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	free, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	plain := free.Addr().String()
	free.Close()
	certs, err := edgecert.New(edgecert.Config{Domain: "localhost", Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Config{ControlPlaneURL: "http://127.0.0.1:1", EdgeKey: "k", Addr: plain, TLSAddr: busy.Addr().String(), TLS: certs.TLSConfig()})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.Run(context.Background()); err == nil {
		t.Fatal("Run with a busy TLS address: no error")
	}
	ln, err := net.Listen("tcp", plain)
	if err != nil {
		t.Fatalf("plain address still held: %v", err)
	}
	ln.Close()
}

// TestRunServesBoth: Run serves the plain and the HTTPS listener until its
// context ends.
func TestRunServesBoth(t *testing.T) {
	addrs := make([]string, 2)
	for i := range addrs {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addrs[i] = l.Addr().String()
		l.Close()
	}
	certs, err := edgecert.New(edgecert.Config{Domain: "localhost", Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Config{ControlPlaneURL: "http://127.0.0.1:1", EdgeKey: "k", Addr: addrs[0], TLSAddr: addrs[1], TLS: certs.TLSConfig()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	pem, _ := os.ReadFile(certs.CAFile())
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: "localhost"}}
	defer tr.CloseIdleConnections()
	cl := &http.Client{Transport: tr}
	for _, u := range []string{"http://" + addrs[0] + "/healthz", "https://" + addrs[1] + "/healthz"} {
		var res *http.Response
		for range 100 {
			if res, err = cl.Get(u); err == nil {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil {
			t.Fatalf("%s: %v", u, err)
		}
		if readAll(t, res); res.StatusCode != 200 {
			t.Fatalf("%s: %d", u, res.StatusCode)
		}
	}
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v", err)
	}
	e.Close()
}

// TestSlowControlPlaneIsAnswered: when the control plane does not answer
// in time, the client still present gets an error answer (504 or 503),
// never an empty 200, on the plain path and on a signed URL naming no
// sandbox.
func TestSlowControlPlaneIsAnswered(t *testing.T) {
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	h := newHarness(t, func(c *Config) {
		c.ControlPlaneClient = &http.Client{Transport: tr, Timeout: 200 * time.Millisecond}
	})
	h.sandbox("sbx1")
	h.cp.mu.Lock()
	h.cp.delay = time.Second
	h.cp.mu.Unlock()
	for _, u := range []string{"/files?path=/x", "/files?path=/x&signature=sig-none"} {
		req, _ := http.NewRequest("GET", h.srv.URL+u, nil)
		if !strings.Contains(u, "signature") {
			req.Header.Set(HeaderSandboxID, "sbx1")
			req.Header.Set(HeaderSandboxPort, "49983")
		}
		res, err := h.cl.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var e spacev1.Error
		raw := readAll(t, res)
		if (res.StatusCode != 504 && res.StatusCode != 503) || json.Unmarshal([]byte(raw), &e) != nil || e.Code != res.StatusCode {
			t.Errorf("%s: %d %q", u, res.StatusCode, raw)
		}
	}
}
