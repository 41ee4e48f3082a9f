package worker

// Lease fencing. The worker follows its registration lease locally: each
// answered renewal moves the deadline to (the renewal's send time + the
// lease's TTL − FenceMargin), before etcd can expire the lease and so
// before the control plane may treat the worker as lost and replace its
// executions elsewhere. Past the deadline the worker is fenced: it serves
// nothing (sbxmanager.Manager.Fence; node-api refuses lifecycle calls) and
// lets its sandboxes run. When a renewal is answered again (the store
// registered the worker anew if the lease had lapsed), the worker reads
// the control plane's sandbox records, retires every execution the store
// no longer routes to it, and only then serves again.

import (
	"context"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/spacesbx/space/api/spacev1"
)

// LeaseRenewal is one grant or answered renewal of the worker's
// registration lease (the store's LeaseRenewal without etcd).
type LeaseRenewal struct {
	Lease int64
	// Sent is when the answered request was sent.
	Sent time.Time
	// TTL is the lease's TTL as granted.
	TTL time.Duration
	// Fresh: a new lease (registered anew after the old one lapsed).
	Fresh bool
}

// Deadline is when the worker must stop serving under this renewal: Sent
// + TTL − margin (store.LeaseDeadline).
func (l LeaseRenewal) Deadline(margin time.Duration) time.Time {
	return l.Sent.Add(l.TTL - margin)
}

// LeasedRegistrar is a Registrar that reports its lease's renewals. A
// worker whose Registrar is one fences itself when renewals stop being
// answered (fence.go); with a plain Registrar it never fences.
type LeasedRegistrar interface {
	Registrar
	// RegisterWorkerLeased is RegisterWorker calling onRenew (without
	// blocking) for every grant and answered renewal.
	RegisterWorkerLeased(ctx context.Context, w spacev1.Worker, ttl time.Duration, onRenew func(LeaseRenewal)) (io.Closer, error)
}

// SandboxLister reads every control-plane sandbox record at once (one
// consistent read), as the events a full watch listing would deliver
// (without the Synced event).
type SandboxLister interface {
	ListSandboxes(ctx context.Context) ([]SandboxEvent, error)
}

// fencer follows the lease and fences or unfences the worker.
type fencer struct {
	w      *Worker
	margin time.Duration
	kick   chan struct{}

	mu   sync.Mutex
	last LeaseRenewal // the latest answered renewal (by send time)
	// fenced mirrors the manager's fence as set by this fencer.
	fenced bool
}

func newFencer(w *Worker) *fencer {
	return &fencer{w: w, margin: w.cfg.FenceMargin, kick: make(chan struct{}, 1)}
}

// renewed records l (the store's goroutine calls it; it never blocks).
func (f *fencer) renewed(l LeaseRenewal) {
	f.mu.Lock()
	if l.Sent.After(f.last.Sent) || f.last.Sent.IsZero() {
		f.last = l
	}
	f.mu.Unlock()
	select {
	case f.kick <- struct{}{}:
	default:
	}
}

// run fences the worker at the lease deadline and, once a renewal is
// answered again, applies the control plane's view and unfences it. It
// returns when ctx ends.
func (f *fencer) run(ctx context.Context) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		f.mu.Lock()
		last := f.last
		f.mu.Unlock()
		deadline := last.Deadline(f.margin)
		wait := time.Until(deadline)
		switch {
		case last.Sent.IsZero():
			wait = time.Hour // not registered yet
		case wait <= 0 && !f.fenced:
			f.fenced = true
			f.w.mgr.Fence(fmt.Sprintf("registration lease renewals unanswered since %s (lease %x, ttl %s, margin %s)",
				last.Sent.UTC().Format(time.RFC3339Nano), last.Lease, last.TTL, f.margin))
			wait = time.Hour
		case wait <= 0:
			wait = time.Hour // fenced; the next answered renewal kicks
		case f.fenced:
			// Answered again: apply the view, then serve.
			if err := f.w.applyView(ctx); err != nil {
				if ctx.Err() != nil {
					return
				}
				f.w.log.Warn("worker stays fenced: applying the control plane's view failed; retrying", "err", err)
				wait = min(wait, 500*time.Millisecond)
				break
			}
			f.mu.Lock()
			still := time.Now().Before(f.last.Deadline(f.margin))
			f.mu.Unlock()
			if still {
				f.fenced = false
				f.w.mgr.Unfence()
				f.w.log.Info("worker reached the store again, retired what the control plane replaced meanwhile, and serves again",
					"lease", fmt.Sprintf("%x", last.Lease), "fresh_lease", last.Fresh)
			}
			continue
		}
		if !t.Stop() {
			select {
			case <-t.C:
			default:
			}
		}
		t.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-f.kick:
		case <-t.C:
		}
	}
}

// applyView reads the control plane's sandbox records and retires, one by
// one and waiting for each, every execution installed here that the store
// no longer routes to this worker: superseded by a later generation or
// another execution, killed or failed, or whose record is gone. A failed
// read or retirement is an error: the worker stays fenced.
func (w *Worker) applyView(ctx context.Context) error {
	lister, ok := w.deps.Sandboxes.(SandboxLister)
	if !ok {
		return fmt.Errorf("worker %s: the sandbox source cannot list records", w.cfg.ID)
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	evs, err := lister.ListSandboxes(rctx)
	if err != nil {
		return fmt.Errorf("worker %s: reading the control plane's sandbox records: %w", w.cfg.ID, err)
	}
	byID := make(map[string]SandboxEvent, len(evs))
	for _, ev := range evs {
		byID[ev.SandboxID] = ev
	}
	for _, rec := range w.mgr.Records() {
		if rec.Retired {
			continue
		}
		ev, ok := byID[rec.Route.SandboxID]
		if !ok {
			ev = SandboxEvent{SandboxID: rec.Route.SandboxID, Deleted: true}
		}
		if !supersedes(ev, rec) {
			continue
		}
		if err := w.mgr.Retire(rctx, rec.Route); err != nil {
			return fmt.Errorf("worker %s: retiring %s: %w", w.cfg.ID, rec.Route, err)
		}
		w.log.Warn("execution replaced while the worker was fenced; retired before serving again",
			"sandbox", rec.Route.SandboxID, "generation", rec.Route.Generation, "published", routeOf(ev))
	}
	return nil
}

func routeOf(ev SandboxEvent) string {
	switch {
	case ev.Deleted:
		return "record deleted"
	case ev.Ended:
		return "sandbox ended"
	}
	return ev.Route.String()
}

// register registers through a LeasedRegistrar with fencing, else
// through the plain Registrar.
func (w *Worker) register(ctx context.Context, entry spacev1.Worker, f *fencer) (io.Closer, error) {
	if lr, ok := w.deps.Registrar.(LeasedRegistrar); ok && f != nil {
		return lr.RegisterWorkerLeased(ctx, entry, w.cfg.LeaseTTL, f.renewed)
	}
	return w.deps.Registrar.RegisterWorker(ctx, entry, w.cfg.LeaseTTL)
}
