package sbxmanager

// Lifecycle of an installed execution on this worker: pause, resume,
// snapshot, retire and restore-on-install (DESIGN.md sections 5, 7, 10).
//
// Every operation names the execution by its route and acts only when the
// installed record has the same identity epoch (a late call for an older
// execution never touches a newer one). Operations on one sandbox are
// serialized with Install and Teardown by the per-sandbox lock.
//
//   - Pause freezes the sandbox (substrate Instance.Pause: the cgroup
//     freezer on ns). The execution, its processes, capabilities and open
//     streams stay; the streams simply see no traffic until Resume. New
//     requests for a paused execution are admitted as usual (so a stale or
//     forged capability still gets RefreshRoute/Deny) and then answered
//     409 Conflict with a JSON error of reason "paused" instead of being
//     forwarded into a frozen guest where they would hang. The control
//     plane resumes (or the edge gets a new route) and the client retries.
//   - Resume thaws it. Both are idempotent.
//   - Snapshot (snapshot.go) archives the writable layer (its root from
//     the substrate's LayerPreparer) into the snapshot store, or, for a
//     substrate that saves its instances' whole state, stores that state
//     (the instance must then be running here). The execution must be
//     paused (or, for a layer, not running: after a retire or a worker
//     restart) so the layer is quiescent; the per-sandbox lock keeps it
//     paused until the archive is stored.
//   - Retire persists Retired=true in the runtime record first (bbolt,
//     fsync), then the in-memory record (from then on Admit answers
//     RefreshRoute for the execution, even for unexpired capabilities),
//     then ends the activation's lease (streams end at once with "execution
//     replaced") and stops the activation. The record and the activation
//     directory stay until Teardown. Idempotent; retiring a route older
//     than the installed one, or one this worker has no record of, is a
//     no-op success.
//   - Install with RestoreSnapshot restores the archive into the new
//     activation's (empty) writable layer, or fetches the saved state
//     that the substrate then starts from, before the substrate starts, and
//     before a replaced execution is stopped, so a missing or hostile
//     snapshot fails the install without touching what runs.

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
)

// ReasonPaused is the JSON error reason of a request for a paused execution.
const ReasonPaused = spacev1.ReasonPaused

// lookup returns the installed record for route's sandbox and its
// activation, checking that the record is route's execution.
func (m *Manager) lookup(op string, route identity.Route) (record, *activation, error) {
	m.mu.RLock()
	rec, ok := m.records[route.SandboxID]
	act := m.active[route.SandboxID]
	closed := m.closed
	m.mu.RUnlock()
	switch {
	case closed:
		return rec, nil, fmt.Errorf("%s %s: %w: manager closed", op, route.SandboxID, errdefs.ErrUnavailable)
	case !ok:
		return rec, nil, fmt.Errorf("%s %s: %w: no execution installed on this worker", op, route.SandboxID, errdefs.ErrNotFound)
	case rec.Route.Epoch() != route.Epoch():
		return rec, nil, fmt.Errorf("%s %s: %w: installed execution is %s", op, route.SandboxID, errdefs.ErrConflict, rec.Route)
	}
	return rec, act, nil
}

func validRoute(op string, route identity.Route) error {
	if err := route.Validate(); err != nil {
		return fmt.Errorf("%s: %w: %v", op, errdefs.ErrInvalid, err)
	}
	return nil
}

// liveActivation is lookup for operations that need a running, not retired
// activation.
func (m *Manager) liveActivation(op string, route identity.Route) (*activation, error) {
	rec, act, err := m.lookup(op, route)
	if err != nil {
		return nil, err
	}
	if rec.Retired {
		return nil, fmt.Errorf("%s %s: %w: execution %s is retired", op, route.SandboxID, errdefs.ErrConflict, rec.Route)
	}
	if act == nil {
		return nil, errdefs.WithReason(fmt.Errorf("%s %s: %w: execution %s is not running on this worker (restarted?)", op, route.SandboxID, errdefs.ErrConflict, rec.Route), spacev1.ReasonExecutionLost)
	}
	return act, nil
}

// Pause freezes the execution named by route. Idempotent.
func (m *Manager) Pause(ctx context.Context, route identity.Route) error {
	if err := validRoute("pause", route); err != nil {
		return err
	}
	unlock := m.lockSandbox(route.SandboxID)
	defer unlock()
	act, err := m.liveActivation("pause", route)
	if err != nil {
		return err
	}
	if act.paused.Load() {
		return nil
	}
	// New requests stop before the freeze begins, and unary requests
	// already inside the guest get to finish (bounded) rather than fail.
	act.paused.Store(true)
	m.drainUnary(act, pauseDrain)
	if !m.caps(route).SavesState { // a move would restart the processes
		m.drainStarts(act, m.cfg.PauseStreamGrace)
	}
	if err := act.inst.Pause(ctx); err != nil {
		act.paused.Store(false)
		return fmt.Errorf("pause %s: %w", route.SandboxID, lifecycleErr(ctx, err))
	}
	crashpoint.Hit(crashpoint.WorkerPaused)
	m.log.Info("execution paused", "sandbox", route.SandboxID, "generation", route.Generation)
	return nil
}

// pauseDrain bounds how long Pause waits for unary requests in flight.
const pauseDrain = 5 * time.Second

// drainUnary waits until no unary request holds act's gate, or until max.
// TryLock, not Lock: a request that never ends must not block a pause.
func (m *Manager) drainUnary(act *activation, max time.Duration) {
	deadline := time.Now().Add(max)
	for !act.gate.TryLock() {
		if time.Now().After(deadline) {
			m.log.Warn("pausing with requests still in flight", "sandbox", act.route.SandboxID)
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	act.gate.Unlock()
}

// drainStarts waits until no command started through this worker is still
// running in act, or until max. A command's stream is not cut: the freeze
// holds it, and Resume continues it.
func (m *Manager) drainStarts(act *activation, max time.Duration) {
	if max <= 0 || act.starts.Load() == 0 {
		return
	}
	deadline := time.Now().Add(max)
	for act.starts.Load() > 0 {
		if time.Now().After(deadline) {
			m.log.Info("pausing with commands still running", "sandbox", act.route.SandboxID, "commands", act.starts.Load())
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Resume thaws the execution named by route. Idempotent.
func (m *Manager) Resume(ctx context.Context, route identity.Route) error {
	if err := validRoute("resume", route); err != nil {
		return err
	}
	unlock := m.lockSandbox(route.SandboxID)
	defer unlock()
	act, err := m.liveActivation("resume", route)
	if err != nil {
		return err
	}
	if !act.paused.Load() {
		return nil
	}
	if err := act.inst.Resume(ctx); err != nil {
		return fmt.Errorf("resume %s: %w", route.SandboxID, lifecycleErr(ctx, err))
	}
	crashpoint.Hit(crashpoint.WorkerResumed)
	act.paused.Store(false)
	m.log.Info("execution resumed", "sandbox", route.SandboxID, "generation", route.Generation)
	return nil
}

func lifecycleErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
	}
	return err
}

// Paused reports whether the sandbox's running activation is paused.
func (m *Manager) Paused(sandbox string) bool {
	m.mu.RLock()
	act := m.active[sandbox]
	m.mu.RUnlock()
	return act != nil && act.paused.Load()
}

// Retire marks the execution named by route retired (durably, first),
// ends its streams and stops it. See the file comment.
func (m *Manager) Retire(ctx context.Context, route identity.Route) error {
	if err := validRoute("retire", route); err != nil {
		return err
	}
	unlock := m.lockSandbox(route.SandboxID)
	defer unlock()
	_, err := m.retireLocked(route)
	return err
}

// retireLocked runs under the sandbox lock. It reports whether it retired
// anything.
func (m *Manager) retireLocked(route identity.Route) (bool, error) {
	m.mu.RLock()
	rec, ok := m.records[route.SandboxID]
	act := m.active[route.SandboxID]
	m.mu.RUnlock()
	if !ok {
		return false, nil // nothing served for it here
	}
	if rec.Route.Epoch() != route.Epoch() {
		if rec.Route.Generation > route.Generation {
			return false, nil // already superseded by a newer install
		}
		return false, fmt.Errorf("retire %s: %w: installed execution is %s, not %s", route.SandboxID, errdefs.ErrConflict, rec.Route, route)
	}
	retired := false
	var persistErr error
	if !rec.Retired {
		rec.Retired = true
		if err := m.store.put(rec); err != nil { // bbolt commit: fsynced
			// Fail closed: the control plane has replaced it, so it
			// stops being served all the same; only the tombstone is
			// missing (a restart finds the record live and the control
			// plane's view retires it again before serving it).
			persistErr = fmt.Errorf("retire %s: persist record: %w", route.SandboxID, err)
		}
		retired = true
	}
	m.mu.Lock()
	m.records[route.SandboxID] = rec
	if act != nil && m.active[route.SandboxID] == act {
		delete(m.active, route.SandboxID)
	}
	m.mu.Unlock()
	if act != nil {
		m.stopActivation(act, "retired")
	}
	// Its files are superseded by the execution that replaced it (a move
	// publishes only after the new one restored them), and nothing else
	// removes them: the record stays as a tombstone and a kill tears down
	// the sandbox's current execution on its own worker. Left, the layer
	// (a disk image up to the quota) outlived the sandbox. Leftovers that
	// could not be ended at start may still hold it: those stay.
	if !m.unreclaimed[route.SandboxID] && persistErr == nil {
		if err := os.RemoveAll(rec.Dir); err != nil {
			m.log.Warn("removing a retired execution's files", "sandbox", route.SandboxID, "err", err)
		}
	}
	if persistErr != nil {
		return retired, persistErr
	}
	if retired {
		m.log.Info("execution retired", "sandbox", route.SandboxID, "generation", route.Generation, "execution", route.ExecutionID)
	}
	return retired, nil
}

// Installed returns the installed runtime record of a sandbox.
func (m *Manager) Installed(sandbox string) (identity.Record, bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	rec, ok := m.records[sandbox]
	return rec.Record, ok
}
