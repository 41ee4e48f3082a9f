package node

import (
	"context"
	"io"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/worker"
)

// Registrar registers workers in the store (their lease is the store's).
func Registrar(st *store.Store) worker.Registrar { return registrar{st} }

type registrar struct{ st *store.Store }

func (r registrar) RegisterWorker(ctx context.Context, w spacev1.Worker, ttl time.Duration) (io.Closer, error) {
	return r.st.RegisterWorker(ctx, w, ttl)
}

// RegisterWorkerLeased makes registrar a worker.LeasedRegistrar: the
// worker fences itself on the store's lease renewals.
func (r registrar) RegisterWorkerLeased(ctx context.Context, w spacev1.Worker, ttl time.Duration, onRenew func(worker.LeaseRenewal)) (io.Closer, error) {
	return r.st.RegisterWorkerObserved(ctx, w, ttl, func(l store.LeaseRenewal) {
		onRenew(worker.LeaseRenewal{Lease: l.Lease, Sent: l.Sent, TTL: l.TTL, Fresh: l.Fresh})
	})
}

// SandboxWatch feeds the store's sandbox records to a worker, which
// retires executions the control plane has superseded.
func SandboxWatch(st *store.Store) worker.SandboxWatcher { return sandboxWatch{st} }

type sandboxWatch struct{ st *store.Store }

func (s sandboxWatch) WatchSandboxes(ctx context.Context, fn func(worker.SandboxEvent)) error {
	return s.st.WatchSandboxes(ctx, func(ev store.SandboxEvent) {
		if ev.Synced {
			fn(worker.SandboxEvent{Synced: true})
			return
		}
		fn(sandboxEvent(ev.Record, ev.Deleted))
	})
}

// ListSandboxes makes sandboxWatch a worker.SandboxLister (one read of
// every record: what a fenced worker applies before serving again).
func (s sandboxWatch) ListSandboxes(ctx context.Context) ([]worker.SandboxEvent, error) {
	es, err := s.st.ListSandboxes(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]worker.SandboxEvent, 0, len(es))
	for _, e := range es {
		out = append(out, sandboxEvent(e.Record, false))
	}
	return out, nil
}

func sandboxEvent(r store.SandboxRecord, deleted bool) worker.SandboxEvent {
	wev := worker.SandboxEvent{SandboxID: r.ID, Deleted: deleted, Ended: r.State.Terminal(), Route: r.Route}
	if r.PendingRoute != nil {
		wev.Pending = *r.PendingRoute
	}
	return wev
}
