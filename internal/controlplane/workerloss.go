package controlplane

// Worker loss. A worker whose registration has been gone for longer than
// Config.WorkerLossGrace has lost its running sandboxes as far as the
// control plane can tell: each is brought back on another live worker as a
// new execution (generation+1) through the move machinery (reserve,
// install, publish), from the sandbox's latest snapshot in the shared
// snapshot store when it has one, else fresh from its template. The grace
// is longer than the workers' lease TTL, and a worker fences itself
// before its lease can expire (internal/worker fence.go), so by the time
// the control plane acts the lost worker serves nothing. The new route is
// published in one transaction with a check that the worker is still
// unregistered (store.MutateSandboxWhileWorkerGone): a worker that comes
// back registers before it reads the records it must retire, so it either
// sees the new route (and retires its execution before serving) or the
// publication fails and the sandbox stays where it was.

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/store"
)

// workerLoss is the reaper's memory of the workers it found unregistered:
// since when (this control plane's clock). A new leader starts counting
// again, which only delays recovery.
type workerLoss struct {
	mu        sync.Mutex
	goneSince map[string]time.Time
}

// recoverLostWorkers starts, for every running sandbox whose worker has
// been unregistered past the grace, its recovery on another worker (one
// at a time per sandbox, on the reaper's pool). Paused sandboxes are left
// paused: a resume places them, from the snapshot of their pause, else
// (the worker being lost) as a running one would be recovered.
func (s *Server) recoverLostWorkers(ctx context.Context, sem *reapPool, entries []store.SandboxEntry) {
	ws, err := s.st.ListWorkers(ctx)
	if err != nil {
		if s.ctx.Err() == nil {
			s.log.Warn("reaper: listing workers failed; worker-loss recovery skipped this pass", "err", err)
		}
		return
	}
	live := make(map[string]bool, len(ws))
	for _, w := range ws {
		live[w.ID] = true
	}
	now := s.now()
	wl := &s.workerLoss
	wl.mu.Lock()
	if wl.goneSince == nil {
		wl.goneSince = map[string]time.Time{}
	}
	named := map[string]bool{}
	var due []store.SandboxRecord
	for _, e := range entries {
		r := e.Record
		if r.State.Terminal() || r.Route.WorkerID == "" || live[r.Route.WorkerID] {
			continue
		}
		// Any live record keeps the worker's clock (a recovery in
		// flight holds its sandbox in migrating).
		named[r.Route.WorkerID] = true
		since, ok := wl.goneSince[r.Route.WorkerID]
		if !ok {
			wl.goneSince[r.Route.WorkerID] = now
			s.log.Warn("worker unregistered: its running sandboxes are recovered elsewhere if it stays away",
				"worker", r.Route.WorkerID, "grace", s.cfg.WorkerLossGrace)
			continue
		}
		if r.State == store.StateRunning && r.Op == nil && now.Sub(since) >= s.cfg.WorkerLossGrace && r.EndAt.After(now) {
			due = append(due, r)
		}
	}
	for id := range wl.goneSince {
		if !named[id] {
			delete(wl.goneSince, id) // back, or nothing of it left to recover
		}
	}
	wl.mu.Unlock()
	sort.Slice(due, func(i, j int) bool { return due[i].ID < due[j].ID })
	for _, r := range due {
		s.spawnRecoverFromLostWorker(sem, r.ID, r.Route)
	}
}

// spawnRecoverFromLostWorker brings sandbox id, running as lost on an
// unregistered worker, back on another worker.
func (s *Server) spawnRecoverFromLostWorker(sem *reapPool, id string, lost identity.Route) {
	s.spawnReap(sem, id, "recovery from a lost worker", func(ctx context.Context) error {
		err := s.recoverFromLostWorker(ctx, id, lost)
		if err != nil && !errors.Is(err, errdefs.ErrConflict) {
			s.log.Warn("recovery from a lost worker failed; retried on the next pass", "sandbox", id,
				"generation", lost.Generation, "worker", lost.WorkerID, "err", err)
		}
		return err
	})
}

// recoverFromLostWorker is one recovery: a migrate operation that skips
// what needs the old worker (pause, snapshot, retire), restores the
// sandbox's latest snapshot (or none: a fresh start from its template) on
// the scheduler's pick among the other workers, and publishes only while
// the old worker is still unregistered.
func (s *Server) recoverFromLostWorker(ctx context.Context, id string, lost identity.Route) error {
	rec, op, err := s.beginOp(ctx, id, "", opMigrate, store.StateMigrating, "", func(r store.SandboxRecord) error {
		if r.Route != lost || r.State != store.StateRunning {
			return fmt.Errorf("%w: sandbox %s no longer runs on the lost worker", errdefs.ErrConflict, id)
		}
		return nil
	})
	if err != nil {
		return err
	}
	m := s.newMover(ctx, rec, op)
	m.lost, m.requireGone = true, lost.WorkerID
	if m.alive {
		_, _, err := m.giveUp(fmt.Errorf("%w: worker %s registered again", errdefs.ErrConflict, lost.WorkerID), nil)
		return err
	}
	m.snapID = s.recoverySnapshot(ctx, rec)
	w, err := m.pickTarget("", []string{lost.WorkerID})
	if err != nil {
		_, _, err = m.giveUp(fmt.Errorf("no other worker can take it: %w", err), nil)
		return err
	}
	if w, err = m.reserve(w, "", []string{lost.WorkerID}); err != nil {
		_, _, err = m.giveUp(err, nil)
		return err
	}
	from := "its snapshot " + m.snapID
	if m.snapID == "" {
		from = "its template (no snapshot: memory and files since the create are lost)"
	}
	m.log.Warn("recovering a sandbox of a lost worker on another worker", "from", from)
	unpublished := func(r *store.SandboxRecord) {
		r.PendingRoute = nil
		setExec(r, m.next, execFailed, s.now().UTC())
	}
	resp, err := m.installTarget(w)
	if err != nil {
		_, _, err = m.giveUp(err, unpublished)
		return err
	}
	if err := m.publish(w, resp, 0, nil); err != nil {
		if errors.Is(err, store.ErrWorkerRegistered) {
			// The worker is back and serves its execution again (after
			// applying the records, which still name it).
			_, _, err = m.giveUp(err, unpublished)
		}
		return err
	}
	s.obs.workerLossRecoveries.Inc()
	m.log.Info("sandbox of a lost worker recovered", "from", from)
	if !m.processesKept {
		s.restartPlatformServer(ctx, m.rec)
	}
	if err := s.st.DeleteLost(ctx, lost); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		s.log.Debug("dropping a lost-execution marker failed", "sandbox", id, "err", err)
	}
	return nil
}

// workerLost reports whether the reaper has found worker unregistered
// for at least the grace: a paused sandbox of it is then resumed elsewhere
// from its last snapshot, or its template, instead of waiting for the
// worker's files (move.go snapshotOld).
func (s *Server) workerLost(worker string) bool {
	wl := &s.workerLoss
	wl.mu.Lock()
	defer wl.mu.Unlock()
	since, ok := wl.goneSince[worker]
	return ok && s.now().Sub(since) >= s.cfg.WorkerLossGrace
}

// recoverySnapshot is the snapshot a sandbox of a lost worker is restored
// from: the current one of its route when a pause or a move left one,
// else the newest snapshot of the sandbox a user took, else none.
func (s *Server) recoverySnapshot(ctx context.Context, rec store.SandboxRecord) string {
	if rec.PausedSnapshot != "" {
		return rec.PausedSnapshot
	}
	snaps, err := s.st.ListSnapshots(ctx)
	if err != nil {
		s.log.Warn("listing snapshots failed; the sandbox starts from its template", "sandbox", rec.ID, "err", err)
		return ""
	}
	var best store.SnapshotRecord
	for _, sn := range snaps {
		if sn.SandboxID == rec.ID && sn.TeamID == rec.TeamID && sn.CreatedAt.After(best.CreatedAt) {
			best = sn
		}
	}
	return best.ID
}

// finishOpWhileGone is finishOp whose write also requires that worker is
// unregistered (store.ErrWorkerRegistered otherwise).
func (s *Server) finishOpWhileGone(ctx context.Context, id string, op *store.LifecycleOp, worker string, fn func(*store.SandboxRecord)) (store.SandboxRecord, error) {
	rec, _, err := s.st.MutateSandboxWhileWorkerGone(ctx, id, worker, func(r *store.SandboxRecord) error {
		if r.Op == nil || r.Op.ID != op.ID {
			return fmt.Errorf("%w: sandbox %s is %s now", errOpLost, id, r.State)
		}
		fn(r)
		r.Op = nil
		return nil
	})
	if errors.Is(err, errdefs.ErrNotFound) {
		return rec, fmt.Errorf("%w: sandbox %s was removed", errOpLost, id)
	}
	if err == nil {
		s.log.Info("lifecycle operation ended", "sandbox", id, "op", op.Kind, "op_id", op.ID, "state", rec.State,
			"generation", rec.Route.Generation, "worker", rec.Route.WorkerID)
	}
	return rec, err
}
