package controlplane

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/store"
)

// callLog records node calls across fake nodes, in order.
type callLog struct {
	mu sync.Mutex
	ev []string
}

func (l *callLog) add(s string) { l.mu.Lock(); l.ev = append(l.ev, s); l.mu.Unlock() }
func (l *callLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.ev...)
}
func (l *callLog) reset() { l.mu.Lock(); l.ev = nil; l.mu.Unlock() }

// lifeNode extends fakeNode with pause, resume, snapshot and retire. Each
// call must carry a control capability for exactly the route in its body.
type lifeNode struct {
	log *callLog
	mu  sync.Mutex
	// fail answers a lifecycle path with a status; block holds it until
	// the channel is closed (entered is signalled first).
	fail    map[string]int
	reason  map[string]string // the failure's JSON reason, if any
	block   map[string]chan struct{}
	entered chan string
	snaps   map[string]identity.Route
}

func attachLife(n *fakeNode, l *callLog) *lifeNode {
	n.life = &lifeNode{log: l, fail: map[string]int{}, reason: map[string]string{}, block: map[string]chan struct{}{}, snaps: map[string]identity.Route{},
		entered: make(chan string, 16)}
	return n.life
}

func (l *lifeNode) setFail(path string, code int) { l.mu.Lock(); l.fail[path] = code; l.mu.Unlock() }
func (l *lifeNode) setBlock(path string) chan struct{} {
	ch := make(chan struct{})
	l.mu.Lock()
	l.block[path] = ch
	l.mu.Unlock()
	return ch
}

var pathOp = map[string]string{
	spacev1.NodePathPause: "pause", spacev1.NodePathResume: "resume",
	spacev1.NodePathRetire: "retire", spacev1.NodePathSnapshot: "snapshot",
}

// published reports whether route is the record's published route now.
func published(n *fakeNode, r *http.Request, route identity.Route) bool {
	rec, _, err := n.st.GetSandbox(r.Context(), route.SandboxID)
	return err == nil && rec.Route == route
}

func (l *lifeNode) serve(n *fakeNode, w http.ResponseWriter, r *http.Request, body []byte) bool {
	switch r.URL.Path {
	case spacev1.NodePathInstall:
		var req spacev1.InstallRequest
		_ = json.Unmarshal(body, &req)
		l.log.add(fmt.Sprintf("%s install g%d restore=%t published=%t", n.id, req.Route.Generation, req.RestoreSnapshot != "", published(n, r, req.Route)))
		return false
	case spacev1.NodePathTeardown:
		var req spacev1.TeardownRequest
		_ = json.Unmarshal(body, &req)
		l.log.add(fmt.Sprintf("%s teardown g%d", n.id, req.Route.Generation))
		return false
	}
	op, ok := pathOp[r.URL.Path]
	if !ok {
		return false
	}
	var req spacev1.SnapshotRequest // a superset of LifecycleRequest
	if err := json.Unmarshal(body, &req); err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return true
	}
	if err := n.verify(r, func() spacev1.TeardownRequest { return spacev1.TeardownRequest{Route: req.Route} }); err != nil {
		n.mu.Lock()
		n.tokenErr = err
		n.mu.Unlock()
		w.WriteHeader(http.StatusForbidden)
		return true
	}
	l.mu.Lock()
	fail, block, reason := l.fail[r.URL.Path], l.block[r.URL.Path], l.reason[r.URL.Path]
	l.mu.Unlock()
	if block != nil {
		l.entered <- op
		<-block
	}
	ev := fmt.Sprintf("%s %s g%d", n.id, op, req.Route.Generation)
	if op == "retire" {
		ev += fmt.Sprintf(" published=%t", !published(n, r, req.Route))
	}
	if fail != 0 {
		l.log.add(ev + " failed")
		w.WriteHeader(fail)
		_ = json.NewEncoder(w).Encode(spacev1.Error{Code: fail, Message: "boom", Reason: reason})
		return true
	}
	l.log.add(ev)
	if op == "snapshot" {
		if req.SnapshotID == "" {
			w.WriteHeader(http.StatusBadRequest)
			return true
		}
		l.mu.Lock()
		l.snaps[req.SnapshotID] = req.Route
		l.mu.Unlock()
		_ = json.NewEncoder(w).Encode(spacev1.SnapshotResponse{SnapshotID: req.SnapshotID, SizeBytes: 42})
		return true
	}
	w.WriteHeader(http.StatusNoContent)
	return true
}

func (e *env) record(id string) store.SandboxRecord {
	e.t.Helper()
	rec, _, err := e.st.GetSandbox(context.Background(), id)
	if err != nil {
		e.t.Fatal(err)
	}
	return rec
}

func (e *env) capability(id string) (spacev1.CapabilityResponse, resp) {
	r := e.api("POST", "/space/v1/sandboxes/"+id+"/capabilities", map[string]any{"purpose": "process"})
	var c spacev1.CapabilityResponse
	if r.Code == 200 {
		r.decode(e.t, &c)
	}
	return c, r
}

func expectEvents(t *testing.T, got []string, want ...string) {
	t.Helper()
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("node calls:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
}

func noTokenErr(t *testing.T, nodes ...*fakeNode) {
	t.Helper()
	for _, n := range nodes {
		if _, _, err := n.counts(); err != nil {
			t.Fatalf("node %s rejected a control capability: %v", n.id, err)
		}
	}
}

func TestPauseResumeSameWorker(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	lg := &callLog{}
	n1 := newFakeNode(t, "w1", st)
	attachLife(n1, lg)
	e.register(n1, 10)

	sb := createV2(t, e, map[string]any{"templateID": "base"})
	before := e.record(sb.SandboxID).Route
	lg.reset()

	if r := e.api("POST", "/sandboxes/"+sb.SandboxID+"/pause", nil); r.Code != 204 {
		t.Fatalf("pause: %d %s", r.Code, r.Body)
	}
	var d e2bapi.SandboxDetail
	e.api("GET", "/sandboxes/"+sb.SandboxID, nil).decode(t, &d)
	if d.State != "paused" {
		t.Fatalf("state %q", d.State)
	}
	// Paused: no capability; a second pause is 409 (the SDK's "already paused").
	if _, r := e.capability(sb.SandboxID); r.Code != 409 {
		t.Fatalf("capability while paused: %d", r.Code)
	}
	expectError(t, e.api("POST", "/sandboxes/"+sb.SandboxID+"/pause", map[string]any{"memory": true}), 409)
	// Listing paused sandboxes shows it.
	var l []e2bapi.ListedSandbox
	e.api("GET", "/v2/sandboxes?state=paused", nil).decode(t, &l)
	if len(l) != 1 || l[0].State != "paused" {
		t.Fatalf("list paused: %+v", l)
	}

	r := e.api("POST", "/v2/sandboxes/"+sb.SandboxID+"/connect", map[string]any{"timeout": 60})
	if r.Code != 201 {
		t.Fatalf("connect on paused: %d %s", r.Code, r.Body)
	}
	var got e2bapi.Sandbox
	r.decode(t, &got)
	if got.SandboxID != sb.SandboxID || got.EnvdAccessToken != sb.EnvdAccessToken || got.EnvdVersion == "" {
		t.Fatalf("connect body %+v", got)
	}
	// Running: connect extends only, 200; the deprecated resume says 409.
	if r := e.api("POST", "/v2/sandboxes/"+sb.SandboxID+"/connect", nil); r.Code != 200 {
		t.Fatalf("connect on running: %d %s", r.Code, r.Body)
	}
	expectError(t, e.api("POST", "/sandboxes/"+sb.SandboxID+"/resume", nil), 409)

	expectEvents(t, lg.all(), "w1 pause g1", "w1 resume g1")
	rec := e.record(sb.SandboxID)
	if rec.Route != before || rec.Generation != 1 || rec.State != store.StateRunning || rec.Op != nil {
		t.Fatalf("route changed or record not settled: %+v", rec)
	}
	if c, r := e.capability(sb.SandboxID); r.Code != 200 || c.Route != before {
		t.Fatalf("capability after resume: %d %+v", r.Code, c.Route)
	}
	var ex []spacev1.Execution
	e.api("GET", "/space/v1/sandboxes/"+sb.SandboxID+"/executions", nil).decode(t, &ex)
	if len(ex) != 1 || ex[0].State != "running" || ex[0].Route != before {
		t.Fatalf("executions %+v", ex)
	}

	// The deprecated resume path: pause, then resume (201).
	if r := e.api("POST", "/sandboxes/"+sb.SandboxID+"/pause", nil); r.Code != 204 {
		t.Fatalf("pause: %d", r.Code)
	}
	if r := e.api("POST", "/sandboxes/"+sb.SandboxID+"/resume", map[string]any{"timeout": 30}); r.Code != 201 {
		t.Fatalf("resume: %d %s", r.Code, r.Body)
	}
	if end := e.record(sb.SandboxID).EndAt; end.Sub(e.clock.Now()) > 31*time.Second {
		t.Fatalf("resume timeout not applied: end in %s", end.Sub(e.clock.Now()))
	}
	noTokenErr(t, n1)
}

// twoWorkers creates a sandbox on w1 (the only worker at create time) and
// then registers w2.
func twoWorkers(t *testing.T, mut func(*Config)) (*env, *fakeNode, *fakeNode, *callLog, string) {
	st := openStore(t)
	e := newEnv(t, st, mut)
	lg := &callLog{}
	n1, n2 := newFakeNode(t, "w1", st), newFakeNode(t, "w2", st)
	attachLife(n1, lg)
	attachLife(n2, lg)
	e.register(n1, 10)
	sb := createV2(t, e, map[string]any{"templateID": "base", "envVars": map[string]string{"A": "1"}})
	e.register(n2, 10)
	lg.reset()
	return e, n1, n2, lg, sb.SandboxID
}

func TestConcurrentLifecycleOps(t *testing.T) {
	e, n1, n2, lg, id := twoWorkers(t, nil)
	release := n1.life.setBlock(spacev1.NodePathPause)
	done := make(chan resp, 1)
	go func() { done <- e.api("POST", "/sandboxes/"+id+"/pause", nil) }()
	<-n1.life.entered
	if rec := e.record(id); rec.State != store.StatePausing || rec.Op == nil || rec.Op.Kind != "pause" {
		t.Fatalf("record while pausing %+v", rec)
	}
	// GET shows the state the operation started from.
	var d e2bapi.SandboxDetail
	e.api("GET", "/sandboxes/"+id, nil).decode(t, &d)
	if d.State != "running" {
		t.Fatalf("state while pausing %q", d.State)
	}
	for _, p := range []string{"/sandboxes/" + id + "/pause", "/space/v1/sandboxes/" + id + "/migrate", "/sandboxes/" + id + "/snapshots"} {
		r := e.api("POST", p, nil)
		expectError(t, r, 409)
		if !strings.Contains(string(r.Body), "in progress") {
			t.Fatalf("%s: %s", p, r.Body)
		}
	}
	close(release)
	if r := <-done; r.Code != 204 {
		t.Fatalf("first pause: %d %s", r.Code, r.Body)
	}
	n1.life.mu.Lock()
	delete(n1.life.block, spacev1.NodePathPause)
	n1.life.mu.Unlock()

	// Two connects on a paused sandbox: one resumes, the other joins it.
	release = n1.life.setBlock(spacev1.NodePathResume)
	lg.reset()
	c1 := make(chan resp, 1)
	go func() { c1 <- e.api("POST", "/v2/sandboxes/"+id+"/connect", nil) }()
	<-n1.life.entered
	c2 := make(chan resp, 1)
	go func() { c2 <- e.api("POST", "/v2/sandboxes/"+id+"/connect", nil) }()
	// The deprecated resume does not join: 409.
	expectError(t, e.api("POST", "/sandboxes/"+id+"/resume", nil), 409)
	time.Sleep(50 * time.Millisecond)
	close(release)
	r1, r2 := <-c1, <-c2
	if r1.Code != 201 || r2.Code != 200 {
		t.Fatalf("connects: %d %d (%s %s)", r1.Code, r2.Code, r1.Body, r2.Body)
	}
	expectEvents(t, lg.all(), "w1 resume g1")

	// Racing operations straight on the store: exactly one wins.
	n1.life.mu.Lock()
	delete(n1.life.block, spacev1.NodePathResume)
	n1.life.mu.Unlock()
	var wg sync.WaitGroup
	codes := make(chan int, 8)
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			path := "/sandboxes/" + id + "/pause"
			if i%2 == 1 {
				path = "/space/v1/sandboxes/" + id + "/migrate"
			}
			codes <- e.api("POST", path, nil).Code
		}(i)
	}
	wg.Wait()
	close(codes)
	ok := 0
	for c := range codes {
		switch c {
		case 200, 204:
			ok++
		case 409:
		default:
			t.Fatalf("racing op answered %d", c)
		}
	}
	if ok < 1 {
		t.Fatal("no racing operation succeeded")
	}
	rec := e.record(id)
	if rec.Op != nil || rec.State.Transitional() {
		t.Fatalf("record not settled %+v", rec)
	}
	noTokenErr(t, n1, n2)
}

func TestAutoPauseOnTimeout(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	lg := &callLog{}
	n1 := newFakeNode(t, "w1", st)
	attachLife(n1, lg)
	e.register(n1, 10)
	paused := createV2(t, e, map[string]any{"templateID": "base", "timeout": 2, "autoPause": true})
	killed := createV2(t, e, map[string]any{"templateID": "base", "timeout": 2})
	var d e2bapi.SandboxDetail
	e.api("GET", "/sandboxes/"+paused.SandboxID, nil).decode(t, &d)
	if d.Lifecycle == nil || d.Lifecycle.OnTimeout != "pause" {
		t.Fatalf("lifecycle %+v", d.Lifecycle)
	}
	lg.reset()
	e.clock.Advance(3 * time.Second)
	waitFor(t, func() bool {
		return e.record(paused.SandboxID).State == store.StatePaused && e.record(killed.SandboxID).State == store.StateKilled
	})
	rec := e.record(paused.SandboxID)
	events := strings.Join(lg.all(), ",")
	if !strings.Contains(events, "w1 pause g1") || strings.Count(events, "teardown") != 1 || rec.Route.Generation != 1 {
		t.Fatalf("events %s, record %+v", events, rec)
	}
	// Connect resumes it.
	if r := e.api("POST", "/v2/sandboxes/"+paused.SandboxID+"/connect", map[string]any{"timeout": 3}); r.Code != 201 {
		t.Fatalf("connect: %d %s", r.Code, r.Body)
	}
	// A paused sandbox is kept for MaxTimeout, then killed.
	e.clock.Advance(4 * time.Second)
	waitFor(t, func() bool { return e.record(paused.SandboxID).State == store.StatePaused })
	noTokenErr(t, n1)
	// (the fake node checks tokens against the real clock: no check below)
	e.clock.Advance(DefaultMaxTimeout + time.Minute)
	waitFor(t, func() bool { return e.record(paused.SandboxID).State == store.StateKilled })
}

func TestStaleOperationRecovered(t *testing.T) {
	e, n1, n2, _, id := twoWorkers(t, nil)
	ctx := context.Background()
	// A control plane died mid-migration: the generation is reserved and
	// the pending route installed, nothing published.
	var pending identity.Route
	_, _, err := e.st.MutateSandbox(ctx, id, func(r *store.SandboxRecord) error {
		// Started long ago (the fake node checks tokens against the real
		// clock, so the test's clock stays put).
		r.Op = &store.LifecycleOp{ID: "dead", Kind: opMigrate, From: store.StateRunning,
			StartedAt: e.clock.Now().UTC().Add(-e.srv.opDeadline() + 500*time.Millisecond)}
		r.State = store.StateMigrating
		r.Generation++
		pending = e.srv.newRoute(id, r.Generation, "w2", identity.SubstrateNS)
		r.PendingRoute = &pending
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	expectError(t, e.api("POST", "/sandboxes/"+id+"/pause", nil), 409)
	e.clock.Advance(time.Second)
	waitFor(t, func() bool { return e.record(id).State == store.StatePaused })
	rec := e.record(id)
	if rec.Op != nil || rec.PendingRoute != nil || rec.Route.Generation != 1 || rec.Executions[len(rec.Executions)-1].State != "failed" {
		t.Fatalf("recovered record %+v", rec)
	}
	waitFor(t, func() bool {
		n2.mu.Lock()
		defer n2.mu.Unlock()
		return len(n2.teardown) == 1 && n2.teardown[0].Route == pending
	})
	noTokenErr(t, n1, n2)
}

func TestLifecycleBadInput(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	n1 := newFakeNode(t, "w1", st)
	attachLife(n1, &callLog{})
	e.register(n1, 10)
	sb := createV2(t, e, map[string]any{"templateID": "base"})
	id := sb.SandboxID
	for _, c := range []struct {
		method, path string
		body         any
		code         int
	}{
		{"POST", "/sandboxes/NOT-AN-ID/pause", nil, 400},
		{"POST", "/sandboxes/aaaaaaaaaaaaaaaaaaaa/pause", nil, 404},
		{"POST", "/sandboxes/" + id + "/pause", "{", 400},
		{"POST", "/sandboxes/" + id + "/pause", `{"memory":"yes"}`, 400},
		{"POST", "/v2/sandboxes/" + id + "/connect", map[string]any{"timeout": -1}, 400},
		{"POST", "/v2/sandboxes/" + id + "/connect", map[string]any{"timeout": 1 << 30}, 400},
		{"POST", "/sandboxes/" + id + "/connect", map[string]any{}, 400},
		{"POST", "/sandboxes/" + id + "/resume", map[string]any{"timeout": 0}, 400},
		{"POST", "/space/v1/sandboxes/" + id + "/migrate", `{"target_worker": 5}`, 400},
		{"POST", "/space/v1/sandboxes/" + id + "/migrate", map[string]any{"target_worker": "a/b"}, 400},
		{"POST", "/space/v1/sandboxes/" + id + "/migrate", map[string]any{"target_worker": "w1"}, 400},
		{"POST", "/space/v1/sandboxes/" + id + "/migrate", nil, 503}, // no other worker
		{"POST", "/sandboxes/" + id + "/snapshots", `{"name": 3}`, 400},
		{"POST", "/sandboxes/" + id + "/pause", strings.Repeat(" ", MaxBodyBytes+1), 413},
	} {
		expectError(t, e.api(c.method, c.path, c.body), c.code)
	}
	// Nothing moved.
	if rec := e.record(id); rec.State != store.StateRunning || rec.Generation != 1 || rec.Op != nil {
		t.Fatalf("record %+v", rec)
	}
	// Without a key: 401; with the edge key: 403.
	expectError(t, e.do("POST", "/sandboxes/"+id+"/pause", nil, nil), 401)
	expectError(t, e.do("POST", "/sandboxes/"+id+"/pause", map[string]string{"X-API-Key": edgeKey}, nil), 403)
	// Killed: 404 for every lifecycle call.
	if r := e.api("DELETE", "/sandboxes/"+id, nil); r.Code != 204 {
		t.Fatal(r.Code)
	}
	for _, p := range []string{"/sandboxes/" + id + "/pause", "/sandboxes/" + id + "/resume", "/v2/sandboxes/" + id + "/connect",
		"/space/v1/sandboxes/" + id + "/migrate", "/sandboxes/" + id + "/snapshots"} {
		expectError(t, e.api("POST", p, nil), 404)
	}
}
