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
	if _, ok := p.counts(); ok {
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
	if got, _ := p.counts(); !maps.Equal(got, want) {
		t.Fatalf("counts %v, want %v", got, want)
	}
	p.apply(rec("c", store.StateRunning, "w2", "")) // the move committed
	p.apply(rec("a", store.StateKilled, "w1", ""))
	p.apply(store.SandboxEvent{Deleted: true, Record: store.SandboxRecord{ID: "b"}})
	p.apply(store.SandboxEvent{Deleted: true, Record: store.SandboxRecord{ID: "zz"}}) // never seen
	want = map[string]int{"w2": 1}
	if got, _ := p.counts(); !maps.Equal(got, want) {
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
