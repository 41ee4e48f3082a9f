package controlplane

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/store"
)

const testGrace = 5 * time.Second

// lossEnv: w1 runs a running sandbox and a paused one; w2 is registered
// only when withW2.
func lossEnv(t *testing.T, withW2 bool) (e *env, n1, n2 *fakeNode, lg *callLog, reg1 *store.Registration, running, paused string) {
	t.Helper()
	st := openStore(t)
	e = newEnv(t, st, func(c *Config) { c.WorkerLossGrace = testGrace })
	lg = &callLog{}
	n1, n2 = newFakeNode(t, "w1", st), newFakeNode(t, "w2", st)
	attachLife(n1, lg)
	attachLife(n2, lg)
	reg1 = e.register(n1, 10)
	running = createV2(t, e, map[string]any{"templateID": "base", "envVars": map[string]string{"A": "1"}}).SandboxID
	paused = createV2(t, e, map[string]any{"templateID": "base"}).SandboxID
	if r := e.api("POST", "/sandboxes/"+paused+"/pause", nil); r.Code != 204 {
		t.Fatalf("pause: %d %s", r.Code, r.Body)
	}
	if withW2 {
		e.register(n2, 10)
	}
	lg.reset()
	return
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}

// reapPasses waits until the reaper has run n more passes.
func (e *env) reapPasses(n int) {
	e.t.Helper()
	start := counterValue(e.srv.obs.reaps)
	waitFor(e.t, func() bool { return counterValue(e.srv.obs.reaps) >= start+float64(n) })
}

// A worker whose registration is gone past the grace loses its running
// sandboxes: each comes back on another worker as generation+1, fresh
// from its template when it has no snapshot; not before the grace; the
// paused sandbox is left alone (its snapshot is shared).
func TestWorkerLossRecoversRunningSandboxes(t *testing.T) {
	e, _, n2, lg, reg1, running, paused := lossEnv(t, true)
	before := e.record(running)
	pausedBefore := e.record(paused)
	if err := reg1.Close(); err != nil { // the worker's lease is gone
		t.Fatal(err)
	}
	e.reapPasses(5)
	if r := e.record(running); r.Route != before.Route || r.State != store.StateRunning {
		t.Fatalf("recovered within the grace: %s %v", r.State, r.Route)
	}
	e.clock.Advance(testGrace + time.Second)
	waitFor(t, func() bool { return e.record(running).Route.Generation == before.Route.Generation+1 })
	r := e.record(running)
	if r.State != store.StateRunning || r.Route.WorkerID != "w2" || r.Route.ExecutionID == before.Route.ExecutionID || r.PendingRoute != nil || r.Op != nil {
		t.Fatalf("recovered record %+v", r)
	}
	if r.NodeURL != n2.srv.URL {
		t.Fatalf("node url %q", r.NodeURL)
	}
	expectEvents(t, lg.all(), "w2 install g2 restore=false published=false")
	if n2.installs[len(n2.installs)-1].EnvVars["A"] != "1" {
		t.Fatalf("install lost the env vars: %+v", n2.installs)
	}
	e.reapPasses(3)
	if p := e.record(paused); p.State != store.StatePaused || p.Route != pausedBefore.Route {
		t.Fatalf("paused sandbox touched: %s %v", p.State, p.Route)
	}
	var old, cur bool
	for _, x := range r.Executions {
		old = old || (x.Route == before.Route && x.State == execRetired)
		cur = cur || (x.Route == r.Route && x.State == execRunning)
	}
	if !old || !cur {
		t.Fatalf("executions history %+v", r.Executions)
	}
	if v := counterValue(e.srv.obs.workerLossRecoveries); v != 1 {
		t.Fatalf("recoveries metric %v", v)
	}
}

// A sandbox with a snapshot of its own is restored from the newest one.
func TestWorkerLossRestoresLatestSnapshot(t *testing.T) {
	e, _, n2, _, reg1, running, _ := lossEnv(t, true)
	var ids []string
	for range 2 {
		r := e.api("POST", "/sandboxes/"+running+"/snapshots", nil)
		if r.Code != 201 {
			t.Fatalf("snapshot: %d %s", r.Code, r.Body)
		}
		var info SnapshotInfo
		r.decode(t, &info)
		ids = append(ids, info.SnapshotID)
		e.clock.Advance(time.Second) // distinct creation times
	}
	reg1.Close()
	e.reapPasses(2)
	e.clock.Advance(testGrace + time.Second)
	waitFor(t, func() bool { return e.record(running).Route.WorkerID == "w2" })
	n2.mu.Lock()
	got := n2.installs[len(n2.installs)-1].RestoreSnapshot
	n2.mu.Unlock()
	if got != ids[1] {
		t.Fatalf("restored %q, want the newest snapshot %q (of %v)", got, ids[1], ids)
	}
}

// Without another worker nothing is recovered (the record stays as it
// was, no operation left on it); once one registers, the next pass does.
func TestWorkerLossWaitsForCapacity(t *testing.T) {
	e, n1, n2, _, reg1, running, _ := lossEnv(t, false)
	before := e.record(running)
	reg1.Close()
	e.reapPasses(2)
	e.clock.Advance(testGrace + time.Second)
	e.reapPasses(5)
	// Each pass tries again and gives the record back: read it between two.
	var r store.SandboxRecord
	waitFor(t, func() bool { r = e.record(running); return r.Op == nil })
	if r.Route != before.Route || r.State != store.StateRunning || r.PendingRoute != nil || r.Generation != before.Generation {
		t.Fatalf("without capacity: %s %v pending %v generation %d", r.State, r.Route, r.PendingRoute, r.Generation)
	}
	_ = n1
	e.register(n2, 10)
	waitFor(t, func() bool { return e.record(running).Route.WorkerID == "w2" })
}

// The lost worker registering again while its sandbox is being installed
// elsewhere makes the publication fail (checked in the same transaction):
// the sandbox stays on its worker, the install is torn down, and nothing
// is recovered while the worker stays registered.
func TestWorkerLossPublicationRefusedWhenWorkerReturns(t *testing.T) {
	e, n1, n2, lg, reg1, running, _ := lossEnv(t, false)
	before := e.record(running)
	var once sync.Once
	// w2 behind a front that brings w1 back during the install.
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == spacev1.NodePathInstall {
			once.Do(func() { e.register(n1, 10) })
		}
		n2.serve(w, r)
	}))
	t.Cleanup(front.Close)
	reg2, err := e.st.RegisterWorker(context.Background(), spacev1.Worker{ID: "w2", NodeURL: front.URL, State: "ready", Capacity: 10}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reg2.Close() })
	reg1.Close()
	e.reapPasses(2)
	e.clock.Advance(testGrace + time.Second)
	waitFor(t, func() bool {
		for _, ev := range lg.all() {
			if ev == "w2 teardown g2" {
				return true
			}
		}
		return false
	})
	waitFor(t, func() bool { return e.record(running).Op == nil })
	r := e.record(running)
	if r.Route != before.Route || r.State != store.StateRunning || r.PendingRoute != nil {
		t.Fatalf("after a refused publication: %s %v pending %v", r.State, r.Route, r.PendingRoute)
	}
	e.reapPasses(5)
	if r := e.record(running); r.Route != before.Route {
		t.Fatalf("recovered while its worker is registered: %v", r.Route)
	}
}

// The store refuses a write guarded by a worker's absence once the
// worker is registered, and lets it through while it is not.
func TestMutateSandboxWhileWorkerGone(t *testing.T) {
	e, n1, _, _, reg1, running, _ := lossEnv(t, false)
	ctx := context.Background()
	_, _, err := e.st.MutateSandboxWhileWorkerGone(ctx, running, "w1", func(r *store.SandboxRecord) error { r.Alias = "x"; return nil })
	if !errors.Is(err, store.ErrWorkerRegistered) {
		t.Fatalf("with w1 registered: %v", err)
	}
	reg1.Close()
	if _, _, err := e.st.MutateSandboxWhileWorkerGone(ctx, running, "w1", func(r *store.SandboxRecord) error { r.Alias = "x"; return nil }); err != nil {
		t.Fatalf("with w1 gone: %v", err)
	}
	_ = n1
	if !strings.Contains(e.record(running).Alias, "x") {
		t.Fatal("write lost")
	}
}

// A paused sandbox of a lost worker stays paused; its resume waits for
// the worker's files within the grace (503) and, past it, places the
// sandbox on another worker from its last snapshot, else its template.
func TestWorkerLossPausedSandboxResumesElsewhere(t *testing.T) {
	e, _, _, lg, reg1, _, paused := lossEnv(t, true)
	before := e.record(paused)
	reg1.Close()
	e.reapPasses(2)
	expectError(t, e.api("POST", "/sandboxes/"+paused+"/resume", map[string]any{"timeout": 60}), 503)
	e.clock.Advance(testGrace + time.Second)
	e.reapPasses(3)
	if r := e.record(paused); r.State != store.StatePaused || r.Route != before.Route {
		t.Fatalf("paused sandbox recovered without a resume: %s %v", r.State, r.Route)
	}
	lg.reset()
	if r := e.api("POST", "/sandboxes/"+paused+"/resume", map[string]any{"timeout": 60}); r.Code != 201 {
		t.Fatalf("resume past the grace: %d %s", r.Code, r.Body)
	}
	r := e.record(paused)
	if r.State != store.StateRunning || r.Route.WorkerID != "w2" || r.Route.Generation != before.Route.Generation+1 {
		t.Fatalf("resumed as %s %v", r.State, r.Route)
	}
	expectEvents(t, lg.all(), "w2 install g2 restore=false published=false")
}
