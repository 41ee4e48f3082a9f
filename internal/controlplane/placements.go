package controlplane

import (
	"slices"
	"sync"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/store"
)

// placements counts, per worker, the sandboxes placed there as the
// sandbox records say (placedOn), kept current from a watch of the records
// (started in New), so that a create's placement reads no record: listing
// and decoding every record (killed ones too, until purged) made each
// create cost O(records). The counts lag the store by the watch's delay,
// as a serializable read would; the scheduler's best of K tolerates a
// stale view of load, and a create counts from its record's write on.
//
// The registered workers are watched the same way (a worker's entry gone,
// its lease revoked or expired, is gone from the view once the watch
// delivers it; a placement on a worker that just left fails its install
// and is retried on another).
type placements struct {
	mu    sync.Mutex
	ready bool // the first full listing is in
	// rev is the revision through which every record event has been
	// applied: the view's counts are those of the store at rev. An
	// event at revision r proves every earlier revision delivered, not
	// every event of r (one transaction may write several records), so
	// rev trails it by one until the next event or listing.
	rev int64
	by  map[string]placed // sandbox id -> what it counts
	n   map[string]int    // worker id -> sandboxes counted
	// workers is the last list the workers' watch delivered (nil: none
	// yet).
	workers []spacev1.Worker
}

// setWorkers replaces the workers' view (the workers' watch).
func (p *placements) setWorkers(ws []spacev1.Worker) {
	if ws == nil {
		ws = []spacev1.Worker{}
	}
	p.mu.Lock()
	p.workers = ws
	p.mu.Unlock()
}

// registered returns a copy of the workers' view, or false until the
// watch delivered one.
func (p *placements) registered() ([]spacev1.Worker, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.workers == nil {
		return nil, false
	}
	return slices.Clone(p.workers), true
}

// placed is what one record counts: a worker for its route and one for
// its pending route ("" each when none).
type placed struct{ route, pending string }

func newPlacements() *placements {
	return &placements{by: map[string]placed{}, n: map[string]int{}}
}

// placedOn is what rec counts against workers: its route's worker while
// it is creating, running or in a transition, and its pending route's
// worker while it is not over.
func placedOn(rec store.SandboxRecord) placed {
	var p placed
	if rec.State == store.StateCreating || rec.State == store.StateRunning || rec.State.Transitional() {
		p.route = rec.Route.WorkerID
	}
	if pr := rec.PendingRoute; pr != nil && !rec.State.Terminal() {
		p.pending = pr.WorkerID
	}
	return p
}

// apply updates the counts with one watch event.
func (p *placements) apply(ev store.SandboxEvent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if ev.Synced {
		p.ready = true
		p.rev = max(p.rev, ev.Revision)
		return
	}
	if ev.Revision-1 > p.rev {
		p.rev = ev.Revision - 1
	}
	id := ev.Record.ID
	old := p.by[id]
	var cur placed
	if !ev.Deleted {
		cur = placedOn(ev.Record)
	}
	p.add(old, -1)
	p.add(cur, 1)
	if cur == (placed{}) {
		delete(p.by, id)
	} else {
		p.by[id] = cur
	}
}

func (p *placements) add(pl placed, d int) {
	for _, w := range []string{pl.route, pl.pending} {
		if w == "" {
			continue
		}
		if p.n[w] += d; p.n[w] <= 0 {
			delete(p.n, w)
		}
	}
}

// counts returns a copy of the per-worker counts and the revision they
// are complete through, or false until the first full listing is in.
func (p *placements) counts() (map[string]int, int64, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.ready {
		return nil, 0, false
	}
	out := make(map[string]int, len(p.n))
	for w, n := range p.n {
		out[w] = n
	}
	return out, p.rev, true
}
