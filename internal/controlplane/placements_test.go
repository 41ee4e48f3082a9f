package controlplane

import (
	"maps"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/store"
)

// The watched placement counts follow the records as a full listing
// would: creating, running and transitional records count on their
// route's worker, a pending route on its own, terminal and deleted
// records on none; nothing is offered before the first full listing.
func TestPlacementsFollowRecords(t *testing.T) {
	p := newPlacements()
	rec := func(id string, st store.SandboxState, w string, pending string) store.SandboxEvent {
		r := store.SandboxRecord{ID: id, State: st, Route: identity.Route{SandboxID: id, WorkerID: w}}
		if pending != "" {
			r.PendingRoute = &identity.Route{SandboxID: id, WorkerID: pending}
		}
		return store.SandboxEvent{Record: r}
	}
	p.apply(rec("a", store.StateRunning, "w1", ""))
	if _, _, ok := p.counts(); ok {
		t.Fatal("counts offered before the first full listing")
	}
	if _, ok := p.registered(); ok {
		t.Fatal("workers offered before the watch delivered them")
	}
	p.apply(store.SandboxEvent{Synced: true})
	p.apply(rec("b", store.StateCreating, "w2", ""))
	p.apply(rec("c", store.StateMigrating, "w1", "w2"))
	p.apply(rec("d", store.StatePaused, "w1", ""))
	p.apply(rec("e", store.StateKilled, "w2", ""))
	want := map[string]int{"w1": 2, "w2": 2}
	if got, _, _ := p.counts(); !maps.Equal(got, want) {
		t.Fatalf("counts %v, want %v", got, want)
	}
	p.apply(rec("c", store.StateRunning, "w2", "")) // the move committed
	p.apply(rec("a", store.StateKilled, "w1", ""))
	p.apply(store.SandboxEvent{Deleted: true, Record: store.SandboxRecord{ID: "b"}})
	p.apply(store.SandboxEvent{Deleted: true, Record: store.SandboxRecord{ID: "zz"}}) // never seen
	want = map[string]int{"w2": 1}
	if got, _, _ := p.counts(); !maps.Equal(got, want) {
		t.Fatalf("counts %v, want %v", got, want)
	}
	p.setWorkers(nil)
	if ws, ok := p.registered(); !ok || len(ws) != 0 {
		t.Fatalf("empty worker list: %v %v", ws, ok)
	}
	p.setWorkers([]spacev1.Worker{{ID: "w1"}})
	ws, _ := p.registered()
	ws[0].ID = "changed"
	if again, _ := p.registered(); again[0].ID != "w1" {
		t.Fatal("registered shares its slice with the caller")
	}
}

// The view's revision is one through which every event has been applied:
// the listing's, then one less than the latest event's (a transaction at
// that revision may write records still to come).
func TestPlacementsRevision(t *testing.T) {
	p := newPlacements()
	ev := func(id string, rev int64) store.SandboxEvent {
		return store.SandboxEvent{Revision: rev, Record: store.SandboxRecord{ID: id, State: store.StateRunning,
			Route: identity.Route{SandboxID: id, WorkerID: "w1"}}}
	}
	p.apply(ev("a", 5))
	p.apply(store.SandboxEvent{Synced: true, Revision: 7})
	if _, rev, ok := p.counts(); !ok || rev != 7 {
		t.Fatalf("after the listing: rev %d ok %v, want 7", rev, ok)
	}
	p.apply(ev("b", 9))
	if n, rev, _ := p.counts(); rev != 8 || n["w1"] != 2 {
		t.Fatalf("after an event at 9: rev %d counts %v, want 8", rev, n)
	}
	p.apply(ev("c", 9)) // the same transaction
	if _, rev, _ := p.counts(); rev != 8 {
		t.Fatalf("a second event at 9: rev %d, want 8", rev)
	}
	p.apply(ev("d", 12))
	if _, rev, _ := p.counts(); rev != 11 {
		t.Fatalf("after an event at 12: rev %d, want 11", rev)
	}
}
