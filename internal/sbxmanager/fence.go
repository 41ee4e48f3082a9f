package sbxmanager

// Fencing: while the worker's registration lease may have lapsed (the
// worker could not renew it in time), the control plane may replace any of
// its executions on another worker. The manager then serves nothing: every
// guest-API and service-port request is refused before admission reaches
// an activation, and every stream opened before the fence ends, through
// the same lease cancellation a replacement uses. The sandboxes keep
// running: the worker retires what the control plane replaced once it
// reaches the store again, and only then lifts the fence.

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

// ReasonWorkerFenced is the reason of a request refused while the worker
// is fenced.
const ReasonWorkerFenced = "worker fenced"

// fence is the manager's serving epoch: ctx ends when the worker is fenced
// and is replaced by a new one when it is unfenced.
type fence struct {
	mu     sync.Mutex
	ctx    context.Context
	cancel context.CancelFunc
	why    string
}

func newFence() *fence {
	ctx, cancel := context.WithCancel(context.Background())
	return &fence{ctx: ctx, cancel: cancel}
}

// epoch returns the current serving epoch (ended while fenced).
func (f *fence) epoch() context.Context {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ctx
}

// Fence stops serving: new requests for any sandbox are refused (guest
// API and service ports with RefreshRoute, node-api's lifecycle calls
// with Unavailable) and open streams, terminals, watches and service-port
// connections end as if their execution had been replaced. Sandboxes keep
// running. why is logged and told to refused clients. Idempotent.
func (m *Manager) Fence(why string) {
	f := m.fence
	f.mu.Lock()
	already := f.ctx.Err() != nil
	f.why = why
	f.cancel()
	f.mu.Unlock()
	if !already {
		m.metrics.fenced.Set(1)
		m.metrics.fences.Inc()
		m.log.Warn("worker fenced: serving nothing until the control plane's view is applied again", "why", why)
	}
}

// Unfence serves again. The caller has applied the control plane's view
// (retired every execution the store no longer routes here) after
// reaching the store.
func (m *Manager) Unfence() {
	f := m.fence
	f.mu.Lock()
	if f.ctx.Err() == nil {
		f.mu.Unlock()
		return
	}
	f.ctx, f.cancel = context.WithCancel(context.Background())
	f.why = ""
	f.mu.Unlock()
	m.metrics.fenced.Set(0)
	m.log.Info("worker unfenced: serving again")
}

// Fenced reports whether the manager is fenced, and why.
func (m *Manager) Fenced() (bool, string) {
	f := m.fence
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ctx.Err() != nil, f.why
}

// FencedError is the error of a control call refused while fenced
// (errdefs.ErrUnavailable), or nil when the manager serves.
func (m *Manager) FencedError() error {
	if fenced, why := m.Fenced(); fenced {
		return errdefs.WithRetryAfter(fmt.Errorf("%w: %s: worker %s serves nothing until its registration is renewed and the control plane's view applied (%s)",
			errdefs.ErrUnavailable, ReasonWorkerFenced, m.cfg.WorkerID, why), time.Second)
	}
	return nil
}

// refuseFenced answers a data-plane request refused because of the fence:
// RefreshRoute (421), so the edge resolves the sandbox's current
// execution again and reaches it once the control plane has replaced
// this one; the request was not forwarded.
func (m *Manager) refuseFenced(w http.ResponseWriter) {
	_, why := m.Fenced()
	m.metrics.fencedRefusals.Inc()
	writeOutcome(w, http.StatusMisdirectedRequest, spacev1.OutcomeRefreshRoute,
		fmt.Sprintf("%s: worker %s is not serving (%s); resolve the sandbox's route again", ReasonWorkerFenced, m.cfg.WorkerID, why))
}
