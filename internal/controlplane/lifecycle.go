package controlplane

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

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

const moveNote = "the sandbox now runs as a new execution: files were kept (writable layer restored from a snapshot), processes were restarted"

// moveNoteVM is the note of a move on the microvm substrate, whose
// snapshots hold the whole machine.
const moveNoteVM = "the sandbox now runs as a new execution: memory, processes and files were kept (full VM snapshot restored)"

// opDeadline is how long an operation may hold a record before the reaper
// recovers it (every node call it makes has its own, shorter, deadline).
func (s *Server) opDeadline() time.Duration {
	return s.cfg.InstallTimeout + 4*s.cfg.NodeTimeout + time.Minute
}

// ---- node calls ----

func (s *Server) nodeLifecycle(ctx context.Context, nodeURL, path string, route identity.Route) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.NodeTimeout)
	defer cancel()
	return s.nodeCall(ctx, nodeURL, path, route, spacev1.LifecycleRequest{Route: route}, nil)
}

func (s *Server) nodeSnapshot(ctx context.Context, nodeURL string, route identity.Route, snapID string) (spacev1.SnapshotResponse, error) {
	// Archiving a large writable layer takes longer than a control call.
	ctx, cancel := context.WithTimeout(ctx, s.cfg.InstallTimeout)
	defer cancel()
	var resp spacev1.SnapshotResponse
	err := s.nodeCall(ctx, nodeURL, spacev1.NodePathSnapshot, route, spacev1.SnapshotRequest{Route: route, SnapshotID: snapID}, &resp)
	if err == nil && resp.SnapshotID != "" && resp.SnapshotID != snapID {
		err = fmt.Errorf("%w: worker %s stored snapshot %q, asked for %q", errdefs.ErrUpstream, route.WorkerID, truncate(resp.SnapshotID, 80), snapID)
	}
	return resp, err
}

// nodeRetire tells the old worker its execution is retired. A 404 (nothing
// installed any more) counts as done.
func (s *Server) nodeRetire(ctx context.Context, nodeURL string, route identity.Route) error {
	err := s.nodeLifecycle(ctx, nodeURL, spacev1.NodePathRetire, route)
	var ne *nodeError
	if errors.As(err, &ne) && ne.Status == http.StatusNotFound {
		return nil
	}
	return err
}

// definiteRefusal reports whether a node call failed with an answer that
// says nothing was done (a 4xx), as opposed to an unknown outcome.
func definiteRefusal(err error) bool {
	var ne *nodeError
	return errors.As(err, &ne) && ne.Status >= 400 && ne.Status < 500
}

// liveWorker returns the worker's node URL when it is registered now.
func (s *Server) liveWorker(ctx context.Context, id string) (string, bool) {
	w, err := s.st.GetWorker(ctx, id)
	if err != nil || w.NodeURL == "" {
		return "", false
	}
	return w.NodeURL, true
}

func limitsOf(rec store.SandboxRecord) spacev1.Limits {
	return spacev1.Limits{MemoryBytes: int64(rec.MemoryMB) << 20, CPUMillis: int64(rec.CPUCount) * 1000, DiskBytes: int64(rec.DiskSizeMB) << 20}
}

func newSnapshotID() string { return "snap-" + randHex(12) }

// ---- operation bookkeeping ----

// beginOp moves a live record into the transitional state `to` under a new
// operation, after allow accepted the current record. team "" skips the
// ownership check.
func (s *Server) beginOp(ctx context.Context, id, team, kind string, to store.SandboxState, target string,
	allow func(store.SandboxRecord) error) (store.SandboxRecord, *store.LifecycleOp, error) {
	op := &store.LifecycleOp{ID: randHex(8), Kind: kind, StartedAt: s.now().UTC(), Target: target}
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
	delay := 10 * time.Millisecond
	for {
		rec, _, err := s.st.GetSandbox(ctx, id)
		if err != nil || !rec.State.Transitional() || time.Now().After(deadline) {
			return rec, err
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return rec, ctx.Err()
		case <-t.C:
		}
		delay = min(2*delay, 100*time.Millisecond)
	}
}

// ---- pause ----

// pauseSandbox freezes the running execution on its worker (same execution:
// route and generation unchanged). check, when non-nil, must accept the
// record (the reaper re-checks the timeout).
func (s *Server) pauseSandbox(ctx context.Context, id, team string, check func(store.SandboxRecord) error) error {
	ctx = context.WithoutCancel(ctx)
	rec, op, err := s.beginOp(ctx, id, team, opPause, store.StatePausing, "", func(r store.SandboxRecord) error {
		switch r.State {
		case store.StateRunning:
		case store.StatePaused:
			return fmt.Errorf("%w: sandbox %s is already paused", errdefs.ErrConflict, id)
		default:
			return fmt.Errorf("%w: sandbox %s is %s", errdefs.ErrConflict, id, r.State)
		}
		if check != nil {
			return check(r)
		}
		return nil
	})
	if err != nil {
		return err
	}
	log := s.log.With("sandbox", id, "generation", rec.Route.Generation, "worker", rec.Route.WorkerID)
	nodeURL := s.nodeURL(ctx, rec)
	if err := s.nodeLifecycle(ctx, nodeURL, spacev1.NodePathPause, rec.Route); err != nil {
		log.Warn("pause failed", "err", err)
		back := store.StateRunning
		if !definiteRefusal(err) {
			// Unknown outcome: thaw, so a running record never hides a
			// frozen execution; if that fails too, keep it paused
			// (no capability is issued; a resume retries).
			if rerr := s.nodeLifecycle(ctx, nodeURL, spacev1.NodePathResume, rec.Route); rerr != nil {
				log.Warn("thaw after failed pause failed; the sandbox stays paused", "err", rerr)
				back = store.StatePaused
			}
		}
		now := s.now().UTC()
		if _, ferr := s.finishOp(ctx, id, op, func(r *store.SandboxRecord) {
			r.State = back
			if back == store.StatePaused {
				r.EndAt = now.Add(s.cfg.MaxTimeout)
				setExec(r, r.Route, execPaused, now)
			}
		}); ferr != nil {
			log.Warn("releasing the record failed", "err", ferr)
		}
		return fmt.Errorf("pause sandbox %s: %w", id, err)
	}
	now := s.now().UTC()
	_, err = s.finishOp(ctx, id, op, func(r *store.SandboxRecord) {
		r.State = store.StatePaused
		// A paused sandbox is kept for MaxTimeout, then killed.
		r.EndAt = now.Add(s.cfg.MaxTimeout)
		r.PausedSnapshot = ""
		setExec(r, r.Route, execPaused, now)
	})
	if err != nil {
		return fmt.Errorf("pause sandbox %s: %w", id, err)
	}
	return nil
}

// ---- resume ----

// resumeOpts tune a resume.
type resumeOpts struct {
	// Timeout is the new time to live, from now.
	Timeout time.Duration
	// Restart asks for a new execution with the files restored even when
	// the old worker could thaw the paused one (E2B's memory:false).
	Restart bool
	// AutoPause, when non-nil, replaces the record's autoPause.
	AutoPause *bool
}

// resumeSandbox resumes a paused sandbox: on its worker when that worker is
// registered (node resume: same execution), else elsewhere (see move). It
// returns the record after the resume and, for a move, what moved.
func (s *Server) resumeSandbox(ctx context.Context, id, team string, o resumeOpts) (store.SandboxRecord, *spacev1.MigrateResponse, error) {
	ctx = context.WithoutCancel(ctx)
	rec, op, err := s.beginOp(ctx, id, team, opResume, store.StateResuming, "", func(r store.SandboxRecord) error {
		switch r.State {
		case store.StatePaused:
			return nil
		case store.StateRunning:
			return fmt.Errorf("%w: sandbox %s is already running", errdefs.ErrConflict, id)
		}
		return fmt.Errorf("%w: sandbox %s is %s", errdefs.ErrConflict, id, r.State)
	})
	if err != nil {
		return rec, nil, err
	}
	nodeURL, alive := s.liveWorker(ctx, rec.Route.WorkerID)
	if alive && !o.Restart {
		if err := s.nodeLifecycle(ctx, nodeURL, spacev1.NodePathResume, rec.Route); err != nil {
			s.log.Warn("resume failed; the sandbox stays paused", "sandbox", id, "worker", rec.Route.WorkerID, "err", err)
			s.abortOp(ctx, id, op, store.StatePaused)
			return rec, nil, fmt.Errorf("resume sandbox %s: %w", id, err)
		}
		now := s.now().UTC()
		rec, err = s.finishOp(ctx, id, op, func(r *store.SandboxRecord) {
			r.State = store.StateRunning
			r.EndAt = now.Add(o.Timeout)
			r.PausedSnapshot = ""
			if o.AutoPause != nil {
				r.AutoPause = *o.AutoPause
			}
			setExec(r, r.Route, execRunning, now)
		})
		if err != nil {
			return rec, nil, fmt.Errorf("resume sandbox %s: %w", id, err)
		}
		return rec, nil, nil
	}
	var exclude []string
	if !alive {
		exclude = append(exclude, rec.Route.WorkerID)
	}
	return s.move(ctx, rec, op, "", exclude, o.Timeout, o.AutoPause)
}

// ---- migrate ----

// migrateSandbox moves a running or paused sandbox to another worker (the
// scheduler's pick when target is empty). It ends running.
func (s *Server) migrateSandbox(ctx context.Context, id, team, target string) (store.SandboxRecord, *spacev1.MigrateResponse, error) {
	ctx = context.WithoutCancel(ctx)
	if target != "" {
		if len(target) > 253 || strings.ContainsAny(target, "/ \t\r\n") || !utf8.ValidString(target) {
			return store.SandboxRecord{}, nil, fmt.Errorf("%w: target_worker must be a worker id (1..253 characters without '/' or spaces)", errdefs.ErrInvalid)
		}
		if _, err := s.st.GetWorker(ctx, target); errors.Is(err, errdefs.ErrNotFound) {
			return store.SandboxRecord{}, nil, fmt.Errorf("%w: target_worker %q is not registered", errdefs.ErrInvalid, target)
		} else if err != nil {
			return store.SandboxRecord{}, nil, fmt.Errorf("%w: worker registry: %v", errdefs.ErrUnavailable, err)
		}
	}
	rec, op, err := s.beginOp(ctx, id, team, opMigrate, store.StateMigrating, target, func(r store.SandboxRecord) error {
		if r.State != store.StateRunning && r.State != store.StatePaused {
			return fmt.Errorf("%w: sandbox %s is %s", errdefs.ErrConflict, id, r.State)
		}
		if target != "" && target == r.Route.WorkerID {
			return fmt.Errorf("%w: sandbox %s already runs on worker %s; name another target_worker", errdefs.ErrInvalid, id, target)
		}
		return nil
	})
	if err != nil {
		return rec, nil, err
	}
	timeout := time.Duration(0) // keep the running sandbox's end
	if op.From == store.StatePaused {
		timeout = s.cfg.DefaultTimeout
	}
	return s.move(ctx, rec, op, target, []string{rec.Route.WorkerID}, timeout, nil)
}

// move runs a sandbox as a new execution with its files kept. Node calls,
// in order:
//
//  1. pause on the old worker (only when the operation began running);
//  2. snapshot of the paused execution's writable layer on the old worker
//     (skipped when a snapshot of this paused execution exists; required
//     when the old worker is gone);
//  3. (store) the generation is bumped and the new route recorded as
//     pending, revision-guarded;
//  4. install with RestoreSnapshot on the target (persisted there before
//     the route is published);
//  5. (store) publish: the new route becomes Route, state running;
//  6. retire of the old execution on the old worker.
//
// A failure before 5 unpublishes nothing: the sandbox stays paused on the
// old worker with its files (a migration that began running thaws the old
// execution again when it can), and a target install is torn down.
func (s *Server) move(ctx context.Context, rec store.SandboxRecord, op *store.LifecycleOp, target string, exclude []string,
	timeout time.Duration, autoPause *bool) (store.SandboxRecord, *spacev1.MigrateResponse, error) {
	id, old := rec.ID, rec.Route
	log := s.log.With("sandbox", id, "op", op.Kind, "generation", old.Generation, "worker", old.WorkerID)
	oldURL, alive := s.liveWorker(ctx, old.WorkerID)
	wasRunning := op.From == store.StateRunning

	// giveUp releases the record after a failure before publication.
	giveUp := func(err error, mut func(*store.SandboxRecord)) (store.SandboxRecord, *spacev1.MigrateResponse, error) {
		back := store.StatePaused
		if wasRunning && alive {
			if rerr := s.nodeLifecycle(ctx, oldURL, spacev1.NodePathResume, old); rerr == nil {
				back = store.StateRunning
			} else {
				log.Warn("thawing the old execution failed; the sandbox stays paused", "err", rerr)
			}
		}
		now := s.now().UTC()
		r, ferr := s.finishOp(ctx, id, op, func(r *store.SandboxRecord) {
			if mut != nil {
				mut(r)
			}
			r.State = back
			if back == store.StateRunning {
				r.PausedSnapshot = ""
				setExec(r, r.Route, execRunning, now)
			} else {
				setExec(r, r.Route, execPaused, now)
				if wasRunning {
					r.EndAt = now.Add(s.cfg.MaxTimeout)
				}
			}
		})
		if ferr != nil {
			log.Warn("releasing the record failed", "err", ferr)
			r = rec
		}
		return r, nil, fmt.Errorf("%s sandbox %s: %w", op.Kind, id, err)
	}

	// 1. pause
	if wasRunning {
		if !alive {
			return giveUp(fmt.Errorf("%w: worker %s is not registered", errdefs.ErrUnavailable, old.WorkerID), nil)
		}
		if err := s.nodeLifecycle(ctx, oldURL, spacev1.NodePathPause, old); err != nil {
			return giveUp(err, nil)
		}
	}
	// 2. snapshot
	snapID := rec.PausedSnapshot
	if wasRunning || (alive && snapID == "") {
		snapID = newSnapshotID()
		if _, err := s.nodeSnapshot(ctx, oldURL, old, snapID); err != nil {
			return giveUp(err, nil)
		}
	} else if snapID == "" {
		return giveUp(fmt.Errorf("%w: worker %s is gone and the paused execution has no snapshot; retry when the worker is back", errdefs.ErrUnavailable, old.WorkerID), nil)
	}
	// The snapshot is current for the paused execution: keep it even if
	// the rest fails, so a later resume elsewhere can reuse it.
	keepSnap := func(r *store.SandboxRecord) { r.PausedSnapshot = snapID }

	// pick the target
	ws, err := s.workersWithLoad(ctx, old.Substrate)
	if err != nil {
		return giveUp(err, keepSnap)
	}
	var w spacev1.Worker
	if target != "" {
		found := false
		for _, c := range ws {
			if c.ID == target {
				w, found = c, true
			}
		}
		if !found {
			return giveUp(fmt.Errorf("%w: target worker %s is not registered", errdefs.ErrUnavailable, target), keepSnap)
		}
	} else if w, err = s.sched.Pick(ws, exclude...); err != nil {
		return giveUp(err, keepSnap)
	}

	// 3. reserve the generation, record the pending route
	var next identity.Route
	rec, err = s.stepOp(ctx, id, op, func(r *store.SandboxRecord) error {
		if r.Route != old {
			return fmt.Errorf("%w: sandbox %s route moved", errOpLost, id)
		}
		r.Generation++
		next = s.newRoute(id, r.Generation, w.ID, old.Substrate)
		r.PendingRoute = &next
		r.PausedSnapshot = snapID
		return nil
	})
	if err != nil {
		return giveUp(err, nil)
	}
	log = log.With("next_generation", next.Generation, "target", w.ID, "snapshot", snapID)

	// 4. install with restore on the target
	started := s.now().UTC()
	resp, err := s.install(ctx, w.NodeURL, spacev1.InstallRequest{
		Route: next, Template: rec.TemplateID, EnvVars: rec.EnvVars, Limits: limitsOf(rec), RestoreSnapshot: snapID,
	})
	if err != nil {
		log.Warn("install on the target failed; the generation is not published", "err", err)
		if terr := s.teardown(ctx, w.NodeURL, next); terr != nil {
			log.Warn("teardown of the failed install failed", "err", terr)
		}
		now := s.now().UTC()
		return giveUp(fmt.Errorf("install on worker %s failed, the sandbox keeps its files on worker %s: %w", w.ID, old.WorkerID, err),
			func(r *store.SandboxRecord) {
				r.PendingRoute = nil
				setExec(r, next, execFailed, now)
				keepSnap(r)
			})
	}

	// 5. publish
	now := s.now().UTC()
	rec, err = s.finishOp(ctx, id, op, func(r *store.SandboxRecord) {
		r.Route = next
		r.PendingRoute = nil
		r.PausedSnapshot = ""
		r.NodeURL = w.NodeURL
		r.State = store.StateRunning
		if resp.EnvdVersion != "" {
			r.EnvdVersion = resp.EnvdVersion
		}
		if timeout > 0 || !r.EndAt.After(now) {
			if timeout <= 0 {
				timeout = s.cfg.DefaultTimeout
			}
			r.EndAt = now.Add(timeout)
		}
		if autoPause != nil {
			r.AutoPause = *autoPause
		}
		setExec(r, old, execRetired, now)
		r.Executions = append(r.Executions, spacev1.Execution{Route: next, State: execRunning, StartedAt: started})
	})
	if err != nil {
		// Killed (or recovered) while installing: undo the install.
		log.Warn("publishing the new route failed; tearing the install down", "err", err)
		if terr := s.teardown(ctx, w.NodeURL, next); terr != nil {
			log.Warn("teardown failed", "err", terr)
		}
		return rec, nil, fmt.Errorf("%s sandbox %s: %w", op.Kind, id, err)
	}
	log.Info("sandbox moved", "new_execution", next.ExecutionID)

	// 6. retire the old execution (its worker also learns it from the
	// record watch: the published route's generation is above its own).
	if alive {
		if err := s.nodeRetire(ctx, oldURL, old); err != nil {
			log.Warn("retire on the old worker failed; it learns retirement from the record watch", "err", err)
		}
	}
	out := &spacev1.MigrateResponse{
		SandboxID: id, From: old, Route: next, SnapshotID: snapID,
		ProcessesRestarted: true, FilesKept: true, Note: moveNote,
	}
	if next.Substrate == identity.SubstrateMicroVM {
		out.ProcessesRestarted, out.Note = false, moveNoteVM
	}
	for _, e := range rec.Executions {
		if e.Route == next {
			out.Execution = e
		}
	}
	return rec, out, nil
}

// ---- snapshot ----

// snapshotSandbox archives the sandbox's writable layer into a persistent
// snapshot (E2B's createSnapshot). A running sandbox is paused for the
// archive and thawed after (same execution); a paused one stays paused.
func (s *Server) snapshotSandbox(ctx context.Context, id, team, name string) (store.SnapshotRecord, error) {
	ctx = context.WithoutCancel(ctx)
	rec, op, err := s.beginOp(ctx, id, team, opSnapshot, store.StateSnapshotting, "", func(r store.SandboxRecord) error {
		if r.State != store.StateRunning && r.State != store.StatePaused {
			return fmt.Errorf("%w: sandbox %s is %s", errdefs.ErrConflict, id, r.State)
		}
		return nil
	})
	if err != nil {
		return store.SnapshotRecord{}, err
	}
	log := s.log.With("sandbox", id, "generation", rec.Route.Generation, "worker", rec.Route.WorkerID)
	nodeURL, alive := s.liveWorker(ctx, rec.Route.WorkerID)
	if !alive {
		s.abortOp(ctx, id, op, op.From)
		return store.SnapshotRecord{}, fmt.Errorf("%w: worker %s of sandbox %s is not registered", errdefs.ErrUnavailable, rec.Route.WorkerID, id)
	}
	wasRunning := op.From == store.StateRunning
	if wasRunning {
		if err := s.nodeLifecycle(ctx, nodeURL, spacev1.NodePathPause, rec.Route); err != nil {
			s.abortOp(ctx, id, op, store.StateRunning)
			return store.SnapshotRecord{}, fmt.Errorf("snapshot sandbox %s: %w", id, err)
		}
	}
	snapID := newSnapshotID()
	sresp, serr := s.nodeSnapshot(ctx, nodeURL, rec.Route, snapID)
	back := op.From
	if wasRunning {
		if err := s.nodeLifecycle(ctx, nodeURL, spacev1.NodePathResume, rec.Route); err != nil {
			log.Warn("thaw after snapshot failed; the sandbox stays paused", "err", err)
			back = store.StatePaused
		}
	}
	now := s.now().UTC()
	if _, err := s.finishOp(ctx, id, op, func(r *store.SandboxRecord) {
		r.State = back
		if back == store.StatePaused {
			setExec(r, r.Route, execPaused, now)
			if serr == nil {
				r.PausedSnapshot = snapID
			}
			if wasRunning {
				r.EndAt = now.Add(s.cfg.MaxTimeout)
			}
		}
	}); err != nil && serr == nil {
		serr = err
	}
	if serr != nil {
		return store.SnapshotRecord{}, fmt.Errorf("snapshot sandbox %s: %w", id, serr)
	}
	snap := store.SnapshotRecord{
		ID: snapID, TeamID: rec.TeamID, SandboxID: id, TemplateID: rec.TemplateID, Generation: rec.Route.Generation,
		EnvVars: rec.EnvVars, CPUCount: rec.CPUCount, MemoryMB: rec.MemoryMB, DiskSizeMB: rec.DiskSizeMB,
		SizeBytes: sresp.SizeBytes, CreatedAt: now,
	}
	if name != "" {
		snap.Names = []string{rec.TeamID + "/" + name}
	}
	if err := s.st.CreateSnapshot(ctx, snap); err != nil {
		return store.SnapshotRecord{}, fmt.Errorf("%w: recording snapshot %s: %v", errdefs.ErrUnavailable, snapID, err)
	}
	log.Info("snapshot created", "snapshot", snapID, "size_bytes", sresp.SizeBytes)
	return snap, nil
}

// ---- recovery ----

// recoverOp releases a record whose operation overran opDeadline (its
// control plane crashed or lost the store): the sandbox becomes paused on
// its published route (no capability is issued for a paused sandbox; a
// resume thaws or restores it), and an unpublished install is torn down.
func (s *Server) recoverOp(ctx context.Context, id, opID string) error {
	var pending *identity.Route
	rec, _, err := s.st.MutateSandbox(ctx, id, func(r *store.SandboxRecord) error {
		if r.Op == nil || r.Op.ID != opID {
			return fmt.Errorf("%w: operation ended", errdefs.ErrConflict)
		}
		if s.now().Sub(r.Op.StartedAt) <= s.opDeadline() {
			return fmt.Errorf("%w: operation within its deadline", errdefs.ErrConflict)
		}
		now := s.now().UTC()
		pending = r.PendingRoute
		if pending != nil {
			setExec(r, *pending, execFailed, now)
		}
		r.PendingRoute = nil
		r.Op = nil
		r.State = store.StatePaused
		r.EndAt = now.Add(s.cfg.MaxTimeout)
		setExec(r, r.Route, execPaused, now)
		return nil
	})
	if err != nil {
		return err
	}
	s.log.Warn("lifecycle operation overran its deadline; sandbox left paused", "sandbox", id, "op_id", opID,
		"generation", rec.Route.Generation, "worker", rec.Route.WorkerID)
	if pending != nil {
		if u, ok := s.liveWorker(ctx, pending.WorkerID); ok {
			if err := s.teardown(ctx, u, *pending); err != nil {
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
		if err := s.teardown(ctx, u, *p); err != nil {
			s.log.Warn("teardown of an unpublished install failed", "sandbox", rec.ID, "worker", p.WorkerID, "err", err)
		}
	}
}

// settled makes a capability request wait (bounded) while a lifecycle
// operation holds the sandbox, so that the edge's request (or route repair)
// gets the route published by the operation rather than a refusal.
// Capabilities only ever name the published route (Route), never a pending one.
func (s *Server) settled(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if id, err := parseSandboxID(r.PathValue("id")); err == nil {
			if rec, _, err := s.st.GetSandbox(r.Context(), id); err == nil && rec.State.Transitional() {
				_, _ = s.waitSettled(r.Context(), id, capabilityWait)
			}
		}
		h(w, r)
	}
}

// capabilityWait bounds how long a capability request waits for a
// lifecycle operation to end.
const capabilityWait = 30 * time.Second

// spawnAutoPause pauses a running sandbox whose timeout passed and which was
// created with autoPause (instead of killing it).
func (s *Server) spawnAutoPause(sem chan struct{}, id string) {
	s.spawnReap(sem, id, func(ctx context.Context) error {
		return s.pauseSandbox(ctx, id, "", func(cur store.SandboxRecord) error {
			if cur.EndAt.After(s.now()) || !cur.AutoPause {
				return fmt.Errorf("%w: timeout extended", errdefs.ErrConflict)
			}
			return nil
		})
	})
}

// spawnRecover releases a record held by an operation past its deadline.
func (s *Server) spawnRecover(sem chan struct{}, id, opID string) {
	s.spawnReap(sem, id, func(ctx context.Context) error { return s.recoverOp(ctx, id, opID) })
}

// spawnReap runs fn for sandbox id on the reaper's pool, at most once at a
// time per sandbox (like spawnKill).
func (s *Server) spawnReap(sem chan struct{}, id string, fn func(context.Context) error) {
	s.reapMu.Lock()
	if s.reaping[id] {
		s.reapMu.Unlock()
		return
	}
	s.reaping[id] = true
	s.reapMu.Unlock()
	release := func() {
		s.reapMu.Lock()
		delete(s.reaping, id)
		s.reapMu.Unlock()
	}
	select {
	case sem <- struct{}{}:
	case <-s.ctx.Done():
		release()
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer func() { <-sem; release() }()
		if err := fn(s.ctx); err != nil {
			s.log.Debug("reaper: lifecycle step skipped", "sandbox", id, "err", err)
		}
	}()
}
