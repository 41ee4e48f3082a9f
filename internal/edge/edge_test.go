package edge

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
)

func decodeErr(t *testing.T, res *http.Response) spacev1.Error {
	t.Helper()
	var e spacev1.Error
	if err := json.Unmarshal([]byte(readAll(t, res)), &e); err != nil {
		t.Fatalf("error body is not JSON: %v", err)
	}
	if e.Code != res.StatusCode {
		t.Fatalf("error code %d != status %d", e.Code, res.StatusCode)
	}
	return e
}

func TestForwardsWithCapabilityWithoutAccessToken(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	h.cp.tokens["sbx1"] = "secret-token"
	res := h.envd("POST", "sbx1", "/filesystem.Filesystem/ListDir?x=1", `{"path":"/"}`,
		spacev1.HeaderAccessToken, "secret-token",
		spacev1.HeaderCapability, "v4.public.forged",
		"Content-Type", "application/json")
	body := readAll(t, res)
	if res.StatusCode != 200 {
		t.Fatalf("status %d: %s", res.StatusCode, body)
	}
	calls := h.node.callsCopy()
	if len(calls) != 1 || calls[0].Outcome != "allow" {
		t.Fatalf("node calls: %+v", calls)
	}
	c := calls[0]
	if c.Header.Get(spacev1.HeaderAccessToken) != "" {
		t.Fatal("access token forwarded to node")
	}
	if c.Header.Get(spacev1.HeaderCapability) == "v4.public.forged" {
		t.Fatal("client-supplied capability forwarded")
	}
	if c.Query != "x=1" || c.Body != `{"path":"/"}` || c.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("request not forwarded intact: %+v", c)
	}
	cps := h.cp.callsCopy()
	if len(cps) != 1 || cps[0].Req.Repair || cps[0].AccessToken != "secret-token" || cps[0].APIKey != "edge-key" ||
		cps[0].Req.Purpose != "filesystem" {
		t.Fatalf("cp calls: %+v", cps)
	}
	// Second request is served from the cache.
	readAll(t, h.envd("POST", "sbx1", "/filesystem.Filesystem/Stat", `{}`, spacev1.HeaderAccessToken, "secret-token"))
	if n := len(h.cp.callsCopy()); n != 1 {
		t.Fatalf("expected cache hit, cp calls = %d", n)
	}
	// A different token is a different cache entry and is authorized anew.
	res = h.envd("POST", "sbx1", "/filesystem.Filesystem/Stat", `{}`, spacev1.HeaderAccessToken, "wrong")
	if res.StatusCode != 401 {
		t.Fatalf("wrong token: status %d", res.StatusCode)
	}
	if e := decodeErr(t, res); e.Message != "invalid access token" {
		t.Fatalf("message %q", e.Message)
	}
	// No token at all.
	res = h.envd("GET", "sbx1", "/health", "")
	if res.StatusCode != 401 {
		t.Fatalf("missing token: status %d", res.StatusCode)
	}
	readAll(t, res)
}

func TestPurposeMapping(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	// In a fixed order: /health shares the files capability, so it must
	// come after /files (it hits the cache and asks the control plane nothing).
	for _, c := range []struct{ path, want string }{
		{"/process.Process/List", "process"},
		{"/filesystem.Filesystem/Stat", "filesystem"},
		{"/files?path=/a", "files"},
		{"/health", "files"},
	} {
		path, want := c.path, c.want
		res := h.envd("POST", "sbx1", path, "{}")
		if res.StatusCode != 200 {
			t.Fatalf("%s: %d %s", path, res.StatusCode, readAll(t, res))
		}
		readAll(t, res)
		cps := h.cp.callsCopy()
		if got := cps[len(cps)-1].Req.Purpose; got != want {
			t.Fatalf("%s: purpose %q want %q", path, got, want)
		}
	}
}

func TestStreamingIsNotBuffered(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	next := make(chan struct{})
	h.node.handle("/process.Process/Start", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/connect+json")
		for i := 0; i < 3; i++ {
			_, _ = io.WriteString(w, "chunk\n")
			http.NewResponseController(w).Flush()
			select {
			case <-next:
			case <-r.Context().Done():
				return
			case <-time.After(5 * time.Second):
				return
			}
		}
	})
	res := h.envd("POST", "sbx1", "/process.Process/Start", "{}")
	defer res.Body.Close()
	br := bufio.NewReader(res.Body)
	for i := 0; i < 3; i++ {
		done := make(chan string, 1)
		go func() { l, _ := br.ReadString('\n'); done <- l }()
		select {
		case l := <-done:
			if l != "chunk\n" {
				t.Fatalf("chunk %d = %q", i, l)
			}
		case <-time.After(3 * time.Second):
			t.Fatalf("chunk %d not delivered before the next was produced: response is buffered", i)
		}
		next <- struct{}{}
	}
}

func TestRefreshRouteRepairsOnceAndResendsBody(t *testing.T) {
	h := newHarness(t)
	r1 := h.sandbox("sbx1")
	readAll(t, h.envd("POST", "sbx1", "/files?path=/x", "warmup"))
	// The sandbox moves: the node now holds generation 2.
	r2 := route("sbx1", 2)
	h.node.install(r2)
	h.cp.setRoute("sbx1", r2)
	before := h.cacheEntry("sbx1", capability.PurposeFiles, "")
	if before == nil || before.route != r1 {
		t.Fatal("expected cached r1")
	}
	res := h.envd("POST", "sbx1", "/files?path=/x", "payload-123")
	body := readAll(t, res)
	if res.StatusCode != 200 || !strings.Contains(body, r2.ExecutionLabel()) {
		t.Fatalf("status %d body %s", res.StatusCode, body)
	}
	calls := h.node.callsCopy()[1:]
	if len(calls) != 2 || calls[0].Outcome != "refresh" || calls[1].Outcome != "allow" || calls[1].Body != "payload-123" {
		t.Fatalf("node calls: %+v", calls)
	}
	if n := h.cp.repairs(); n != 1 {
		t.Fatalf("repairs = %d", n)
	}
	for _, c := range h.cp.callsCopy() {
		if c.Req.Repair && (c.AccessToken != "" || c.APIKey != "edge-key") {
			t.Fatalf("repair must use the edge key only: %+v", c)
		}
	}
	after := h.cacheEntry("sbx1", capability.PurposeFiles, "")
	if after.route != r2 {
		t.Fatalf("cache holds %v", after.route)
	}
	if !after.authorizedUntil.Equal(before.authorizedUntil) {
		t.Fatalf("repair changed AuthorizedUntil: %v -> %v", before.authorizedUntil, after.authorizedUntil)
	}
}

func TestSecondRefreshRouteIsReturned(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	readAll(t, h.envd("GET", "sbx1", "/health", ""))
	// The node holds gen 3; the control plane still selects gen 2.
	h.node.install(route("sbx1", 3))
	h.cp.setRoute("sbx1", route("sbx1", 2))
	res := h.envd("GET", "sbx1", "/health", "")
	readAll(t, res)
	if res.StatusCode != http.StatusMisdirectedRequest || res.Header.Get(spacev1.HeaderRouteOutcome) != spacev1.OutcomeRefreshRoute {
		t.Fatalf("status %d", res.StatusCode)
	}
	if n := len(h.node.callsCopy()); n != 3 {
		t.Fatalf("node calls = %d, want 3 (warmup, rejected, one rebuilt)", n)
	}
	if n := h.cp.repairs(); n != 1 {
		t.Fatalf("repairs = %d", n)
	}
}

func TestDenyIsFinal(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	h.node.denyAll = true
	res := h.envd("POST", "sbx1", "/process.Process/List", "{}")
	readAll(t, res)
	if res.StatusCode != 403 || res.Header.Get(spacev1.HeaderRouteOutcome) != spacev1.OutcomeDeny {
		t.Fatalf("status %d", res.StatusCode)
	}
	if h.cp.repairs() != 0 || len(h.node.callsCopy()) != 1 {
		t.Fatal("deny must not be repaired or retried")
	}
	m := scrape(t, h)
	if !strings.Contains(m, `space_edge_denies_total{purpose="process"} 1`) {
		t.Fatalf("deny metric missing:\n%s", m)
	}
}

func scrape(t *testing.T, h *harness) string {
	res, err := h.cl.Get(h.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	if res.StatusCode != 200 {
		t.Fatalf("metrics status %d", res.StatusCode)
	}
	return readAll(t, res)
}

func TestLateRefreshDoesNotEvictNewerEntry(t *testing.T) {
	h := newHarness(t)
	r1 := h.sandbox("sbx1")
	readAll(t, h.envd("GET", "sbx1", "/health", ""))
	old := h.cacheEntry("sbx1", capability.PurposeFiles, "")
	k := keyFor(target{sandbox: "sbx1", port: EnvdPort, purpose: capability.PurposeFiles}, "")
	// Another request already repaired the entry to gen 3.
	r3 := route("sbx1", 3)
	h.cp.setRoute("sbx1", r3)
	newer := &entry{route: r3, token: "t3", expires: old.expires, node: old.node, authorizedUntil: old.authorizedUntil}
	if !h.edge.replaceIf(k, old, newer) {
		t.Fatal("setup CAS failed")
	}
	// Now a delayed rejection for r1 arrives and repairs; the control plane
	// meanwhile answers gen 2 (a stale read). The newer entry must stay.
	h.cp.setRoute("sbx1", route("sbx1", 2))
	got, err := h.edge.repair(t.Context(), k, target{sandbox: "sbx1", port: EnvdPort, purpose: capability.PurposeFiles}, old)
	if err != nil {
		t.Fatal(err)
	}
	if got.route.Generation != 2 {
		t.Fatalf("repair result %v", got.route)
	}
	if cur := h.edge.load(k); cur != newer {
		t.Fatalf("late refresh for %v evicted newer entry; cache holds %v", r1, cur.route)
	}
	// A repair of the entry the cache actually holds replaces it.
	h.cp.setRoute("sbx1", route("sbx1", 4))
	if _, err := h.edge.repair(t.Context(), k, target{sandbox: "sbx1", port: EnvdPort, purpose: capability.PurposeFiles}, newer); err != nil {
		t.Fatal(err)
	}
	if cur := h.edge.load(k); cur.route.Generation != 4 || !cur.authorizedUntil.Equal(old.authorizedUntil) {
		t.Fatalf("cache holds %v until %v", cur.route, cur.authorizedUntil)
	}
}

func TestRenewalAndReauthorization(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	h.cp.tokens["sbx1"] = "tok"
	h.cp.authFor = 10 * time.Minute
	readAll(t, h.envd("GET", "sbx1", "/health", "", spacev1.HeaderAccessToken, "tok"))
	first := h.cacheEntry("sbx1", capability.PurposeFiles, "tok")
	// Close to the capability's expiry: renewed with the edge key; the
	// authorization bound is not extended even though the control plane
	// offers a later one.
	h.clock.Advance(capability.Lifetime - 10*time.Second)
	res := h.envd("GET", "sbx1", "/health", "", spacev1.HeaderAccessToken, "tok")
	if res.StatusCode != 200 {
		t.Fatalf("status %d %s", res.StatusCode, readAll(t, res))
	}
	readAll(t, res)
	cps := h.cp.callsCopy()
	if len(cps) != 2 || !cps[1].Req.Repair || cps[1].AccessToken != "" {
		t.Fatalf("expected one renewal with the edge key: %+v", cps)
	}
	renewed := h.cacheEntry("sbx1", capability.PurposeFiles, "tok")
	if renewed.token == first.token || !renewed.authorizedUntil.Equal(first.authorizedUntil) {
		t.Fatal("renewal must change the token and keep AuthorizedUntil")
	}
	// Past AuthorizedUntil: the caller is authorized again with its token.
	h.clock.Advance(10 * time.Minute)
	readAll(t, h.envd("GET", "sbx1", "/health", "", spacev1.HeaderAccessToken, "tok"))
	cps = h.cp.callsCopy()
	if len(cps) != 3 || cps[2].Req.Repair || cps[2].AccessToken != "tok" {
		t.Fatalf("expected re-authorization with the caller token: %+v", cps)
	}
	if got := h.cacheEntry("sbx1", capability.PurposeFiles, "tok").authorizedUntil; !got.After(first.authorizedUntil) {
		t.Fatal("re-authorization should set a new bound")
	}
}

func TestHostRoutingAndServicePorts(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	req, _ := http.NewRequest("GET", h.srv.URL+"/health", nil)
	req.Host = "49983-sbx1.localhost:8080"
	res, err := h.cl.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if res.StatusCode != 200 {
		t.Fatalf("host routing: %d %s", res.StatusCode, readAll(t, res))
	}
	readAll(t, res)
	req, _ = http.NewRequest("GET", h.srv.URL+"/app?q=1", nil)
	req.Host = "8080-sbx1.localhost"
	res, err = h.cl.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, res)
	if res.StatusCode != 200 {
		t.Fatalf("service port: %d", res.StatusCode)
	}
	cps := h.cp.callsCopy()
	last := cps[len(cps)-1].Req
	if last.Purpose != "service-port" || last.Port != 8080 || last.Protocol != "http" {
		t.Fatalf("capability request %+v", last)
	}
	calls := h.node.callsCopy()
	if c := calls[len(calls)-1]; c.Path != "/app" || c.Query != "q=1" {
		t.Fatalf("node call %+v", c)
	}
}

func TestWebSocketUpgradePassThrough(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	h.node.handle("/ws", func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		_, _ = brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
		_ = brw.Flush()
		line, _ := brw.ReadString('\n')
		_, _ = brw.WriteString("echo:" + line)
		_ = brw.Flush()
	})
	conn, err := net.Dial("tcp", h.srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	_, _ = io.WriteString(conn, "GET /ws HTTP/1.1\r\nHost: 3000-sbx1.localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
	br := bufio.NewReader(conn)
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.StatusCode != 101 {
		t.Fatalf("status %d", res.StatusCode)
	}
	_, _ = io.WriteString(conn, "hello\n")
	line, err := br.ReadString('\n')
	if err != nil || line != "echo:hello\n" {
		t.Fatalf("got %q %v", line, err)
	}
	cps := h.cp.callsCopy()
	if last := cps[len(cps)-1].Req; last.Protocol != "ws" || last.Port != 3000 {
		t.Fatalf("capability request %+v", last)
	}
}

func TestTransportRetryOnlyForIdempotentReads(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	fail := map[string]int{"/files": 1, "/process.Process/Start": 1}
	for p := range fail {
		p := p
		h.node.handle(p, func(w http.ResponseWriter, r *http.Request) {
			h.node.mu.Lock()
			n := fail[p]
			fail[p]--
			h.node.mu.Unlock()
			if n > 0 {
				conn, _, err := http.NewResponseController(w).Hijack()
				if err == nil {
					conn.Close() // transport failure: no response
				}
				return
			}
			_, _ = io.WriteString(w, "ok")
		})
	}
	res := h.envd("GET", "sbx1", "/files?path=/a", "")
	if body := readAll(t, res); res.StatusCode != 200 || body != "ok" {
		t.Fatalf("GET /files after one transport failure: %d %s", res.StatusCode, body)
	}
	res = h.envd("POST", "sbx1", "/process.Process/Start", "{}")
	if res.StatusCode != http.StatusBadGateway {
		t.Fatalf("process start must not be retried: %d", res.StatusCode)
	}
	if e := decodeErr(t, res); e.Reason != "node_unreachable" {
		t.Fatalf("reason %q", e.Reason)
	}
}

func TestLargeBodyStreamsAndIsNotRebuilt(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MaxBufferedBody = 8 })
	h.sandbox("sbx1")
	readAll(t, h.envd("GET", "sbx1", "/health", ""))
	h.node.install(route("sbx1", 2))
	h.cp.setRoute("sbx1", route("sbx1", 2))
	res := h.envd("POST", "sbx1", "/files?path=/big", strings.Repeat("x", 100))
	readAll(t, res)
	if res.StatusCode != http.StatusMisdirectedRequest {
		t.Fatalf("status %d", res.StatusCode)
	}
	if h.cp.repairs() != 0 {
		t.Fatal("a streamed body must not get a rebuilt attempt")
	}
	// The stale entry was dropped: the next request resolves the new route.
	res = h.envd("POST", "sbx1", "/files?path=/big", strings.Repeat("y", 100))
	if body := readAll(t, res); res.StatusCode != 200 || !strings.Contains(body, strings.Repeat("y", 100)) {
		t.Fatalf("status %d %s", res.StatusCode, body)
	}
}

func TestBadInput(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	do := func(hdr map[string]string, host, path string) *http.Response {
		req, _ := http.NewRequest("GET", h.srv.URL+path, nil)
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		if host != "" {
			req.Host = host
		}
		res, err := h.cl.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	cases := []struct {
		name   string
		hdr    map[string]string
		host   string
		path   string
		status int
	}{
		{"bad id", map[string]string{HeaderSandboxID: "BAD_ID!", HeaderSandboxPort: "49983"}, "", "/health", 400},
		{"missing port", map[string]string{HeaderSandboxID: "sbx1"}, "", "/health", 400},
		{"port not a number", map[string]string{HeaderSandboxID: "sbx1", HeaderSandboxPort: "x"}, "", "/health", 400},
		{"port zero", map[string]string{HeaderSandboxID: "sbx1", HeaderSandboxPort: "0"}, "", "/health", 400},
		{"port too big", map[string]string{HeaderSandboxID: "sbx1", HeaderSandboxPort: "70000"}, "", "/health", 400},
		{"unknown envd path", map[string]string{HeaderSandboxID: "sbx1", HeaderSandboxPort: "49983"}, "", "/init", 404},
		{"bad host", nil, "nonsense.localhost", "/", 400},
		{"bad host port", nil, "99999-sbx1.localhost", "/", 400},
		{"unknown sandbox (502 as E2B)", map[string]string{HeaderSandboxID: "nope", HeaderSandboxPort: "49983"}, "", "/health", 502},
		{"no sandbox", nil, "", "/anything", 400},
	}
	for _, c := range cases {
		res := do(c.hdr, c.host, c.path)
		if res.StatusCode != c.status {
			t.Errorf("%s: status %d want %d", c.name, res.StatusCode, c.status)
		}
		decodeErr(t, res)
	}
	// /metrics is only the edge's own when no sandbox is addressed.
	res := do(map[string]string{HeaderSandboxID: "sbx1", HeaderSandboxPort: "49983"}, "", "/metrics")
	readAll(t, res)
	if res.StatusCode != 404 {
		t.Fatalf("sandbox /metrics must not reach the edge's metrics: %d", res.StatusCode)
	}
	if m := scrape(t, h); !strings.Contains(m, "space_edge_requests_total") {
		t.Fatal("metrics missing")
	}
}

func TestControlPlaneFailures(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	h.cp.status = 500
	res := h.envd("GET", "sbx1", "/health", "")
	if res.StatusCode != 502 {
		t.Fatalf("cp 500: %d", res.StatusCode)
	}
	decodeErr(t, res)
	h.cp.status = 403
	res = h.envd("GET", "sbx1", "/health", "")
	if res.StatusCode != 403 {
		t.Fatalf("cp 403: %d", res.StatusCode)
	}
	decodeErr(t, res)
	h.cp.srv.Close()
	res = h.envd("GET", "sbx1", "/health", "")
	if res.StatusCode != 503 {
		t.Fatalf("cp down: %d", res.StatusCode)
	}
	if e := decodeErr(t, res); e.Reason != "control_plane_unavailable" {
		t.Fatalf("reason %q", e.Reason)
	}
}

func TestConfigValidate(t *testing.T) {
	if err := (Config{}).Validate(); err == nil {
		t.Fatal("empty config must fail")
	}
	if err := (Config{ControlPlaneURL: "ftp://x", EdgeKey: "k"}).Validate(); err == nil {
		t.Fatal("bad URL must fail")
	}
	if err := (Config{ControlPlaneURL: "http://x", EdgeKey: "k", MaxBufferedBody: -1}).Validate(); err == nil {
		t.Fatal("negative body limit must fail")
	}
	if err := (Config{ControlPlaneURL: "http://x", EdgeKey: "k"}).Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestRunAndClose(t *testing.T) {
	e, err := New(Config{ControlPlaneURL: "http://127.0.0.1:1", EdgeKey: "k", Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	time.Sleep(50 * time.Millisecond)
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return")
	}
	_ = e.Close()
}

func TestConcurrentMissesAreCoalesced(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	h.cp.delay = 100 * time.Millisecond
	var wg sync.WaitGroup
	codes := make(chan int, 20)
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("GET", h.srv.URL+"/health", nil)
			req.Header.Set(HeaderSandboxID, "sbx1")
			req.Header.Set(HeaderSandboxPort, "49983")
			res, err := h.cl.Do(req)
			if err != nil {
				codes <- 0
				return
			}
			io.Copy(io.Discard, res.Body)
			res.Body.Close()
			codes <- res.StatusCode
		}()
	}
	wg.Wait()
	close(codes)
	for c := range codes {
		if c != 200 {
			t.Fatalf("status %d", c)
		}
	}
	if n := len(h.cp.callsCopy()); n != 1 {
		t.Fatalf("control plane calls = %d, want 1", n)
	}
}

// A paused sandbox is answered as E2B's proxy does: 502 (the e2b SDK's
// isRunning() is false on it), with reason "paused", whether the control
// plane refused the capability or node-api refused the frozen execution.
// Other conflicts pass unchanged.
func TestPausedSandboxIs502(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbxa")
	check := func(what string, wantStatus int, wantReason string) {
		t.Helper()
		res := h.envd("GET", "sbxa", "/health", "")
		body := readAll(t, res)
		var e spacev1.Error
		if err := json.Unmarshal([]byte(body), &e); err != nil {
			t.Fatalf("%s: body %q", what, body)
		}
		if res.StatusCode != wantStatus || e.Reason != wantReason {
			t.Fatalf("%s: %d %q, want %d %q", what, res.StatusCode, body, wantStatus, wantReason)
		}
	}
	// The control plane refuses a capability: paused.
	h.cp.mu.Lock()
	h.cp.status, h.cp.reason = http.StatusConflict, spacev1.ReasonPaused
	h.cp.mu.Unlock()
	check("control plane paused", http.StatusBadGateway, spacev1.ReasonPaused)
	// Another conflict from the control plane stays a 409.
	h.cp.mu.Lock()
	h.cp.reason = "conflict"
	h.cp.mu.Unlock()
	check("control plane conflict", http.StatusConflict, "conflict")
	h.cp.mu.Lock()
	h.cp.status, h.cp.reason = 0, ""
	h.cp.mu.Unlock()

	// node-api refuses: the execution is frozen.
	reason := spacev1.ReasonPaused
	h.node.handle("/health", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusConflict)
		_ = json.NewEncoder(w).Encode(spacev1.Error{Code: 409, Message: "frozen", Reason: reason})
	})
	check("node paused", http.StatusBadGateway, spacev1.ReasonPaused)
	reason = "busy"
	check("node conflict", http.StatusConflict, "busy")
}

// A route whose node cannot be reached (a worker gone, or restarted on
// another address) is dropped from the cache: the next request asks the
// control plane again instead of dialing it until its capability expires.
func TestUnreachableNodeDropsTheCachedRoute(t *testing.T) {
	h := newHarness(t)
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := dead.URL
	dead.Close()
	h.cp.mu.Lock()
	h.cp.nodeURL = deadURL
	h.cp.mu.Unlock()
	h.sandbox("sbx1")
	h.node.handle("/files", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	res := h.envd("GET", "sbx1", "/files?path=/a", "")
	if res.StatusCode != http.StatusBadGateway {
		t.Fatalf("GET through a dead node: %d %s", res.StatusCode, readAll(t, res))
	}
	if e := decodeErr(t, res); e.Reason != "node_unreachable" {
		t.Fatalf("reason %q", e.Reason)
	}
	h.cp.mu.Lock()
	h.cp.nodeURL = h.node.srv.URL
	h.cp.mu.Unlock()
	res = h.envd("GET", "sbx1", "/files?path=/a", "")
	if body := readAll(t, res); res.StatusCode != http.StatusOK || body != "ok" {
		t.Fatalf("GET after the node moved: %d %s (the dead route stayed cached)", res.StatusCode, body)
	}
}
