package intercept

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

// pattern is n deterministic bytes.
func pattern(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func sum(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }

// echoHeaders reports what the upstream saw.
func echoHeaders(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("X-Got-Host", r.Host)
	w.Header().Set("X-Got-Key", r.Header.Get("X-Api-Key"))
	w.Header().Set("X-Got-Auth", strings.Join(r.Header.Values("Authorization"), "|"))
	w.Header().Set("X-Got-Other", r.Header.Get("X-Other"))
	w.Header().Set("X-Got-UA", r.Header.Get("User-Agent"))
}

func TestServeInjectsHeadersAndStreamsLargeBodies(t *testing.T) {
	const upSize, downSize = 3 << 20, 5 << 20
	down := pattern(2, downSize)
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		echoHeaders(w, r)
		h := sha256.New()
		n, err := io.Copy(h, r.Body)
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.Header().Set("X-Upload", fmt.Sprintf("%d %x %v", n, h.Sum(nil), r.TransferEncoding))
		for off := 0; off < len(down); off += 100 << 10 {
			w.Write(down[off:min(off+100<<10, len(down))])
			w.(http.Flusher).Flush() // no Content-Length: chunked
		}
	}))
	up := pattern(1, upSize)
	req, _ := http.NewRequest("POST", "https://"+testHost+"/upload", io.MultiReader(bytes.NewReader(up))) // unknown length: chunked
	req.Header.Set("Authorization", "Bearer from-the-sandbox")
	req.Header.Set("X-Other", "kept")
	resp, err := e.client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, got)
	}
	if h := resp.Header.Get("X-Got-Host"); h != testHost {
		t.Errorf("upstream saw Host %q", h)
	}
	if h := resp.Header.Get("X-Got-Key"); h != "k-123" {
		t.Errorf("injected header: upstream saw %q", h)
	}
	if h := resp.Header.Get("X-Got-Auth"); h != "Bearer platform-secret" {
		t.Errorf("overridden header: upstream saw %q, want only the platform's value", h)
	}
	if h := resp.Header.Get("X-Got-Other"); h != "kept" {
		t.Errorf("client header: upstream saw %q", h)
	}
	if want := fmt.Sprintf("%d %s [chunked]", upSize, sum(up)); resp.Header.Get("X-Upload") != want {
		t.Errorf("upload: upstream saw %q, want %q", resp.Header.Get("X-Upload"), want)
	}
	if fmt.Sprint(resp.TransferEncoding) != "[chunked]" || len(got) != downSize || sum(got) != sum(down) {
		t.Errorf("download: %d bytes (%v), hash match %v", len(got), resp.TransferEncoding, sum(got) == sum(down))
	}
}

// The client gets the server's first bytes before it has sent all of its
// body, and the server gets the client's first bytes before the client
// has read anything: nothing is buffered whole on the way.
func TestServeStreamsBothWaysAtOnce(t *testing.T) {
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.NewResponseController(w).EnableFullDuplex()
		first := make([]byte, 5)
		if _, err := io.ReadFull(r.Body, first); err != nil {
			return
		}
		fmt.Fprintf(w, "ack:%s;", first)
		w.(http.Flusher).Flush()
		rest, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "rest:%s", rest)
	}))
	pr, pw := io.Pipe()
	go pw.Write([]byte("hello"))
	req, _ := http.NewRequest("POST", "https://"+testHost+"/duplex", pr)
	resp, err := e.client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	ack := make([]byte, len("ack:hello;"))
	if _, err := io.ReadFull(resp.Body, ack); err != nil || string(ack) != "ack:hello;" {
		t.Fatalf("first response bytes %q, %v", ack, err)
	}
	pw.Write([]byte("world"))
	pw.Close()
	rest, err := io.ReadAll(resp.Body)
	if err != nil || string(rest) != "rest:world" {
		t.Fatalf("rest %q, %v", rest, err)
	}
}

func TestServeKeepAliveOneConnectionEachSide(t *testing.T) {
	var hits atomic.Int32
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		echoHeaders(w, r)
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Length", strconv.Itoa(len(b)+len(r.URL.Path)))
		if r.Method == "HEAD" {
			return
		}
		w.Write([]byte(r.URL.Path))
		w.Write(b)
	}))
	c := e.client()
	for i := range 6 {
		method, body := "GET", ""
		switch i {
		case 2:
			method, body = "POST", "payload"
		case 4:
			method = "HEAD"
		}
		req, _ := http.NewRequest(method, fmt.Sprintf("https://%s/r%d", testHost, i), strings.NewReader(body))
		if body == "" {
			req.Body = nil
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		want := fmt.Sprintf("/r%d%s", i, body)
		if method == "HEAD" {
			if resp.ContentLength != int64(len(want)) || len(got) != 0 {
				t.Fatalf("HEAD: length %d, body %q", resp.ContentLength, got)
			}
			continue
		}
		if string(got) != want || resp.Header.Get("X-Got-Key") != "k-123" {
			t.Fatalf("request %d: %q, key %q", i, got, resp.Header.Get("X-Got-Key"))
		}
	}
	if e.accepted.Load() != 1 || e.upConns.Load() != 1 || e.dials.Load() != 1 || hits.Load() != 6 {
		t.Fatalf("client conns %d, upstream conns %d, dials %d, hits %d: want 1, 1, 1, 6",
			e.accepted.Load(), e.upConns.Load(), e.dials.Load(), hits.Load())
	}
}

func TestServeExpectContinue(t *testing.T) {
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Write(b)
	}))
	req, _ := http.NewRequest("PUT", "https://"+testHost+"/x", strings.NewReader("continued body"))
	req.Header.Set("Expect", "100-continue")
	start := time.Now()
	resp, err := e.client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(got) != "continued body" {
		t.Fatalf("got %q", got)
	}
	if el := time.Since(start); el > 4*time.Second {
		t.Fatalf("took %v: the 100 Continue was not relayed", el)
	}
}

func TestServeRefusesAnotherHost(t *testing.T) {
	var hits atomic.Int32
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1) })
	for _, tc := range []struct{ name, req string }{
		{"other host", "GET / HTTP/1.1\r\nHost: evil.example.net\r\n\r\n"},
		{"subdomain", "GET / HTTP/1.1\r\nHost: api.example.com\r\n\r\n"},
		{"absolute form", "GET https://evil.example.net/ HTTP/1.1\r\nHost: example.com\r\n\r\n"},
		{"no host", "GET / HTTP/1.1\r\n\r\n"},
		{"bad host", "GET / HTTP/1.1\r\nHost: example.com@evil\r\n\r\n"},
		{"bad port", "GET / HTTP/1.1\r\nHost: example.com: 0\r\n\r\n"},
		{"port not a number", "GET / HTTP/1.1\r\nHost: example.com:x\r\n\r\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, h)
			c, br, err := e.rawTLS()
			if err != nil {
				t.Fatal(err)
			}
			io.WriteString(c, tc.req)
			if resp := readResp(t, br, "GET"); resp.StatusCode != http.StatusMisdirectedRequest {
				t.Fatalf("status %d, want 421", resp.StatusCode)
			}
			if err := e.serveErr(); !errors.Is(err, errdefs.ErrDenied) {
				t.Fatalf("Serve: %v, want denied", err)
			}
			if _, err := br.ReadByte(); err == nil {
				t.Fatal("connection still open after 421")
			}
			if e.dials.Load() != 0 || e.upConns.Load() != 0 || hits.Load() != 0 {
				t.Fatalf("dials %d, upstream conns %d, hits %d: the refused request reached upstream", e.dials.Load(), e.upConns.Load(), hits.Load())
			}
		})
	}
	t.Run("second request on a good connection", func(t *testing.T) {
		e := newEnv(t, h)
		c, br, err := e.rawTLS()
		if err != nil {
			t.Fatal(err)
		}
		io.WriteString(c, "GET /a HTTP/1.1\r\nHost: EXAMPLE.com:443\r\n\r\n")
		if resp := readResp(t, br, "GET"); resp.StatusCode != 200 {
			t.Fatalf("first request: status %d", resp.StatusCode)
		}
		io.WriteString(c, "GET /b HTTP/1.1\r\nHost: evil.example.net\r\n\r\n")
		if resp := readResp(t, br, "GET"); resp.StatusCode != http.StatusMisdirectedRequest {
			t.Fatalf("second request: status %d, want 421", resp.StatusCode)
		}
		if err := e.serveErr(); !errors.Is(err, errdefs.ErrDenied) {
			t.Fatalf("Serve: %v, want denied", err)
		}
		if hits.Load() != 1 {
			t.Fatalf("upstream hits %d, want 1", hits.Load())
		}
	})
}

func TestServeNegotiatesHTTP1Only(t *testing.T) {
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	c, br, err := e.rawTLS("h2", "http/1.1")
	if err != nil {
		t.Fatal(err)
	}
	if p := c.ConnectionState().NegotiatedProtocol; p != "http/1.1" {
		t.Fatalf("negotiated %q, want http/1.1", p)
	}
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n")
	if resp := readResp(t, br, "GET"); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if err := e.serveErr(); err != nil {
		t.Fatalf("Serve: %v", err)
	}

	if _, _, err := e.rawTLS("h2"); err == nil {
		t.Fatal("a client offering only h2 completed the handshake")
	}
	if err := e.serveErr(); err == nil {
		t.Fatal("Serve accepted an h2-only client")
	}
}

func TestServeUpgradeThenRawBytes(t *testing.T) {
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "websocket" || r.Header.Get("X-Api-Key") != "k-123" {
			http.Error(w, "no upgrade", 400)
			return
		}
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		brw.Flush()
		for {
			line, err := brw.ReadString('\n')
			if err != nil {
				brw.WriteString("bye\n")
				brw.Flush()
				return
			}
			brw.WriteString("echo:" + line)
			brw.Flush()
		}
	}))
	c, br, err := e.rawTLS()
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(c, "GET /ws HTTP/1.1\r\nHost: example.com\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
	resp := readResp(t, br, "GET")
	if resp.StatusCode != http.StatusSwitchingProtocols || resp.Header.Get("Upgrade") != "websocket" {
		t.Fatalf("status %d, upgrade %q", resp.StatusCode, resp.Header.Get("Upgrade"))
	}
	for _, msg := range []string{"ping\n", "\x00\xff binary\n"} {
		io.WriteString(c, msg)
		got, err := br.ReadString('\n')
		if err != nil || got != "echo:"+msg {
			t.Fatalf("got %q, %v", got, err)
		}
	}
	c.CloseWrite() // the server sees EOF, says bye and closes
	rest, err := io.ReadAll(br)
	if err != nil || string(rest) != "bye\n" {
		t.Fatalf("after close: %q, %v", rest, err)
	}
	if err := e.serveErr(); err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

func TestServeEndsWithContext(t *testing.T) {
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	c, br, err := e.rawTLS()
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: example.com\r\n\r\n")
	if resp := readResp(t, br, "GET"); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	e.cancel() // the connection is idle between requests
	if err := e.serveErr(); !errors.Is(err, context.Canceled) {
		t.Fatalf("Serve: %v, want context canceled", err)
	}
}

// A trailer named like a transformed header does not reach the server;
// other trailers do.
func TestServeDropsTrailerNamedLikeATransform(t *testing.T) {
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		fmt.Fprintf(w, "auth=%q ok=%q header=%q", r.Trailer.Get("Authorization"), r.Trailer.Get("X-Ok"), r.Header.Get("Authorization"))
	}))
	req, _ := http.NewRequest("POST", "https://"+testHost+"/t", io.MultiReader(strings.NewReader("body")))
	req.Trailer = http.Header{"Authorization": {"Bearer from-the-sandbox"}, "X-Ok": {"yes"}}
	resp, err := e.client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := `auth="" ok="yes" header="Bearer platform-secret"`; string(got) != want {
		t.Fatalf("upstream saw %s, want %s", got, want)
	}
}

// An upstream that never stops sending 1xx is cut off.
// A final answer to a request that waits for 100 Continue ends the
// connection: the held-back body may never come.
// A server closing the idle upstream connection closes the client's, so
// the client's next request goes to a new connection instead of a 502.
// Bytes the server sends while no request is pending (a 408 before it
// closes) end both connections; they never reach the client.
func TestServeConcurrentClients(t *testing.T) {
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s %s", r.URL.Path, r.Header.Get("X-Api-Key"))
	}))
	errs := make(chan error, 8)
	for n := range 8 {
		go func() {
			cl := e.client()
			for i := range 3 {
				resp, err := cl.Get(fmt.Sprintf("https://%s/c%d/%d", testHost, n, i))
				if err != nil {
					errs <- err
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if want := fmt.Sprintf("/c%d/%d k-123", n, i); string(b) != want {
					errs <- fmt.Errorf("got %q, want %q", b, want)
					return
				}
			}
			errs <- nil
		}()
	}
	for range 8 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if e.accepted.Load() != 8 || e.upConns.Load() != 8 {
		t.Fatalf("client conns %d, upstream conns %d: want 8 each", e.accepted.Load(), e.upConns.Load())
	}
}
