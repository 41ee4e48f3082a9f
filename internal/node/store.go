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
		wev := worker.SandboxEvent{SandboxID: ev.Record.ID, Deleted: ev.Deleted, Ended: ev.Record.State.Terminal(), Route: ev.Record.Route}
		if ev.Record.PendingRoute != nil {
			wev.Pending = *ev.Record.PendingRoute
		}
		fn(wev)
	})
}
