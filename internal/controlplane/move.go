package controlplane

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/store"
)

const moveNote = "the sandbox now runs as a new execution: files were kept (writable layer restored from a snapshot), processes were restarted"

// moveNoteKept is the note of a move on the microvm substrate, whose
// snapshots hold the whole machine.
const moveNoteKept = "the sandbox now runs as a new execution: memory, processes and files were kept (its whole state was restored)"

// handleMigrate is POST /space/v1/sandboxes/{id}/migrate: the sandbox moves
// to another worker and the answer says what the move kept.
func (s *Server) handleMigrate(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req spacev1.MigrateRequest
	if err := decodeOptionalJSON(w, r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if _, err := s.getSandbox(r.Context(), c, id); err != nil {
		s.writeError(w, r, err)
		return
	}
	_, out, err := s.migrateSandbox(r.Context(), id, c.TeamID, req.TargetWorker)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

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

// move runs a sandbox as a new execution with its files kept. Its steps,
// in order (each a method of mover):
//
//  1. pauseOld: pause on the old worker (only when the operation began
//     running);
//  2. snapshotOld: snapshot of the paused execution's writable layer on
//     the old worker (skipped when a snapshot of this paused execution
//     exists; required when the old worker is gone);
//  3. pickTarget: the named target, or the scheduler's pick;
//  4. reserve (store): the generation is bumped and the new route recorded
//     as pending, revision-guarded;
//  5. installTarget: install with RestoreSnapshot on the target (persisted
//     there before the route is published);
//  6. publish (store): the new route becomes Route, state running;
//  7. retireOld: retire of the old execution on the old worker.
//
// A failure before 6 unpublishes nothing (giveUp): the sandbox stays paused
// on the old worker with its files (a migration that began running thaws
// the old execution again when it can), and a target install is torn down.
func (s *Server) move(ctx context.Context, rec store.SandboxRecord, op *store.LifecycleOp, target string, exclude []string,
	timeout time.Duration, autoPause *bool) (store.SandboxRecord, *spacev1.MigrateResponse, error) {
	m := s.newMover(ctx, rec, op)
	if err := m.pauseOld(); err != nil {
		return m.giveUp(err, nil)
	}
	if err := m.snapshotOld(); err != nil {
		return m.giveUp(err, nil)
	}
	// The snapshot is current for the paused execution: it is kept even
	// if the rest fails, so a later resume elsewhere can reuse it.
	w, err := m.pickTarget(target, exclude)
	if err != nil {
		return m.giveUp(err, m.keepSnapshot)
	}
	if w, err = m.reserve(w, target, exclude); err != nil {
		return m.giveUp(err, nil)
	}
	crashpoint.Hit(crashpoint.MoveReserved)
	resp, err := m.installTarget(w)
	if err != nil {
		now := s.now().UTC()
		return m.giveUp(err, func(r *store.SandboxRecord) {
			r.PendingRoute = nil
			setExec(r, m.next, execFailed, now)
			m.keepSnapshot(r)
		})
	}
	crashpoint.Hit(crashpoint.MoveInstalled)
	if err := m.publish(w, resp, timeout, autoPause); err != nil {
		return m.rec, nil, fmt.Errorf("%s sandbox %s: %w", op.Kind, m.id, err)
	}
	crashpoint.Hit(crashpoint.MovePublished)
	m.retireOld()
	if !m.processesKept {
		s.restartPlatformServer(ctx, m.rec)
	}
	return m.rec, m.response(), nil
}

// mover is one move in progress: what its steps learned so far.
type mover struct {
	s             *Server
	ctx           context.Context
	op            *store.LifecycleOp
	log           *slog.Logger
	id            string
	rec           store.SandboxRecord // as last written (or read) by the move
	old           identity.Route      // the execution moved away from
	oldURL        string              // its worker's node-api, when alive
	alive         bool                // the old worker is registered
	wasRunning    bool                // the operation began on a running sandbox
	snapID        string              // the snapshot the target restores
	next          identity.Route      // the new execution (after reserve)
	started       time.Time           // when its install began
	processesKept bool
	lost          bool // the old execution's processes are gone (pauseOld found it lost)                // the target restored the whole state (InstallResponse)
	// requireGone, when set, is the old worker, which must still be
	// unregistered when the new route is published (workerloss.go).
	requireGone string
	// placements are the workers' placement revisions pickTarget read.
	placements map[string]int64
}

func (s *Server) newMover(ctx context.Context, rec store.SandboxRecord, op *store.LifecycleOp) *mover {
	m := &mover{s: s, ctx: ctx, op: op, id: rec.ID, rec: rec, old: rec.Route, wasRunning: op.From == store.StateRunning}
	m.log = s.log.With("sandbox", m.id, "op", op.Kind, "generation", m.old.Generation, "worker", m.old.WorkerID)
	m.oldURL, m.alive = s.liveWorker(ctx, m.old.WorkerID)
	return m
}

// giveUp releases the record after a failure before publication: the old
// execution is thawed when the move froze it, mut (when non-nil) amends
// the record, and the error is returned.
func (m *mover) giveUp(err error, mut func(*store.SandboxRecord)) (store.SandboxRecord, *spacev1.MigrateResponse, error) {
	s := m.s
	back := store.StatePaused
	switch {
	case m.wasRunning && m.lost:
		// Nothing runs to thaw (its processes died with its worker): the
		// sandbox stays running on its lost execution, whose marker the
		// reaper keeps, and the recovery is tried again.
		back = store.StateRunning
	case m.wasRunning && m.alive:
		if rerr := s.node.resume(m.ctx, m.oldURL, m.old); rerr == nil {
			back = store.StateRunning
		} else {
			m.log.Warn("thawing the old execution failed; the sandbox stays paused", "err", rerr)
		}
	}
	now := s.now().UTC()
	r, ferr := s.finishOp(m.ctx, m.id, m.op, func(r *store.SandboxRecord) {
		if mut != nil {
			mut(r)
		}
		r.State = back
		if back == store.StateRunning {
			r.PausedSnapshot = ""
			setExec(r, r.Route, execRunning, now)
		} else {
			setExec(r, r.Route, execPaused, now)
			if m.wasRunning {
				r.EndAt = now.Add(s.cfg.MaxTimeout)
			}
		}
	})
	if ferr != nil {
		m.log.Warn("releasing the record failed", "err", ferr)
		r = m.rec
	}
	return r, nil, fmt.Errorf("%s sandbox %s: %w", m.op.Kind, m.id, err)
}

// pauseOld freezes the old execution when the sandbox was running, so its
// writable layer is quiescent for the snapshot.
func (m *mover) pauseOld() error {
	if !m.wasRunning {
		return nil
	}
	if !m.alive {
		return fmt.Errorf("%w: worker %s is not registered", errdefs.ErrUnavailable, m.old.WorkerID)
	}
	err := m.s.node.pause(m.ctx, m.oldURL, m.old)
	if executionLost(err) {
		m.lost = true
		return nil // its processes are gone (the worker restarted): nothing runs to pause
	}
	return err
}

// snapshotOld makes sure a snapshot of the paused execution exists: it
// takes one, or reuses the one a paused sandbox already has when its worker
// is gone.
func (m *mover) snapshotOld() error {
	m.snapID = m.rec.PausedSnapshot
	if m.wasRunning || (m.alive && m.snapID == "") {
		m.snapID = newSnapshotID()
		_, err := m.s.node.snapshot(m.ctx, m.oldURL, m.old, m.snapID)
		return err
	}
	if m.snapID == "" && !m.alive && m.s.workerLost(m.old.WorkerID) {
		// Gone past the grace: its files are taken as lost with it
		// (workerloss.go).
		m.snapID = m.s.recoverySnapshot(m.ctx, m.rec)
		m.log.Warn("the paused sandbox's worker is lost and no snapshot of its pause exists; restoring its last snapshot, else its template",
			"snapshot", m.snapID)
		return nil
	}
	if m.snapID == "" {
		return fmt.Errorf("%w: worker %s is gone and the paused execution has no snapshot; retry when the worker is back", errdefs.ErrUnavailable, m.old.WorkerID)
	}
	return nil
}

// keepSnapshot records the move's snapshot as the paused execution's.
func (m *mover) keepSnapshot(r *store.SandboxRecord) { r.PausedSnapshot = m.snapID }

// pickTarget returns the named target worker, or the scheduler's pick
// among the workers of the sandbox's substrate other than exclude.
func (m *mover) pickTarget(target string, exclude []string) (spacev1.Worker, error) {
	ws, revs, err := m.s.workersWithLoad(m.ctx, m.old.Substrate, true)
	m.placements = revs
	if err != nil {
		return spacev1.Worker{}, err
	}
	if target == "" {
		return m.s.sched.Pick(ws, exclude...)
	}
	var w spacev1.Worker
	found := false
	for _, c := range ws {
		if c.ID == target {
			w, found = c, true
		}
	}
	if !found {
		return spacev1.Worker{}, fmt.Errorf("%w: target worker %s is not registered", errdefs.ErrUnavailable, target)
	}
	return w, nil
}

// reserve bumps the generation and records the new route on w as pending,
// while the record still holds the old route. The write is guarded by w's
// placements as pickTarget read them: when another placement on w
// committed meanwhile, the target is picked again (it returns the worker
// reserved on).
func (m *mover) reserve(w spacev1.Worker, target string, exclude []string) (spacev1.Worker, error) {
	for range maxPlacementRetries {
		err := m.reserveOn(w)
		if !errors.Is(err, store.ErrPlacementMoved) {
			return w, err
		}
		if w, err = m.pickTarget(target, exclude); err != nil {
			return w, err
		}
	}
	return w, fmt.Errorf("%w: placements on the workers kept moving; retry", errdefs.ErrUnavailable)
}

func (m *mover) reserveOn(w spacev1.Worker) error {
	var err error
	m.rec, err = m.s.stepOpPlaced(m.ctx, m.id, m.op, placementOf(m.placements, w.ID), func(r *store.SandboxRecord) error {
		if r.Route != m.old {
			return fmt.Errorf("%w: sandbox %s route moved", errOpLost, m.id)
		}
		r.Generation++
		m.next = m.s.newRoute(m.id, r.Generation, w.ID, m.old.Substrate)
		r.PendingRoute = &m.next
		r.PausedSnapshot = m.snapID
		return nil
	})
	if err != nil {
		return err
	}
	m.log = m.log.With("next_generation", m.next.Generation, "target", w.ID, "snapshot", m.snapID)
	return nil
}

// installTarget installs the new execution on w with the snapshot
// restored; a failed install is torn down again.
func (m *mover) installTarget(w spacev1.Worker) (spacev1.InstallResponse, error) {
	m.started = m.s.now().UTC()
	nw, err := m.s.installNetwork(m.ctx, m.rec)
	if err != nil {
		return spacev1.InstallResponse{}, err
	}
	resp, err := m.s.node.install(m.ctx, w.NodeURL, spacev1.InstallRequest{
		Route: m.next, Template: m.rec.TemplateID, EnvVars: m.rec.EnvVars, Limits: limitsOf(m.rec), RestoreSnapshot: m.snapID,
		Network: nw, Image: m.rec.Image, Volumes: m.rec.VolumeMounts,
	})
	if err == nil {
		m.processesKept = resp.ProcessesKept
		return resp, nil
	}
	m.log.Warn("install on the target failed; the generation is not published", "err", err)
	if terr := m.s.node.teardown(m.ctx, w.NodeURL, m.next); terr != nil {
		m.log.Warn("teardown of the failed install failed", "err", terr)
	}
	return resp, fmt.Errorf("install on worker %s failed, the sandbox keeps its files on worker %s: %w", w.ID, m.old.WorkerID, err)
}

// publish makes the new execution the sandbox's route (state running, the
// old execution retired in the history). When the record left the
// operation's hands meanwhile (killed, recovered), the install is torn
// down and the error returned.
func (m *mover) publish(w spacev1.Worker, resp spacev1.InstallResponse, timeout time.Duration, autoPause *bool) error {
	s := m.s
	now := s.now().UTC()
	finish := s.finishOp
	if m.requireGone != "" {
		finish = func(ctx context.Context, id string, op *store.LifecycleOp, fn func(*store.SandboxRecord)) (store.SandboxRecord, error) {
			return s.finishOpWhileGone(ctx, id, op, m.requireGone, fn)
		}
	}
	var err error
	m.rec, err = finish(m.ctx, m.id, m.op, func(r *store.SandboxRecord) {
		r.Route = m.next
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
		setExec(r, m.old, execRetired, now)
		r.Executions = append(r.Executions, spacev1.Execution{Route: m.next, State: execRunning, StartedAt: m.started})
	})
	if err != nil {
		// Killed (or recovered) while installing: undo the install.
		m.log.Warn("publishing the new route failed; tearing the install down", "err", err)
		if terr := s.node.teardown(m.ctx, w.NodeURL, m.next); terr != nil {
			m.log.Warn("teardown failed", "err", terr)
		}
		return err
	}
	m.log.Info("sandbox moved", "new_execution", m.next.ExecutionID)
	return nil
}

// retireOld tells the old worker its execution is retired (best effort: it
// also learns it from the record watch, the published route's generation
// being above its own).
func (m *mover) retireOld() {
	if !m.alive {
		return
	}
	if err := m.s.node.retire(m.ctx, m.oldURL, m.old); err != nil {
		m.log.Warn("retire on the old worker failed; it learns retirement from the record watch", "err", err)
	}
}

// response describes the published move.
func (m *mover) response() *spacev1.MigrateResponse {
	out := &spacev1.MigrateResponse{
		SandboxID: m.id, From: m.old, Route: m.next, SnapshotID: m.snapID,
		ProcessesRestarted: true, FilesKept: true, Note: moveNote,
	}
	if m.processesKept { // the worker says so: its substrate saves state
		out.ProcessesRestarted, out.Note = false, moveNoteKept
	}
	for _, e := range m.rec.Executions {
		if e.Route == m.next {
			out.Execution = e
		}
	}
	return out
}
