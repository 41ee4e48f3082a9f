package edge

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/identity"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type clock struct{ ns atomic.Int64 }

func newClock() *clock {
	c := &clock{}
	c.ns.Store(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	return c
}
func (c *clock) Now() time.Time          { return time.Unix(0, c.ns.Load()).UTC() }
func (c *clock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

func route(sb string, gen uint64) identity.Route {
	return identity.Route{SandboxID: sb, Generation: gen, ExecutionID: fmt.Sprintf("exec%d", gen),
		WorkerID: "w1", Substrate: identity.SubstrateNS, ActivationID: fmt.Sprintf("act%d", gen)}
}

// cpCall records one capability request seen by the fake control plane.
type cpCall struct {
	Sandbox     string
	Req         spacev1.CapabilityRequest
	APIKey      string
	AccessToken string
	Query       url.Values
}

// fakeCP is a control plane that issues real capabilities for the route it
// currently selects per sandbox.
type fakeCP struct {
	t      *testing.T
	signer *capability.Signer
	clock  *clock
	srv    *httptest.Server

	mu       sync.Mutex
	routes   map[string]identity.Route
	tokens   map[string]string // sandbox -> required access token ("" = not secure)
	nodeURL  string
	authFor  time.Duration // AuthorizedUntil = now + authFor
	calls    []cpCall
	lookups  int    // signed-URL sandbox lookups
	status   int    // if non-zero, answer this status
	reason   string // the JSON error reason of a forced status
	onRepair func()
	delay    time.Duration
	gate     chan struct{} // if set, answers wait until it is closed
}

func newFakeCP(t *testing.T, signer *capability.Signer, clk *clock) *fakeCP {
	cp := &fakeCP{t: t, signer: signer, clock: clk, routes: map[string]identity.Route{},
		tokens: map[string]string{}, authFor: time.Hour}
	cp.srv = httptest.NewServer(http.HandlerFunc(cp.serve))
	t.Cleanup(cp.srv.Close)
	return cp
}

func (cp *fakeCP) serve(w http.ResponseWriter, r *http.Request) {
	const prefix = "/space/v1/sandboxes/"
	if r.Method == http.MethodPost && r.URL.Path == spacev1.PathSignedFilesSandbox {
		cp.serveSigned(w, r)
		return
	}
	if r.Method != http.MethodPost || !strings.HasPrefix(r.URL.Path, prefix) || !strings.HasSuffix(r.URL.Path, "/capabilities") {
		http.Error(w, "not found", 404)
		return
	}
	sb := strings.TrimSuffix(strings.TrimPrefix(r.URL.Path, prefix), "/capabilities")
	var req spacev1.CapabilityRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, "bad json", 400)
		return
	}
	cp.mu.Lock()
	cp.calls = append(cp.calls, cpCall{sb, req, r.Header.Get(spacev1.HeaderAPIKey), r.Header.Get(spacev1.HeaderAccessToken), r.URL.Query()})
	status, rt, ok, need, hook := cp.status, cp.routes[sb], false, cp.tokens[sb], cp.onRepair
	reason := cp.reason
	_, ok = cp.routes[sb]
	node, authFor, delay, gate := cp.nodeURL, cp.authFor, cp.delay, cp.gate
	cp.mu.Unlock()
	time.Sleep(delay)
	if gate != nil {
		select {
		case <-gate:
		case <-r.Context().Done():
		}
	}
	if req.Repair && hook != nil {
		hook()
		cp.mu.Lock()
		rt = cp.routes[sb]
		cp.mu.Unlock()
	}
	writeJSONErr := func(code int, msg string) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_ = json.NewEncoder(w).Encode(spacev1.Error{Code: code, Message: msg})
	}
	switch {
	case status != 0:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(spacev1.Error{Code: status, Message: "forced", Reason: reason})
		return
	case r.Header.Get(spacev1.HeaderAPIKey) != "edge-key":
		writeJSONErr(401, "bad service key")
		return
	case !ok:
		writeJSONErr(404, "sandbox "+sb+" not found")
		return
	case !req.Repair && need != "" && r.Header.Get(spacev1.HeaderAccessToken) != need &&
		r.URL.Query().Get("signature") != "sig-"+need:
		writeJSONErr(401, "invalid access token")
		return
	}
	tok, claims, err := cp.signer.Issue(capability.Claims{Route: rt, Purpose: capability.Purpose(req.Purpose),
		Port: req.Port, Protocol: req.Protocol, IssuedAt: cp.clock.Now()})
	if err != nil {
		writeJSONErr(500, err.Error())
		return
	}
	_ = json.NewEncoder(w).Encode(spacev1.CapabilityResponse{Token: tok, Route: rt, NodeURL: node,
		ExpiresAt: claims.Expiry, AuthorizedUntil: cp.clock.Now().Add(authFor)})
}

// serveSigned finds the sandbox whose token made a signature ("sig-" +
// token in these fakes).
func (cp *fakeCP) serveSigned(w http.ResponseWriter, r *http.Request) {
	cp.mu.Lock()
	cp.lookups++
	delay := cp.delay
	found := ""
	for sb, tok := range cp.tokens {
		if tok != "" && r.URL.Query().Get("signature") == "sig-"+tok {
			found = sb
		}
	}
	cp.mu.Unlock()
	time.Sleep(delay)
	w.Header().Set("Content-Type", "application/json")
	if r.Header.Get(spacev1.HeaderAPIKey) != "edge-key" || found == "" {
		w.WriteHeader(http.StatusUnauthorized)
		_ = json.NewEncoder(w).Encode(spacev1.Error{Code: 401, Message: "invalid signature"})
		return
	}
	_ = json.NewEncoder(w).Encode(spacev1.SignedFilesSandbox{SandboxID: found})
}

func (cp *fakeCP) setRoute(sb string, r identity.Route) {
	cp.mu.Lock()
	cp.routes[sb] = r
	cp.mu.Unlock()
}

func (cp *fakeCP) callsCopy() []cpCall {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	return append([]cpCall(nil), cp.calls...)
}

func (cp *fakeCP) repairs() int {
	n := 0
	for _, c := range cp.callsCopy() {
		if c.Req.Repair {
			n++
		}
	}
	return n
}

// nodeCall records one request seen by the fake node-api.
type nodeCall struct {
	Path    string
	Query   string
	Header  http.Header
	Body    string
	Outcome string
}

// fakeNode is a node-api that verifies capabilities with a real Verifier
// and compares identity with its installed routes.
type fakeNode struct {
	t        *testing.T
	verifier *capability.Verifier
	srv      *httptest.Server

	mu        sync.Mutex
	installed map[string]identity.Route
	calls     []nodeCall
	handlers  map[string]http.HandlerFunc // path -> handler after Allow
	denyAll   bool
}

func newFakeNode(t *testing.T, v *capability.Verifier) *fakeNode {
	n := &fakeNode{t: t, verifier: v, installed: map[string]identity.Route{}, handlers: map[string]http.HandlerFunc{}}
	n.srv = httptest.NewServer(http.HandlerFunc(n.serve))
	t.Cleanup(n.srv.Close)
	return n
}

func (n *fakeNode) install(r identity.Route) {
	n.mu.Lock()
	n.installed[r.SandboxID] = r
	n.mu.Unlock()
}

func (n *fakeNode) handle(path string, h http.HandlerFunc) {
	n.mu.Lock()
	n.handlers[path] = h
	n.mu.Unlock()
}

func (n *fakeNode) callsCopy() []nodeCall {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]nodeCall(nil), n.calls...)
}

func purposeFor(path string) capability.Purpose {
	switch {
	case strings.HasPrefix(path, "/process.Process/"):
		return capability.PurposeProcess
	case strings.HasPrefix(path, "/filesystem.Filesystem/"):
		return capability.PurposeFilesystem
	case path == "/files" || path == "/health":
		return capability.PurposeFiles
	}
	return capability.PurposeServicePort
}

func (n *fakeNode) serve(w http.ResponseWriter, r *http.Request) {
	var body []byte
	if r.Header.Get("Upgrade") == "" && !strings.HasSuffix(r.URL.Path, "/stream-in") {
		body, _ = io.ReadAll(r.Body)
	}
	call := nodeCall{Path: r.URL.Path, Query: r.URL.RawQuery, Header: r.Header.Clone(), Body: string(body)}
	record := func(outcome string) {
		call.Outcome = outcome
		n.mu.Lock()
		n.calls = append(n.calls, call)
		n.mu.Unlock()
	}
	tok := r.Header.Get(spacev1.HeaderCapability)
	claims, err := n.verifier.Verify(tok, purposeFor(r.URL.Path))
	n.mu.Lock()
	inst, ok := n.installed[claims.SandboxID]
	h := n.handlers[r.URL.Path]
	deny := n.denyAll
	n.mu.Unlock()
	if err != nil || deny {
		record("deny")
		w.Header().Set(spacev1.HeaderRouteOutcome, spacev1.OutcomeDeny)
		w.WriteHeader(http.StatusForbidden)
		_, _ = io.WriteString(w, `{"code":403,"message":"denied"}`)
		return
	}
	var rec *identity.Record
	if ok {
		rec = &identity.Record{Route: inst}
	}
	d := identity.Compare(claims.Route, rec, "")
	switch d.Outcome {
	case identity.RefreshRoute:
		record("refresh")
		w.Header().Set(spacev1.HeaderRouteOutcome, spacev1.OutcomeRefreshRoute)
		w.WriteHeader(http.StatusMisdirectedRequest)
		_, _ = io.WriteString(w, `{"code":421,"message":"refresh route"}`)
		return
	case identity.Deny:
		record("deny")
		w.Header().Set(spacev1.HeaderRouteOutcome, spacev1.OutcomeDeny)
		w.WriteHeader(http.StatusForbidden)
		return
	}
	record("allow")
	w.Header().Set(spacev1.HeaderExecution, inst.ExecutionLabel())
	if h != nil {
		if body != nil {
			r.Body = io.NopCloser(strings.NewReader(string(body)))
		}
		h(w, r)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"path": r.URL.Path, "body": string(body), "execution": inst.ExecutionLabel()})
}

// harness wires an Edge to fakes.
type harness struct {
	t        *testing.T
	verifier *capability.Verifier
	clock    *clock
	cp       *fakeCP
	node     *fakeNode
	edge     *Edge
	srv      *httptest.Server
	cl       *http.Client
}

func newHarness(t *testing.T, mod ...func(*Config)) *harness {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	signer, err := capability.NewSigner("k1", priv)
	if err != nil {
		t.Fatal(err)
	}
	v, err := capability.NewVerifier(capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: pub}}})
	if err != nil {
		t.Fatal(err)
	}
	clk := newClock()
	v.SetClock(clk.Now)
	h := &harness{t: t, clock: clk, verifier: v}
	h.cp = newFakeCP(t, signer, clk)
	h.node = newFakeNode(t, v)
	h.cp.nodeURL = h.node.srv.URL
	cfg := Config{ControlPlaneURL: h.cp.srv.URL, EdgeKey: "edge-key", Clock: clk.Now}
	for _, m := range mod {
		m(&cfg)
	}
	h.edge, err = New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.srv = httptest.NewServer(h.edge.Handler())
	tr := &http.Transport{}
	h.cl = &http.Client{Transport: tr}
	t.Cleanup(func() {
		h.srv.Close()
		tr.CloseIdleConnections()
		_ = h.edge.Close()
	})
	return h
}

// sandbox installs route gen 1 for sb on the node and the control plane.
func (h *harness) sandbox(sb string) identity.Route {
	r := route(sb, 1)
	h.cp.setRoute(sb, r)
	h.node.install(r)
	return r
}

func (h *harness) envd(method, sb, path, body string, hdr ...string) *http.Response {
	h.t.Helper()
	return h.envdAt(strings.TrimPrefix(h.srv.URL, "http://"), method, sb, path, body, hdr...)
}

func readAll(t *testing.T, res *http.Response) string {
	t.Helper()
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func (h *harness) cacheEntry(sb string, p capability.Purpose, token string) *entry {
	return h.edge.load(keyFor(target{sandbox: sb, port: EnvdPort, purpose: p}, token))
}
