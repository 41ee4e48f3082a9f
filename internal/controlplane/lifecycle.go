package controlplane

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/store"
)

// Lifecycle operations.
//
// State machine of a sandbox record (every arrow is a revision-guarded
// write; a transitional state carries the operation's id in Op, and only
// that operation may move the record out of it):
//
//	running --pause--> pausing --> paused
//	paused --resume/connect--> resuming --> running    (same worker: thaw, same execution)
//	paused --resume elsewhere--> resuming --> running  (new generation, files restored)
//	running|paused --migrate--> migrating --> running  (new generation, files restored)
//	running|paused --snapshot--> snapshotting --> (the state it came from)
//	any non-terminal --kill--> killed (kill always wins; an operation that
//	                                   finds its record killed undoes its install)
//
// One operation at a time: beginning an operation on a record that already
// holds one fails with 409 (errBusy). Connect joins an operation in flight
// instead (it waits for the record to settle, then acts on the result), and
// so do capability requests (see waitSettled).

// Operation kinds (LifecycleOp.Kind).
const (
	opPause    = "pause"
	opResume   = "resume"
	opMigrate  = "migrate"
	opSnapshot = "snapshot"
)

// errBusy marks a refusal because another lifecycle operation holds the record.
var errBusy = fmt.Errorf("%w: lifecycle operation in progress", errdefs.ErrConflict)

// errOpLost: the record left the operation's hands (killed, or recovered by
// the reaper after the operation overran its deadline).
var errOpLost = fmt.Errorf("%w: sandbox changed during the operation", errdefs.ErrConflict)

// Execution states in the executions history.
const (
	execRunning = "running"
	execPaused  = "paused"
	execRetired = "retired"
	execFailed  = "failed"
)

// opDeadline is how long an operation may hold a record before the reaper
// recovers it (every node call it makes has its own, shorter, deadline).
func (s *Server) opDeadline() time.Duration {
	return s.cfg.InstallTimeout + 4*s.cfg.NodeTimeout + time.Minute
}

// beginOp moves a live record into the transitional state `to` under a new
// operation, after allow accepted the current record. team "" skips the
// ownership check.
func (s *Server) beginOp(ctx context.Context, id, team, kind string, to store.SandboxState, target string,
	allow func(store.SandboxRecord) error) (store.SandboxRecord, *store.LifecycleOp, error) {
	op := &store.LifecycleOp{ID: randHex(8), Kind: kind, StartedAt: s.now().UTC(), Target: target, Owner: s.instance}
	rec, _, err := s.st.MutateSandbox(ctx, id, func(r *store.SandboxRecord) error {
		switch {
		case (team != "" && r.TeamID != team) || r.State.Terminal():
			return fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
		case r.Op != nil:
			return fmt.Errorf("%w: sandbox %s: a %s operation is in progress (since %s); one lifecycle operation at a time, retry when it ends",
				errBusy, id, r.Op.Kind, r.Op.StartedAt.Format(time.RFC3339))
		case r.State == store.StateCreating:
			return fmt.Errorf("%w: sandbox %s is still starting", errBusy, id)
		}
		if err := allow(*r); err != nil {
			return err
		}
		op.From = r.State
		r.State = to
		r.Op = op
		return nil
	})
	if errors.Is(err, errdefs.ErrNotFound) {
		return rec, nil, fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
	}
	if err != nil {
		return rec, nil, err
	}
	s.log.Info("lifecycle operation started", "sandbox", id, "op", kind, "op_id", op.ID, "from", op.From,
		"generation", rec.Route.Generation, "worker", rec.Route.WorkerID)
	return rec, op, nil
}

// stepOp applies fn to the record while op still holds it.
func (s *Server) stepOp(ctx context.Context, id string, op *store.LifecycleOp, fn func(*store.SandboxRecord) error) (store.SandboxRecord, error) {
	rec, _, err := s.st.MutateSandbox(ctx, id, func(r *store.SandboxRecord) error {
		if r.Op == nil || r.Op.ID != op.ID {
			return fmt.Errorf("%w: sandbox %s is %s now", errOpLost, id, r.State)
		}
		return fn(r)
	})
	if errors.Is(err, errdefs.ErrNotFound) {
		return rec, fmt.Errorf("%w: sandbox %s was removed", errOpLost, id)
	}
	return rec, err
}

// stepOpPlaced is stepOp for a step that places an execution on
// p.WorkerID: store.ErrPlacementMoved when another placement on that
// worker committed since p was read.
func (s *Server) stepOpPlaced(ctx context.Context, id string, op *store.LifecycleOp, p store.Placement, fn func(*store.SandboxRecord) error) (store.SandboxRecord, error) {
	for range 8 {
		r, rev, err := s.st.GetSandbox(ctx, id)
		if errors.Is(err, errdefs.ErrNotFound) {
			return store.SandboxRecord{}, fmt.Errorf("%w: sandbox %s was removed", errOpLost, id)
		}
		if err != nil {
			return store.SandboxRecord{}, err
		}
		if r.Op == nil || r.Op.ID != op.ID {
			return store.SandboxRecord{}, fmt.Errorf("%w: sandbox %s is %s now", errOpLost, id, r.State)
		}
		if err := fn(&r); err != nil {
			return store.SandboxRecord{}, err
		}
		_, err = s.st.UpdateSandboxPlaced(ctx, id, rev, r, p)
		if err == nil {
			return r, nil
		}
		if errors.Is(err, errdefs.ErrNotFound) {
			return store.SandboxRecord{}, fmt.Errorf("%w: sandbox %s was removed", errOpLost, id)
		}
		if errors.Is(err, store.ErrPlacementMoved) || !errors.Is(err, errdefs.ErrConflict) {
			return store.SandboxRecord{}, err
		}
	}
	return store.SandboxRecord{}, fmt.Errorf("%w: sandbox %s: too much contention", errdefs.ErrConflict, id)
}

// finishOp applies fn (which sets the stable state) and releases the record.
func (s *Server) finishOp(ctx context.Context, id string, op *store.LifecycleOp, fn func(*store.SandboxRecord)) (store.SandboxRecord, error) {
	rec, err := s.stepOp(ctx, id, op, func(r *store.SandboxRecord) error {
		fn(r)
		r.Op = nil
		return nil
	})
	if err == nil {
		s.log.Info("lifecycle operation ended", "sandbox", id, "op", op.Kind, "op_id", op.ID, "state", rec.State,
			"generation", rec.Route.Generation, "worker", rec.Route.WorkerID)
	}
	return rec, err
}

// abortOp returns the record to state (best effort: when the record left the
// operation's hands there is nothing to undo in it).
func (s *Server) abortOp(ctx context.Context, id string, op *store.LifecycleOp, state store.SandboxState) {
	if _, err := s.finishOp(ctx, id, op, func(r *store.SandboxRecord) { r.State = state }); err != nil {
		s.log.Warn("lifecycle operation: releasing the record failed", "sandbox", id, "op", op.Kind, "err", err)
	}
}

// setExec sets the state of the history entry of route (appending one when
// missing).
func setExec(r *store.SandboxRecord, route identity.Route, state string, at time.Time) {
	for i := range r.Executions {
		if r.Executions[i].Route == route {
			r.Executions[i].State = state
			if state == execRetired || state == execFailed {
				t := at
				r.Executions[i].EndedAt = &t
			}
			return
		}
	}
	e := spacev1.Execution{Route: route, State: state, StartedAt: at}
	if state == execRetired || state == execFailed {
		t := at
		e.EndedAt = &t
	}
	r.Executions = append(r.Executions, e)
}

// waitSettled waits (bounded by max and ctx) until the record is no longer
// in a transitional state and returns it; on timeout it returns the record
// as last read.
func (s *Server) waitSettled(ctx context.Context, id string, max time.Duration) (store.SandboxRecord, error) {
	deadline := time.Now().Add(max)
	// Operations take from milliseconds (a pause) to minutes (a move of a
	// large layer): poll often at first.
	poll := &backoff.ExponentialBackOff{InitialInterval: 10 * time.Millisecond, Multiplier: 2, MaxInterval: 100 * time.Millisecond}
	poll.Reset()
	for {
		rec, _, err := s.st.GetSandbox(ctx, id)
		if err != nil || !rec.State.Transitional() || time.Now().After(deadline) {
			return rec, err
		}
		t := time.NewTimer(poll.NextBackOff())
		select {
		case <-ctx.Done():
			t.Stop()
			return rec, ctx.Err()
		case <-t.C:
		}
	}
}

// recoverOp releases a record whose operation overran opDeadline (its
// control plane lost the store, or died and its worker is gone too): the
// sandbox becomes paused on its published route (no capability is issued
// for a paused sandbox; a resume thaws or restores it), and an unpublished
// install is torn down. An operation whose control plane died (orphaned:
// its registration is gone) is released at once instead, as soon as the
// published route's worker is registered: a sandbox the operation found
// running is thawed there and runs again (when its processes died with
// that worker, the lost-execution recovery takes it from there), one found
// paused stays paused.
func (s *Server) recoverOp(ctx context.Context, id, opID string, orphaned bool) error {
	back := store.StatePaused
	if orphaned {
		rec, _, err := s.st.GetSandbox(ctx, id)
		if err != nil {
			return err
		}
		if rec.Op == nil || rec.Op.ID != opID {
			return fmt.Errorf("%w: operation ended", errdefs.ErrConflict)
		}
		u, alive := s.liveWorker(ctx, rec.Route.WorkerID)
		if !alive && s.now().Sub(rec.Op.StartedAt) <= s.opDeadline() {
			return fmt.Errorf("%w: worker %s of the orphaned operation is not registered (yet)", errdefs.ErrUnavailable, rec.Route.WorkerID)
		}
		if alive && rec.Op.From == store.StateRunning {
			if err := s.node.resume(ctx, u, rec.Route); err == nil || executionLost(err) {
				back = store.StateRunning
			} else {
				s.log.Warn("thawing after an orphaned operation failed; the sandbox stays paused", "sandbox", id, "err", err)
			}
		}
	}
	var pending *identity.Route
	rec, _, err := s.st.MutateSandbox(ctx, id, func(r *store.SandboxRecord) error {
		if r.Op == nil || r.Op.ID != opID {
			return fmt.Errorf("%w: operation ended", errdefs.ErrConflict)
		}
		if !orphaned && s.now().Sub(r.Op.StartedAt) <= s.opDeadline() {
			return fmt.Errorf("%w: operation within its deadline", errdefs.ErrConflict)
		}
		now := s.now().UTC()
		pending = r.PendingRoute
		if pending != nil {
			setExec(r, *pending, execFailed, now)
		}
		r.PendingRoute = nil
		r.Op = nil
		r.State = back
		if back == store.StateRunning {
			setExec(r, r.Route, execRunning, now)
		} else {
			r.EndAt = now.Add(s.cfg.MaxTimeout)
			setExec(r, r.Route, execPaused, now)
		}
		return nil
	})
	if err != nil {
		return err
	}
	why := "lifecycle operation overran its deadline"
	if orphaned {
		why = "lifecycle operation's control plane is gone"
	}
	s.log.Warn(why+"; record released", "sandbox", id, "op_id", opID, "state", back,
		"generation", rec.Route.Generation, "worker", rec.Route.WorkerID)
	if pending != nil {
		if u, ok := s.liveWorker(ctx, pending.WorkerID); ok {
			if err := s.node.teardown(ctx, u, *pending); err != nil {
				s.log.Warn("teardown of an unpublished install failed", "sandbox", id, "err", err)
			}
		}
	}
	return nil
}

// teardownPending tears down the unpublished install of a killed record.
func (s *Server) teardownPending(ctx context.Context, rec store.SandboxRecord) {
	p := rec.PendingRoute
	if p == nil {
		return
	}
	if u, ok := s.liveWorker(ctx, p.WorkerID); ok {
		if err := s.node.teardown(ctx, u, *p); err != nil {
			s.log.Warn("teardown of an unpublished install failed", "sandbox", rec.ID, "worker", p.WorkerID, "err", err)
		}
	}
}
