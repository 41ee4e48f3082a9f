package edge

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/testenv"
)

// serveEdge serves h.edge with HTTPServer (the settings Serve uses) on a
// loopback listener and returns its address. Cleanup waits for every
// connection to be closed: net/http lingers up to 500 ms on a connection
// whose body it did not read.
func serveEdge(t *testing.T, h *harness) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var live atomic.Int64
	srv := h.edge.HTTPServer()
	srv.ConnState = func(_ net.Conn, s http.ConnState) {
		switch s {
		case http.StateNew:
			live.Add(1)
		case http.StateClosed, http.StateHijacked:
			live.Add(-1)
		}
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		_ = srv.Close()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("serve: %v", err)
		}
		end := time.Now().Add(5 * time.Second)
		for live.Load() > 0 && time.Now().Before(end) {
			time.Sleep(10 * time.Millisecond)
		}
	})
	return ln.Addr().String()
}

// rawPost opens a connection and sends the head of a POST with the given
// Content-Length (-1: chunked) and the first bytes of its body, then
// leaves the body unfinished.
func rawPost(addr, sandbox, path, token string, contentLength int64, first []byte) (net.Conn, error) {
	var c net.Conn
	var err error
	for range 5 { // 1,000 simultaneous dials may briefly overrun the backlog
		if c, err = net.DialTimeout("tcp", addr, 5*time.Second); err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		return nil, err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "POST %s HTTP/1.1\r\nHost: edge.test\r\n%s: %s\r\n%s: 49983\r\n", path, HeaderSandboxID, sandbox, HeaderSandboxPort)
	if token != "" {
		fmt.Fprintf(&b, "%s: %s\r\n", spacev1.HeaderAccessToken, token)
	}
	if contentLength >= 0 {
		fmt.Fprintf(&b, "Content-Length: %d\r\n", contentLength)
	} else {
		b.WriteString("Transfer-Encoding: chunked\r\n")
	}
	b.WriteString("Content-Type: application/octet-stream\r\n\r\n")
	_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, b.String()); err != nil {
		c.Close()
		return nil, err
	}
	if len(first) > 0 {
		// The edge may not read it (that is the point): a write that
		// fills the socket buffers is the stall.
		_ = c.SetWriteDeadline(time.Now().Add(2 * time.Second))
		_, _ = c.Write(first)
	}
	_ = c.SetWriteDeadline(time.Time{})
	return c, nil
}

func readRawResponse(c net.Conn, within time.Duration) (*http.Response, []byte, error) {
	_ = c.SetReadDeadline(time.Now().Add(within))
	res, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return nil, nil, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return res, b, err
}

func rssBytes(t *testing.T) uint64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		testenv.Skipf(t, "no /proc/self/status: %v", err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseUint(f[1], 10, 64)
			return kb << 10
		}
	}
	testenv.Skipf(t, "no VmRSS")
	return 0
}

func heapInuse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

func metricsText(t *testing.T, addr string) string {
	t.Helper()
	res, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	http.DefaultClient.CloseIdleConnections()
	return string(b)
}

// waitFor polls cond for up to d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(d)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The issue-11 attack: 1,000 connections each declare a 16 MiB upload to a
// sandbox that does not exist or with a wrong token, send 256 KiB and
// stall. Every one is held in authorization (the control plane is slow) at
// the moment memory is measured, so an edge that buffered before
// authorizing would hold ~256 MiB (and up to 16 GiB had they sent it all).
func TestUnauthenticatedStalledUploadsAreNotBuffered(t *testing.T) {
	if testing.Short() {
		testenv.Skipf(t, "1,000 connections")
	}
	const conns = 1000
	const sent = 256 << 10
	h := newHarness(t)
	h.sandbox("sbx1")
	h.cp.tokens["sbx1"] = "secret"
	addr := serveEdge(t, h)

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	normal := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	normalReq := func(body string) error {
		req, _ := http.NewRequest("POST", "http://"+addr+"/files?path=/ok", strings.NewReader(body))
		req.Header.Set(HeaderSandboxID, "sbx1")
		req.Header.Set(HeaderSandboxPort, "49983")
		req.Header.Set(spacev1.HeaderAccessToken, "secret")
		res, err := normal.Do(req)
		if err != nil {
			return err
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		if res.StatusCode != 200 || !strings.Contains(string(b), body) {
			return fmt.Errorf("status %d: %.200s", res.StatusCode, b)
		}
		return nil
	}
	if err := normalReq("warm"); err != nil { // authorizes and caches
		t.Fatal(err)
	}
	warmCalls := len(h.cp.callsCopy())

	// Authorizations are held until memory is measured (the edge itself
	// gives up on the control plane after DefaultControlPlaneTimeout).
	gate := make(chan struct{})
	var openGate sync.Once
	release := func() { openGate.Do(func() { close(gate) }) }
	defer release()
	h.cp.mu.Lock()
	h.cp.gate = gate
	h.cp.mu.Unlock()
	heap0, rss0 := heapInuse(), rssBytes(t)

	prefix := bytes.Repeat([]byte("A"), sent)
	var answered, notFound, unauthorized atomic.Int64
	var connsMu sync.Mutex
	var open []net.Conn
	var wg, sentWG sync.WaitGroup
	errs := make(chan error, conns)
	for i := range conns {
		wg.Add(1)
		sentWG.Add(1)
		go func() {
			defer wg.Done()
			sb, tok, want := fmt.Sprintf("nosuch%d", i), "", http.StatusBadGateway
			if i%2 == 1 {
				sb, tok, want = "sbx1", fmt.Sprintf("wrong%d", i), http.StatusUnauthorized
			}
			c, err := rawPost(addr, sb, "/files?path=/big", tok, 16<<20, prefix)
			sentWG.Done()
			if err != nil {
				errs <- err
				return
			}
			connsMu.Lock()
			open = append(open, c)
			connsMu.Unlock()
			res, _, err := readRawResponse(c, 60*time.Second)
			if err != nil {
				errs <- fmt.Errorf("conn %d: %w", i, err)
				return
			}
			answered.Add(1)
			if res.StatusCode != want {
				errs <- fmt.Errorf("conn %d: status %d, want %d", i, res.StatusCode, want)
				return
			}
			if want == http.StatusBadGateway {
				notFound.Add(1)
			} else {
				unauthorized.Add(1)
			}
		}()
	}
	defer func() {
		connsMu.Lock()
		for _, c := range open {
			c.Close()
		}
		connsMu.Unlock()
	}()

	// All 1,000 have sent what they will send, and are being authorized
	// (an edge that read bodies first would still be reading them).
	sentWG.Wait()
	inFlight := func() bool { return len(h.cp.callsCopy())-warmCalls >= conns }
	for end := time.Now().Add(10 * time.Second); !inFlight() && time.Now().Before(end); {
		time.Sleep(10 * time.Millisecond)
	}
	var peakHeap, peakRSS uint64
	for range 3 {
		peakHeap = max(peakHeap, heapInuse())
		peakRSS = max(peakRSS, rssBytes(t))
		// A normal, authorized client is served meanwhile (its route is
		// cached; its body is held under the budget).
		if err := normalReq(strings.Repeat("n", 4<<10)); err != nil {
			t.Fatalf("normal request during the flood: %v", err)
		}
	}
	growth := int64(peakHeap) - int64(heap0)
	rssGrowth := int64(peakRSS) - int64(rss0)
	t.Logf("%d stalled unauthenticated uploads (%d KiB sent each, 16 MiB declared): heap in use %d -> %d MiB (growth %d MiB), RSS %d -> %d MiB (growth %d MiB)",
		conns, sent>>10, heap0>>20, peakHeap>>20, growth>>20, rss0>>20, peakRSS>>20, rssGrowth>>20)
	if growth > 100<<20 {
		t.Fatalf("heap in use grew %d MiB under %d stalled unauthenticated uploads", growth>>20, conns)
	}
	if rssGrowth > 300<<20 && !raceEnabled {
		t.Fatalf("RSS grew %d MiB under %d stalled unauthenticated uploads", rssGrowth>>20, conns)
	}
	if !inFlight() {
		t.Fatalf("only %d of %d uploads reached authorization", len(h.cp.callsCopy())-warmCalls, conns)
	}
	// A few may be answered early on a loaded machine (a client's own
	// deadline); the measurement holds while nearly all are in flight.
	if n := answered.Load(); n > conns/20 {
		t.Fatalf("%d uploads answered before the measurement: the flood was not in flight", n)
	}
	release()

	wg.Wait()
	close(errs)
	var failed []error
	for err := range errs {
		failed = append(failed, err)
	}
	if len(failed) > 0 {
		t.Fatalf("%d of %d attackers not answered as expected; first: %v", len(failed), conns, failed[0])
	}
	if notFound.Load() != conns/2 || unauthorized.Load() != conns/2 {
		t.Fatalf("answers: %d not found, %d unauthorized", notFound.Load(), unauthorized.Load())
	}
	for _, c := range h.node.callsCopy() {
		if c.Path == "/files" && strings.Contains(c.Query, "big") {
			t.Fatal("an unauthenticated upload reached the node")
		}
	}
	if u := h.edge.budget.used.Load(); u != 0 {
		t.Fatalf("budget in use after the flood: %d", u)
	}
	if err := normalReq("after"); err != nil {
		t.Fatal(err)
	}
}

func TestBodyBudgetExhaustedIs503(t *testing.T) {
	const limit = 64 << 10
	h := newHarness(t, func(c *Config) { c.MaxBufferedBody = limit; c.BufferedBodyBudget = limit })
	h.sandbox("sbx1")
	h.cp.tokens["sbx1"] = "secret"
	addr := serveEdge(t, h)

	// An authorized upload reserves the whole budget and is slow to finish.
	c1, err := rawPost(addr, "sbx1", "/files?path=/slow", "secret", limit, bytes.Repeat([]byte("s"), 1<<10))
	if err != nil {
		t.Fatal(err)
	}
	defer c1.Close()
	waitFor(t, 5*time.Second, "the budget to be reserved", func() bool { return h.edge.budget.used.Load() == limit })

	res := h.envdAt(addr, "POST", "sbx1", "/files?path=/small", "tiny", spacev1.HeaderAccessToken, "secret")
	if res.StatusCode != http.StatusServiceUnavailable || res.Header.Get("Retry-After") == "" {
		t.Fatalf("over budget: status %d, Retry-After %q", res.StatusCode, res.Header.Get("Retry-After"))
	}
	if e := decodeErr(t, res); e.Reason != "body_budget_exhausted" {
		t.Fatalf("reason %q", e.Reason)
	}
	// A request without a body needs no budget.
	res = h.envdAt(addr, "GET", "sbx1", "/health", "", spacev1.HeaderAccessToken, "secret")
	if res.StatusCode != 200 {
		t.Fatalf("bodiless request while the budget is in use: %d", res.StatusCode)
	}
	readAll(t, res)

	// The slow upload completes; its reservation is returned.
	if _, err := c1.Write(bytes.Repeat([]byte("s"), limit-1<<10)); err != nil {
		t.Fatal(err)
	}
	r1, body, err := readRawResponse(c1, 5*time.Second)
	if err != nil || r1.StatusCode != 200 {
		t.Fatalf("slow upload: %v %v %.200s", err, r1, body)
	}
	waitFor(t, 5*time.Second, "the budget to be released", func() bool { return h.edge.budget.used.Load() == 0 })
	res = h.envdAt(addr, "POST", "sbx1", "/files?path=/small", "tiny", spacev1.HeaderAccessToken, "secret")
	if b := readAll(t, res); res.StatusCode != 200 {
		t.Fatalf("after release: %d %s", res.StatusCode, b)
	}
	if m := metricsText(t, addr); !strings.Contains(m, `space_edge_body_rejections_total{reason="budget"} 1`) {
		t.Fatalf("budget rejection not counted:\n%s", grepLines(m, "space_edge_body"))
	}
}

// A body of unknown length reserves budget as it grows; it too is refused
// when none is left.
func TestChunkedBodyOverBudgetIs503(t *testing.T) {
	const limit = 64 << 10
	h := newHarness(t, func(c *Config) { c.MaxBufferedBody = limit; c.BufferedBodyBudget = limit })
	h.sandbox("sbx1")
	addr := serveEdge(t, h)
	c1, err := rawPost(addr, "sbx1", "/files?path=/slow", "", limit, []byte("x"))
	if err != nil {
		t.Fatal(err)
	}
	defer c1.Close()
	waitFor(t, 5*time.Second, "the budget to be reserved", func() bool { return h.edge.budget.used.Load() == limit })
	c2, err := rawPost(addr, "sbx1", "/files?path=/chunked", "", -1, []byte("4\r\nabcd\r\n"))
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	res, body, err := readRawResponse(c2, 5*time.Second)
	if err != nil || res.StatusCode != http.StatusServiceUnavailable || res.Header.Get("Retry-After") == "" {
		t.Fatalf("chunked over budget: %v %v %s", err, res, body)
	}
}

// A chunked body within the limit is held (so it can be resent), and its
// reservation is returned.
func TestChunkedBodyIsHeld(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	readAll(t, h.envd("GET", "sbx1", "/health", ""))
	h.node.install(route("sbx1", 2))
	h.cp.setRoute("sbx1", route("sbx1", 2))
	body := strings.Repeat("c", 100<<10)
	req, _ := http.NewRequest("POST", h.srv.URL+"/files?path=/c", io.MultiReader(strings.NewReader(body))) // unknown length
	req.Header.Set(HeaderSandboxID, "sbx1")
	req.Header.Set(HeaderSandboxPort, "49983")
	res, err := h.cl.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, res); res.StatusCode != 200 || !strings.Contains(got, body) {
		t.Fatalf("status %d", res.StatusCode)
	}
	if h.cp.repairs() != 1 {
		t.Fatalf("repairs %d: a held chunked body gets its rebuilt attempt", h.cp.repairs())
	}
	if u := h.edge.budget.used.Load(); u != 0 {
		t.Fatalf("budget in use after the request: %d", u)
	}
}

func TestStalledAuthorizedBodyIsCut(t *testing.T) {
	const idle = 300 * time.Millisecond
	h := newHarness(t, func(c *Config) { c.BodyIdleTimeout = idle })
	h.sandbox("sbx1")
	addr := serveEdge(t, h)
	start := time.Now()
	c, err := rawPost(addr, "sbx1", "/files?path=/stall", "", 64<<10, bytes.Repeat([]byte("s"), 1<<10))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	res, body, err := readRawResponse(c, 5*time.Second)
	if err != nil {
		t.Fatalf("stalled body not answered: %v", err)
	}
	if el := time.Since(start); el < idle {
		t.Fatalf("cut after %v, before the idle timeout", el)
	}
	if res.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(body), "body_timeout") {
		t.Fatalf("status %d %s", res.StatusCode, body)
	}
	if len(h.node.callsCopy()) != 0 {
		t.Fatal("an incomplete body was forwarded")
	}
	waitFor(t, 5*time.Second, "the budget to be released", func() bool { return h.edge.budget.used.Load() == 0 })
	if m := metricsText(t, addr); !strings.Contains(m, `space_edge_body_rejections_total{reason="timeout"} 1`) {
		t.Fatalf("timeout not counted:\n%s", grepLines(m, "space_edge_body"))
	}
}

// Progress alone is not enough for a held body: a client trickling bytes
// under the idle timeout is cut at BodyReadTimeout.
func TestTricklingBodyIsCut(t *testing.T) {
	const total = 600 * time.Millisecond
	h := newHarness(t, func(c *Config) { c.BodyIdleTimeout = 400 * time.Millisecond; c.BodyReadTimeout = total })
	h.sandbox("sbx1")
	addr := serveEdge(t, h)
	start := time.Now()
	c, err := rawPost(addr, "sbx1", "/files?path=/trickle", "", 64<<10, []byte("t"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	stop := make(chan struct{})
	trickled := make(chan struct{})
	go func() {
		defer close(trickled)
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
				if _, err := c.Write([]byte("t")); err != nil {
					return
				}
			}
		}
	}()
	res, body, err := readRawResponse(c, 5*time.Second)
	close(stop)
	<-trickled
	if err != nil {
		t.Fatalf("trickling body not answered: %v", err)
	}
	el := time.Since(start)
	if res.StatusCode != http.StatusRequestTimeout || el < total || el > 3*time.Second {
		t.Fatalf("status %d after %v: %s", res.StatusCode, el, body)
	}
}

// A body too large to hold streams to the node; stalling it mid-way is cut
// by the idle timeout as well.
func TestStalledStreamedBodyIsCut(t *testing.T) {
	const idle = 300 * time.Millisecond
	h := newHarness(t, func(c *Config) { c.BodyIdleTimeout = idle; c.MaxBufferedBody = 1 << 10 })
	h.sandbox("sbx1")
	addr := serveEdge(t, h)
	c, err := rawPost(addr, "sbx1", "/files?path=/stream", "", 64<<10, bytes.Repeat([]byte("s"), 2<<10))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = io.Copy(io.Discard, c) // an answer (if any) and then the close
	if err != nil {
		t.Fatalf("connection not closed after the stall: %v", err)
	}
	if el := time.Since(start); el > 3*time.Second {
		t.Fatalf("closed after %v", el)
	}
	if u := h.edge.budget.used.Load(); u != 0 {
		t.Fatalf("a streamed body reserved budget: %d", u)
	}
	if m := metricsText(t, addr); !strings.Contains(m, `space_edge_body_rejections_total{reason="timeout"} 1`) {
		t.Fatalf("timeout not counted:\n%s", grepLines(m, "space_edge_body"))
	}
}

// Bodies over MaxBufferedBody are not refused (uploads of any size work):
// they stream to the node and take no budget.
func TestOversizedBodyStreamsWithoutBudget(t *testing.T) {
	const limit = 4 << 10
	h := newHarness(t, func(c *Config) { c.MaxBufferedBody = limit; c.BufferedBodyBudget = limit })
	h.sandbox("sbx1")
	var usedAtNode atomic.Int64
	usedAtNode.Store(-1)
	h.node.handle("/files", func(w http.ResponseWriter, r *http.Request) {
		usedAtNode.Store(h.edge.budget.used.Load())
		b, _ := io.ReadAll(r.Body)
		_, _ = io.WriteString(w, strconv.Itoa(len(b)))
	})
	body := strings.Repeat("o", 1<<20)
	res := h.envd("POST", "sbx1", "/files?path=/big", body)
	if got := readAll(t, res); res.StatusCode != 200 || got != strconv.Itoa(len(body)) {
		t.Fatalf("status %d %q", res.StatusCode, got)
	}
	if u := usedAtNode.Load(); u != 0 {
		t.Fatalf("budget in use while streaming: %d", u)
	}
}

// A request refused before its body is read (here: wrong token) with a
// small, stalled body is answered and its connection closed promptly:
// net/http's drain of the unread body is bounded.
func TestRefusedStalledBodyIsNotDrainedForever(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	h.cp.tokens["sbx1"] = "secret"
	addr := serveEdge(t, h)
	c, err := rawPost(addr, "sbx1", "/files?path=/x", "wrong", 10<<10, []byte("x"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	res, _, err := readRawResponse(c, 10*time.Second)
	if err != nil || res.StatusCode != http.StatusUnauthorized {
		t.Fatalf("%v %v", err, res)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("connection not closed: %v", err)
	}
	if el := time.Since(start); el > rejectDrainTimeout+2*time.Second {
		t.Fatalf("answered and closed after %v", el)
	}
}

func TestServerHeaderLimits(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.ReadHeaderTimeout = 300 * time.Millisecond; c.MaxHeaderBytes = 4 << 10 })
	srv := h.edge.HTTPServer()
	if srv.ReadHeaderTimeout != 300*time.Millisecond || srv.MaxHeaderBytes != 4<<10 || srv.IdleTimeout != DefaultIdleTimeout {
		t.Fatalf("server limits: %v %v %v", srv.ReadHeaderTimeout, srv.MaxHeaderBytes, srv.IdleTimeout)
	}
	addr := serveEdge(t, h)

	// Headers that never finish: the connection is closed.
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = io.WriteString(c, "POST /files HTTP/1.1\r\nHost: x\r\n")
	start := time.Now()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("stalled headers not cut: %v", err)
	}
	if el := time.Since(start); el > 3*time.Second {
		t.Fatalf("stalled headers cut after %v", el)
	}

	// Oversized headers: 431.
	req, _ := http.NewRequest("GET", "http://"+addr+"/healthz", nil)
	req.Header.Set("X-Big", strings.Repeat("h", 64<<10))
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	res, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("oversized headers: %d", res.StatusCode)
	}
}

func TestBodyConfigValidate(t *testing.T) {
	base := Config{ControlPlaneURL: "http://x", EdgeKey: "k"}
	for name, mod := range map[string]func(*Config){
		"budget below per-request limit": func(c *Config) { c.MaxBufferedBody = 2 << 20; c.BufferedBodyBudget = 1 << 20 },
		"negative budget":                func(c *Config) { c.BufferedBodyBudget = -1 },
		"negative idle timeout":          func(c *Config) { c.BodyIdleTimeout = -1 },
		"negative body timeout":          func(c *Config) { c.BodyReadTimeout = -1 },
		"negative header timeout":        func(c *Config) { c.ReadHeaderTimeout = -1 },
		"negative max header bytes":      func(c *Config) { c.MaxHeaderBytes = -1 },
	} {
		c := base
		mod(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	c := base.withDefaults()
	if c.BufferedBodyBudget != DefaultBufferedBodyBudget || c.BodyIdleTimeout != DefaultBodyIdleTimeout ||
		c.BodyReadTimeout != DefaultBodyReadTimeout || c.ReadHeaderTimeout != DefaultReadHeaderTimeout ||
		c.MaxHeaderBytes != DefaultMaxHeaderBytes {
		t.Fatalf("defaults: %+v", c)
	}
}

// envdAt sends an envd request to the edge served at addr.
func (h *harness) envdAt(addr, method, sb, path, body string, hdr ...string) *http.Response {
	h.t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, "http://"+addr+path, rd)
	if err != nil {
		h.t.Fatal(err)
	}
	req.Header.Set(HeaderSandboxID, sb)
	req.Header.Set(HeaderSandboxPort, "49983")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	res, err := h.cl.Do(req)
	if err != nil {
		h.t.Fatal(err)
	}
	return res
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
