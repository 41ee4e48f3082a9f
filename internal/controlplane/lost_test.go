package controlplane

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/store"
)

// A running sandbox whose execution a worker reported lost is recovered by
// the reaper as a new execution (the lost one has nothing to pause). A
// recovery that fails leaves it running on the lost execution, marker
// kept, and the next pass tries again; once recovered the marker goes.
func TestReaperRecoversLostExecution(t *testing.T) {
	e, n1, _, lg, id := twoWorkers(t, nil)
	rec := e.record(id)
	n1.life.mu.Lock()
	n1.life.fail[spacev1.NodePathPause] = http.StatusConflict
	n1.life.reason[spacev1.NodePathPause] = spacev1.ReasonExecutionLost
	n1.life.fail[spacev1.NodePathResume] = http.StatusConflict // as a real worker: nothing runs to thaw
	n1.life.reason[spacev1.NodePathResume] = spacev1.ReasonExecutionLost
	n1.life.fail[spacev1.NodePathSnapshot] = http.StatusServiceUnavailable
	n1.life.mu.Unlock()
	ctx := context.Background()
	if err := e.st.PutLost(ctx, rec.Route); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool {
		for _, ev := range lg.all() {
			if ev == "w1 snapshot g1 failed" {
				return true
			}
		}
		return false
	})
	// Failed: not paused (nothing thawed, nothing to resume), marker kept.
	// One read between the reaper's passes (the next pass may start its
	// retry at once).
	var r store.SandboxRecord
	waitFor(t, func() bool { r = e.record(id); return r.Op == nil })
	if r.State != store.StateRunning || r.Route != rec.Route {
		t.Fatalf("after a failed recovery: %s %v", r.State, r.Route)
	}
	if lost, _ := e.st.ListLost(ctx); len(lost) != 1 {
		t.Fatalf("the marker went with a failed recovery: %v", lost)
	}
	n1.life.mu.Lock()
	delete(n1.life.fail, spacev1.NodePathSnapshot)
	n1.life.mu.Unlock()
	waitFor(t, func() bool {
		r := e.record(id)
		return r.State == store.StateRunning && r.Route.Generation == 2
	})
	waitFor(t, func() bool {
		lost, _ := e.st.ListLost(ctx)
		return len(lost) == 0
	})
}

// A lost execution of a sandbox killed meanwhile (the crash cut the kill
// between its record and the worker's teardown) is torn down on its
// worker before its marker goes: nothing else would remove the worker's
// record and files of it.
func TestReaperTearsDownLostExecutionOfKilledSandbox(t *testing.T) {
	e, _, _, lg, id := twoWorkers(t, nil)
	rec := e.record(id)
	// The kill as a crash left it: the record killed, then (at the
	// worker's restart) the execution reported lost.
	if r := e.api("DELETE", "/sandboxes/"+id, nil); r.Code != http.StatusNoContent {
		t.Fatalf("kill: %d", r.Code)
	}
	lg.reset()
	ctx := context.Background()
	if err := e.st.PutLost(ctx, rec.Route); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool {
		lost, _ := e.st.ListLost(ctx)
		return len(lost) == 0
	})
	expectEvents(t, lg.all(), "w1 teardown g1")
}

// An operation whose control plane died (its registration is gone) is
// released at once, not after its deadline: a sandbox it found running
// is thawed on its worker and runs again; one it found paused stays
// paused; an operation of a live control plane is left alone.
func TestReaperReleasesOrphanedOperation(t *testing.T) {
	e, _, _, lg, id := twoWorkers(t, nil)
	ctx := context.Background()
	live, err := e.st.RegisterControlPlane(ctx, "cp-live", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	hold := func(owner string, from, state store.SandboxState) {
		t.Helper()
		if _, _, err := e.st.MutateSandbox(ctx, id, func(r *store.SandboxRecord) error {
			r.State = state
			r.Op = &store.LifecycleOp{ID: "op-" + owner, Kind: "pause", From: from, StartedAt: e.clock.Now().UTC(), Owner: owner}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	hold("cp-live", store.StateRunning, store.StatePausing)
	time.Sleep(3 * e.srv.cfg.ReapInterval)
	if r := e.record(id); r.Op == nil || r.State != store.StatePausing {
		t.Fatalf("the operation of a live control plane was released: %s %+v", r.State, r.Op)
	}
	lg.reset()
	hold("cp-dead", store.StateRunning, store.StatePausing)
	waitFor(t, func() bool { return e.record(id).Op == nil })
	if r := e.record(id); r.State != store.StateRunning {
		t.Fatalf("after releasing an orphaned pause of a running sandbox: %s", r.State)
	}
	expectEvents(t, lg.all(), "w1 resume g1")
	hold("cp-dead", store.StatePaused, store.StateSnapshotting)
	waitFor(t, func() bool { return e.record(id).Op == nil })
	if r := e.record(id); r.State != store.StatePaused {
		t.Fatalf("after releasing an orphaned snapshot of a paused sandbox: %s", r.State)
	}
}

// A create whose control plane died (the record stays creating; its
// client got no answer) is killed at once and its install torn down, not
// after the stale-create bound; a live control plane's create is not.
func TestReaperKillsOrphanedCreate(t *testing.T) {
	e, _, _, lg, id := twoWorkers(t, nil)
	ctx := context.Background()
	live, err := e.st.RegisterControlPlane(ctx, "cp-live", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	creating := func(creator string) {
		t.Helper()
		if _, _, err := e.st.MutateSandbox(ctx, id, func(r *store.SandboxRecord) error {
			r.State, r.Creator = store.StateCreating, creator
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	creating("cp-live")
	time.Sleep(3 * e.srv.cfg.ReapInterval)
	if r := e.record(id); r.State != store.StateCreating {
		t.Fatalf("the create of a live control plane was ended: %s", r.State)
	}
	lg.reset()
	creating("cp-dead")
	waitFor(t, func() bool { return e.record(id).State == store.StateKilled })
	waitFor(t, func() bool { return len(lg.all()) > 0 })
	expectEvents(t, lg.all(), "w1 teardown g1")
}
