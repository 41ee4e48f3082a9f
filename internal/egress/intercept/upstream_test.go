package intercept

import (
	"context"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

// What the upstream side does: verification, dial failures, 1xx, idle
// closes, bytes nobody asked for.

func TestServeUntrustedUpstream(t *testing.T) {
	var hits atomic.Int32
	other, _, err := NewCA("someone else")
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1) }),
		withRoots(func(*httptest.Server) *x509.CertPool { return poolOf(t, other) }))
	resp, err := e.client().Get("https://" + testHost + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("status %d, want 502", resp.StatusCode)
	}
	if err := e.serveErr(); !errors.Is(err, errdefs.ErrUpstream) || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("Serve: %v, want an upstream certificate error", err)
	}
	if hits.Load() != 0 {
		t.Fatal("the request reached an unverified upstream")
	}
}

func TestServeBoundsInterimResponses(t *testing.T) {
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for range 100 {
			w.Header().Set("Link", "</x>; rel=preload")
			w.WriteHeader(http.StatusEarlyHints)
		}
	}))
	resp, err := e.client().Get("https://" + testHost + "/")
	if err == nil {
		resp.Body.Close()
		t.Fatalf("status %d after 100 interim responses", resp.StatusCode)
	}
	if err := e.serveErr(); !errors.Is(err, errdefs.ErrUpstream) {
		t.Fatalf("Serve: %v, want upstream", err)
	}
}

func TestServeExpectAnsweredWithoutContinue(t *testing.T) {
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 417 Expectation Failed\r\nContent-Length: 0\r\n\r\n") // and keeps the connection
		brw.Flush()
		io.Copy(io.Discard, brw)
	}))
	c, br, err := e.rawTLS()
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(c, "PUT /x HTTP/1.1\r\nHost: example.com\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
	if resp := readResp(t, br, "PUT"); resp.StatusCode != http.StatusExpectationFailed {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if err := e.serveErr(); err != nil {
		t.Fatalf("Serve: %v", err)
	}
	if _, err := br.ReadByte(); err == nil {
		t.Fatal("connection still open")
	}
}

func TestServeUpstreamIdleCloseEndsClient(t *testing.T) {
	var hits atomic.Int32
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1) }),
		withServer(func(s *http.Server) { s.IdleTimeout = 100 * time.Millisecond }))
	c, br, err := e.rawTLS()
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: example.com\r\n\r\n")
	if resp := readResp(t, br, "GET"); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if err := e.serveErr(); err != nil {
		t.Fatalf("Serve: %v", err)
	}
	if _, err := br.ReadByte(); err == nil {
		t.Fatal("client connection still open after the upstream closed")
	}

	// A pooling client does not notice: it reconnects.
	cl := e.client()
	for i := range 2 {
		if i == 1 {
			time.Sleep(300 * time.Millisecond)
		}
		resp, err := cl.Get("https://" + testHost + "/")
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: status %d", i, resp.StatusCode)
		}
	}
	if hits.Load() != 3 {
		t.Fatalf("upstream hits %d, want 3", hits.Load())
	}
}

func TestServeUnsolicitedUpstreamBytes(t *testing.T) {
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		brw.Flush()
		time.Sleep(100 * time.Millisecond)
		brw.WriteString("HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
		brw.Flush()
		io.Copy(io.Discard, brw)
	}))
	c, br, err := e.rawTLS()
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: example.com\r\n\r\n")
	resp := readResp(t, br, "GET")
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || string(body) != "ok" {
		t.Fatalf("status %d body %q", resp.StatusCode, body)
	}
	if err := e.serveErr(); err != nil {
		t.Fatalf("Serve: %v", err)
	}
	if rest, _ := io.ReadAll(br); len(rest) != 0 {
		t.Fatalf("client got %q after its answer", rest)
	}
}

func TestServeDialFailure(t *testing.T) {
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}),
		withDial(func(context.Context, string) (net.Conn, error) { return nil, errors.New("refused by test") }))
	resp, err := e.client().Get("https://" + testHost + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("status %d, want 502", resp.StatusCode)
	}
	if err := e.serveErr(); !errors.Is(err, errdefs.ErrUpstream) {
		t.Fatalf("Serve: %v, want upstream", err)
	}
}
