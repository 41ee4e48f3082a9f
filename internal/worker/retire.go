package worker

import (
	"context"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/spacesbx/space/internal/identity"
)

// SandboxEvent is what the worker needs of one change to a control-plane
// sandbox record (the store's record, reduced so that this package does not
// depend on the store or etcd).
type SandboxEvent struct {
	SandboxID string
	// Deleted: the record is gone (purged); Route is then empty.
	Deleted bool
	// Ended: the sandbox is killed or failed (a tombstone state).
	Ended bool
	// Route is the sandbox's current (or, when Ended, last) execution as
	// published by the control plane. Zero while none is published yet.
	Route identity.Route
	// Pending is the execution an operation is installing (a move's
	// target), not yet published; zero when none is.
	Pending identity.Route
	// Synced marks the end of a full listing: every sandbox record the
	// control plane holds was delivered before it (the other fields are
	// empty).
	Synced bool
}

// SandboxWatcher delivers an event for every existing sandbox record and a
// Synced event, then for every change, until ctx ends (a broken watch resyncs and may repeat
// events: consumers are idempotent). fn runs on the watching goroutine.
type SandboxWatcher interface {
	WatchSandboxes(ctx context.Context, fn func(SandboxEvent)) error
}

// supersedes decides whether ev retires the execution this worker has
// installed for the sandbox. The control plane publishes a route only
// after the execution it names is installed (and persisted) on its worker,
// and every new incarnation has a higher generation, so:
//
//   - a published route of a higher generation retires ours;
//   - the same generation naming another execution (or worker) does too;
//   - a route of a lower generation never does: it is the record lagging
//     behind an install on this worker (a resume here, or the window
//     between install and publication), not a retirement;
//   - a killed or failed sandbox retires its executions up to the last
//     published generation; a deleted record (ids are never reused)
//     retires whatever is installed.
func supersedes(ev SandboxEvent, installed identity.Record) bool {
	if installed.Retired || installed.Route.SandboxID != ev.SandboxID {
		return false
	}
	in := installed.Route
	switch {
	case ev.Deleted:
		return true
	case ev.Ended:
		return ev.Route.Generation == 0 || in.Generation <= ev.Route.Generation
	case ev.Route.Generation > in.Generation:
		return true
	case ev.Route.Generation == in.Generation:
		return ev.Route.Epoch() != in.Epoch()
	}
	return false
}

// retirer applies sandbox events to the manager.
type retirer struct {
	w  *Worker
	wg sync.WaitGroup

	mu      sync.Mutex
	pending map[string]chan struct{} // sandboxes being retired (closed when done)
	// known are the sandboxes the control plane holds, as the watch has
	// told so far; atStart are the sandboxes this worker had records of
	// when it started (nil once reconciled).
	known   map[string]bool
	atStart []identity.Record
	synced  bool
	// unconfirmed are the executions re-adopted at start whose
	// generation the control plane had not published when the worker
	// died (a move's target install, cut before its ack): by sandbox.
	// Each waits for an event that publishes it or abandons it.
	unconfirmed map[string]identity.Record
}

// handle runs on the watch goroutine: the decision is local and cheap; the
// retirement (which stops an activation) runs on its own goroutine so one
// slow stop does not delay the events of other sandboxes. Retire itself
// re-checks the installed record under the sandbox lock, so a retirement
// decided from an old record never touches a newer install.
func (r *retirer) handle(ctx context.Context, ev SandboxEvent) {
	if ev.Synced {
		r.reconcile(ctx)
		return
	}
	r.mu.Lock()
	if ev.Deleted {
		delete(r.known, ev.SandboxID)
	} else {
		r.known[ev.SandboxID] = true
	}
	r.mu.Unlock()
	installed, ok := r.w.mgr.Installed(ev.SandboxID)
	if !ok {
		return
	}
	if supersedes(ev, installed) || r.abandoned(ev, installed) {
		r.retire(ctx, ev, installed)
	}
}

// abandoned decides whether an execution re-adopted at start, of a
// generation above the published one, was abandoned: its install was cut
// by the worker's death before the ack, and the control plane, its call
// failed, gave the move up (no operation names it as pending any more),
// so nothing will ever publish it. Left alone it would run unserved for
// good. Only such executions are judged this way: for an install made
// since the start, an event older than the operation that asked for it
// also shows a lower generation and no pending route.
func (r *retirer) abandoned(ev SandboxEvent, installed identity.Record) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec, ok := r.unconfirmed[ev.SandboxID]
	if !ok || rec.Route.Epoch() != installed.Route.Epoch() {
		return false
	}
	in := installed.Route
	switch {
	case ev.Deleted || ev.Ended || ev.Route.Generation >= in.Generation:
		delete(r.unconfirmed, ev.SandboxID) // supersedes decides
		return false
	case ev.Pending.Epoch() == in.Epoch():
		return false // still being installed: the operation may publish it
	}
	delete(r.unconfirmed, ev.SandboxID)
	r.w.log.Warn("an execution re-adopted at start was never published and its operation is gone; retiring it",
		"sandbox", ev.SandboxID, "generation", in.Generation, "published_generation", ev.Route.Generation)
	return true
}

// reconcile runs at the first full listing after the worker started: an
// execution this worker had on record at start whose sandbox the control
// plane no longer holds at all (killed and purged while the worker was
// down, so no event will ever name it) is retired, as a deleted record
// would retire it. Later listings change nothing here: a sandbox created
// since the start cannot be missing from one (its record is written
// before any install).
func (r *retirer) reconcile(ctx context.Context) {
	r.mu.Lock()
	recs, first := r.atStart, !r.synced
	r.atStart, r.synced = nil, true
	var gone []identity.Record
	for _, rec := range recs {
		if !rec.Retired && !r.known[rec.Route.SandboxID] {
			gone = append(gone, rec)
		}
	}
	r.mu.Unlock()
	for _, rec := range gone {
		r.w.log.Warn("reconciling at start: the control plane no longer holds this sandbox; retiring its execution",
			"sandbox", rec.Route.SandboxID, "generation", rec.Route.Generation)
		r.retire(ctx, SandboxEvent{SandboxID: rec.Route.SandboxID, Deleted: true}, rec)
	}
	if first {
		// Adopted executions are served once every retirement the view
		// called for (this listing's events included) is done.
		r.mu.Lock()
		var inflight []chan struct{}
		for _, c := range r.pending {
			inflight = append(inflight, c)
		}
		r.mu.Unlock()
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			for _, c := range inflight {
				<-c
			}
			r.w.mgr.ConfirmAdopted()
			r.w.log.Info("control plane's view applied; re-adopted executions are served")
		}()
	}
}

// retire retires installed (ev decided it) on a goroutine of its own.
func (r *retirer) retire(ctx context.Context, ev SandboxEvent, installed identity.Record) {
	r.mu.Lock()
	if _, busy := r.pending[ev.SandboxID]; busy {
		r.mu.Unlock()
		return
	}
	done := make(chan struct{})
	r.pending[ev.SandboxID] = done
	r.mu.Unlock()
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		defer func() {
			r.mu.Lock()
			delete(r.pending, ev.SandboxID)
			r.mu.Unlock()
			close(done)
		}()
		why := "route moved to " + ev.Route.String()
		if ev.Deleted || ev.Ended {
			why = "sandbox ended"
		}
		if err := r.w.mgr.Retire(ctx, installed.Route); err != nil {
			r.w.log.Error("retire from sandbox watch", "sandbox", ev.SandboxID, "generation", installed.Route.Generation, "err", err)
			return
		}
		r.w.log.Info("execution retired from sandbox watch", "sandbox", ev.SandboxID,
			"generation", installed.Route.Generation, "why", why)
	}()
}

// watchSandboxes runs the sandbox watch until ctx ends, restarting it
// after an error: 100 ms after the first, doubling up to 5 s, without
// jitter (one watcher per worker: nothing to spread).
func (w *Worker) watchSandboxes(ctx context.Context, r *retirer) {
	bo := &backoff.ExponentialBackOff{InitialInterval: 100 * time.Millisecond, Multiplier: 2, MaxInterval: 5 * time.Second}
	for ctx.Err() == nil {
		// A new watch lists everything again, without Deleted events for
		// what vanished meanwhile: what the last one knew is forgotten.
		r.mu.Lock()
		clear(r.known)
		r.mu.Unlock()
		err := w.deps.Sandboxes.WatchSandboxes(ctx, func(ev SandboxEvent) { r.handle(ctx, ev) })
		if ctx.Err() != nil {
			return
		}
		w.log.Warn("sandbox watch ended; restarting", "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(bo.NextBackOff()):
		}
	}
}
