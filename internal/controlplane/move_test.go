package controlplane

import (
	"context"
	"strings"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/store"
)

func TestMigrateToAnotherWorker(t *testing.T) {
	e, n1, n2, lg, id := twoWorkers(t, nil)
	oldCap, r := e.capability(id)
	if r.Code != 200 {
		t.Fatalf("capability: %d %s", r.Code, r.Body)
	}

	r = e.api("POST", "/space/v1/sandboxes/"+id+"/migrate", map[string]any{"target_worker": "w2"})
	if r.Code != 200 {
		t.Fatalf("migrate: %d %s", r.Code, r.Body)
	}
	var m spacev1.MigrateResponse
	r.decode(t, &m)
	// Order: pause, snapshot, install with restore on the target before
	// the route is published, publish, retire the old execution.
	expectEvents(t, lg.all(),
		"w1 pause g1", "w1 snapshot g1", "w2 install g2 restore=true published=false", "w1 retire g1 published=true")
	if m.From != oldCap.Route || m.Route.Generation != 2 || m.Route.WorkerID != "w2" || m.Route.ExecutionID == m.From.ExecutionID ||
		m.Route.ActivationID == m.From.ActivationID || !m.ProcessesRestarted || !m.FilesKept || m.Note == "" ||
		m.Execution.Route != m.Route || m.Execution.State != "running" || m.SnapshotID == "" {
		t.Fatalf("migrate response %+v", m)
	}
	n2.mu.Lock()
	inst := n2.installs[len(n2.installs)-1]
	n2.mu.Unlock()
	if inst.RestoreSnapshot != m.SnapshotID || inst.EnvVars["A"] != "1" || inst.Template != "base" || inst.Route != m.Route {
		t.Fatalf("install request %+v", inst)
	}
	if n1.life.snaps[m.SnapshotID] != m.From {
		t.Fatalf("snapshot %s not taken of the old execution", m.SnapshotID)
	}
	rec := e.record(id)
	if rec.Route != m.Route || rec.Generation != 2 || rec.State != store.StateRunning || rec.PendingRoute != nil || rec.NodeURL != n2.srv.URL {
		t.Fatalf("record %+v", rec)
	}
	newCap, r := e.capability(id)
	if r.Code != 200 || newCap.Route != m.Route || newCap.Route == oldCap.Route || newCap.NodeURL != n2.srv.URL {
		t.Fatalf("capability after migrate: %d %+v", r.Code, newCap)
	}
	var ex []spacev1.Execution
	e.api("GET", "/space/v1/sandboxes/"+id+"/executions", nil).decode(t, &ex)
	if len(ex) != 2 || ex[0].Route != m.From || ex[0].State != "retired" || ex[0].EndedAt == nil ||
		ex[1].Route != m.Route || ex[1].State != "running" {
		t.Fatalf("executions %+v", ex)
	}
	// Migrating without a target picks another worker (back to w1);
	// naming the current worker, or an unknown one, is bad input.
	expectError(t, e.api("POST", "/space/v1/sandboxes/"+id+"/migrate", map[string]any{"target_worker": "w2"}), 400)
	expectError(t, e.api("POST", "/space/v1/sandboxes/"+id+"/migrate", map[string]any{"target_worker": "nope"}), 400)
	lg.reset()
	if r := e.api("POST", "/space/v1/sandboxes/"+id+"/migrate", nil); r.Code != 200 {
		t.Fatalf("migrate back: %d %s", r.Code, r.Body)
	}
	expectEvents(t, lg.all(),
		"w2 pause g2", "w2 snapshot g2", "w1 install g3 restore=true published=false", "w2 retire g2 published=true")
	noTokenErr(t, n1, n2)
}

func TestResumeElsewhereWhenWorkerGone(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	lg := &callLog{}
	n1, n2 := newFakeNode(t, "w1", st), newFakeNode(t, "w2", st)
	attachLife(n1, lg)
	attachLife(n2, lg)
	reg1 := e.register(n1, 10)
	sb := createV2(t, e, map[string]any{"templateID": "base"})
	e.register(n2, 10)
	id := sb.SandboxID

	// Paused with no snapshot, worker gone: 503, still paused.
	if r := e.api("POST", "/sandboxes/"+id+"/pause", nil); r.Code != 204 {
		t.Fatalf("pause: %d", r.Code)
	}
	reg1.Close()
	waitFor(t, func() bool { _, err := st.GetWorker(context.Background(), "w1"); return err != nil })
	expectError(t, e.api("POST", "/v2/sandboxes/"+id+"/connect", nil), 503)
	if rec := e.record(id); rec.State != store.StatePaused || rec.Route.Generation != 1 || rec.Op != nil {
		t.Fatalf("record after refused resume %+v", rec)
	}

	// A snapshot of the paused execution (taken while w1 was alive) lets
	// the resume go elsewhere.
	reg1 = e.register(n1, 10)
	if r := e.api("POST", "/sandboxes/"+id+"/snapshots", nil); r.Code != 201 {
		t.Fatalf("snapshot: %d %s", r.Code, r.Body)
	}
	snap := e.record(id).PausedSnapshot
	if snap == "" {
		t.Fatal("paused snapshot not recorded")
	}
	reg1.Close()
	waitFor(t, func() bool { _, err := st.GetWorker(context.Background(), "w1"); return err != nil })
	lg.reset()
	r := e.api("POST", "/v2/sandboxes/"+id+"/connect", map[string]any{"timeout": 100})
	if r.Code != 201 {
		t.Fatalf("connect: %d %s", r.Code, r.Body)
	}
	// No call can reach the gone worker; its record watch retires g1.
	expectEvents(t, lg.all(), "w2 install g2 restore=true published=false")
	rec := e.record(id)
	if rec.Route.WorkerID != "w2" || rec.Route.Generation != 2 || rec.State != store.StateRunning {
		t.Fatalf("record %+v", rec)
	}
	n2.mu.Lock()
	if n2.installs[len(n2.installs)-1].RestoreSnapshot != snap {
		t.Fatalf("restored %q, want %q", n2.installs[len(n2.installs)-1].RestoreSnapshot, snap)
	}
	n2.mu.Unlock()
	noTokenErr(t, n1, n2)
}

func TestFailedInstallKeepsSandboxOnOldWorker(t *testing.T) {
	e, n1, n2, lg, id := twoWorkers(t, nil)
	before := e.record(id).Route

	// Paused sandbox, install on the target fails: still paused on w1,
	// generation not published, the failed execution in the history.
	if r := e.api("POST", "/sandboxes/"+id+"/pause", nil); r.Code != 204 {
		t.Fatalf("pause: %d", r.Code)
	}
	n2.setFail(500)
	lg.reset()
	expectError(t, e.api("POST", "/space/v1/sandboxes/"+id+"/migrate", map[string]any{"target_worker": "w2"}), 502)
	expectEvents(t, lg.all(), "w1 snapshot g1", "w2 install g2 restore=true published=false", "w2 teardown g2")
	rec := e.record(id)
	if rec.State != store.StatePaused || rec.Route != before || rec.Generation != 2 || rec.PendingRoute != nil || rec.Op != nil || rec.PausedSnapshot == "" {
		t.Fatalf("record after failed install %+v", rec)
	}
	if len(rec.Executions) != 2 || rec.Executions[0].State != "paused" || rec.Executions[1].State != "failed" || rec.Executions[1].Route.Generation != 2 {
		t.Fatalf("executions %+v", rec.Executions)
	}
	if _, r := e.capability(id); r.Code != 409 {
		t.Fatalf("capability: %d", r.Code)
	}
	// Resuming on w1 thaws the same execution (files and processes kept).
	lg.reset()
	if r := e.api("POST", "/v2/sandboxes/"+id+"/connect", nil); r.Code != 201 {
		t.Fatalf("connect: %d %s", r.Code, r.Body)
	}
	expectEvents(t, lg.all(), "w1 resume g1")
	if c, _ := e.capability(id); c.Route != before {
		t.Fatalf("capability route %+v", c.Route)
	}

	// Running sandbox, install fails: the old execution is thawed again.
	lg.reset()
	expectError(t, e.api("POST", "/space/v1/sandboxes/"+id+"/migrate", nil), 502)
	expectEvents(t, lg.all(), "w1 pause g1", "w1 snapshot g1", "w2 install g3 restore=true published=false", "w2 teardown g3", "w1 resume g1")
	if rec := e.record(id); rec.State != store.StateRunning || rec.Route != before || rec.Generation != 3 || rec.PausedSnapshot != "" {
		t.Fatalf("record %+v", rec)
	}
	// A failing snapshot changes nothing either.
	n1.life.setFail(spacev1.NodePathSnapshot, 500)
	lg.reset()
	expectError(t, e.api("POST", "/space/v1/sandboxes/"+id+"/migrate", nil), 502)
	expectEvents(t, lg.all(), "w1 pause g1", "w1 snapshot g1 failed", "w1 resume g1")
	if rec := e.record(id); rec.State != store.StateRunning || rec.Route != before || rec.Generation != 3 {
		t.Fatalf("record %+v", rec)
	}
	noTokenErr(t, n1, n2)
}

func TestKillDuringMigration(t *testing.T) {
	e, n1, n2, lg, id := twoWorkers(t, nil)
	release := n1.life.setBlock(spacev1.NodePathSnapshot)
	done := make(chan resp, 1)
	go func() {
		done <- e.api("POST", "/space/v1/sandboxes/"+id+"/migrate", map[string]any{"target_worker": "w2"})
	}()
	<-n1.life.entered
	if r := e.api("DELETE", "/sandboxes/"+id, nil); r.Code != 204 {
		t.Fatalf("kill during migration: %d %s", r.Code, r.Body)
	}
	close(release)
	r := <-done
	expectError(t, r, 409)
	rec := e.record(id)
	if rec.State != store.StateKilled || rec.Op != nil || rec.Route.Generation != 1 {
		t.Fatalf("record %+v", rec)
	}
	if strings.Contains(strings.Join(lg.all(), ","), "install") {
		t.Fatalf("installed after kill: %v", lg.all())
	}
	noTokenErr(t, n1, n2)
}
