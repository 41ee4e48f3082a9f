package controlplane

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/store"
)

// maxConcurrentKills bounds the reaper's teardowns in flight.
const maxConcurrentKills = 8

// reapPool runs the reaper's steps of one leadership: at most
// maxConcurrentKills at once, all ended by ctx (the leadership's) and
// waited for before the leadership is given up.
type reapPool struct {
	ctx   context.Context
	slots chan struct{}
	wg    sync.WaitGroup
}

// reapLoop kills sandboxes whose timeout passed (pauses those created with
// autoPause), releases records whose lifecycle operation overran its
// deadline, fails records stuck in creating (a crashed create), purges
// old tombstones and completes an interrupted key rotation. It works from
// the store only, so a restarted (or another) control plane resumes it.
// It runs only while this replica leads (leader.go), until ctx (the
// leadership) ends; it returns once every step it started has.
func (s *Server) reapLoop(ctx context.Context) {
	t := time.NewTicker(s.cfg.ReapInterval)
	defer t.Stop()
	sem := &reapPool{ctx: ctx, slots: make(chan struct{}, maxConcurrentKills)}
	defer sem.wg.Wait()
	for {
		s.reapOnce(sem)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-s.reapNow:
		}
	}
}

// reapOnce is one pass of the reaper: every singleton of the control
// plane runs from here (only on the leader).
func (s *Server) reapOnce(sem *reapPool) {
	s.obs.reaps.Inc()
	ctx, cancel := context.WithTimeout(sem.ctx, 30*time.Second)
	defer cancel()
	s.completeRotation(ctx)
	entries, err := s.st.ListSandboxes(ctx)
	if err != nil {
		if sem.ctx.Err() == nil {
			s.log.Warn("reaper: listing sandboxes failed", "err", err)
		}
		return
	}
	now := s.now()
	staleCreate := 2*s.cfg.InstallTimeout + 30*time.Second
	lost := s.lostExecutions(ctx, entries)
	orphaned := s.orphans(ctx, entries)
	s.recoverLostWorkers(ctx, sem, entries)
	for _, e := range entries {
		r := e.Record
		switch {
		case lost[r.ID] && r.State == store.StateRunning && r.Op == nil && r.EndAt.After(now):
			s.spawnRecoverLost(sem, r.ID, r.Route)
		case r.State == store.StateRunning && r.AutoPause && !r.EndAt.After(now):
			s.spawnAutoPause(sem, r.ID)
		case r.Op != nil && (orphaned[r.ID] || now.Sub(r.Op.StartedAt) > s.opDeadline()):
			s.spawnRecover(sem, r.ID, r.Op.ID, orphaned[r.ID])
		case (r.State == store.StateRunning || r.State == store.StatePaused) && !r.EndAt.After(now):
			s.spawnKill(sem, r.ID, "timeout", func(cur store.SandboxRecord) error {
				if cur.EndAt.After(s.now()) {
					return fmt.Errorf("%w: timeout extended", errdefs.ErrConflict)
				}
				return nil
			})
		case r.State == store.StateCreating && (orphaned[r.ID] || now.Sub(r.CreatedAt) > staleCreate):
			s.spawnKill(sem, r.ID, "stuck in creating", func(cur store.SandboxRecord) error {
				if cur.State != store.StateCreating {
					return fmt.Errorf("%w: create finished", errdefs.ErrConflict)
				}
				return nil
			})
		case r.State.Terminal() && now.Sub(r.EndedAt) > s.cfg.TombstoneTTL:
			if err := s.st.DeleteSandbox(ctx, r.ID, e.Revision); err != nil {
				s.log.Debug("reaper: purge skipped", "sandbox", r.ID, "err", err)
			}
		}
	}
}

// spawnKill kills sandbox id for reason once check accepts its current
// record (the reaper's reading may be stale).
func (s *Server) spawnKill(sem *reapPool, id, reason string, check func(store.SandboxRecord) error) {
	s.spawnReap(sem, id, "kill", func(ctx context.Context) error { return s.killSandbox(ctx, id, "", reason, check) })
}

// spawnAutoPause pauses a running sandbox whose timeout passed and which was
// created with autoPause (instead of killing it).
func (s *Server) spawnAutoPause(sem *reapPool, id string) {
	s.spawnReap(sem, id, "lifecycle step", func(ctx context.Context) error {
		return s.pauseSandbox(ctx, id, "", func(cur store.SandboxRecord) error {
			if cur.EndAt.After(s.now()) || !cur.AutoPause {
				return fmt.Errorf("%w: timeout extended", errdefs.ErrConflict)
			}
			return nil
		})
	})
}

// lostExecutions reads the executions workers reported lost (their
// processes died with the worker) and returns the sandboxes whose current
// route is one of them and which are running: those are recovered. Every
// other marker (a paused sandbox: its resume recovers it; a route already
// replaced; a sandbox gone) is dropped.
func (s *Server) lostExecutions(ctx context.Context, entries []store.SandboxEntry) map[string]bool {
	routes, err := s.st.ListLost(ctx)
	if err != nil || len(routes) == 0 {
		if err != nil && ctx.Err() == nil {
			s.log.Warn("reaper: listing lost executions failed", "err", err)
		}
		return nil
	}
	recs := make(map[string]store.SandboxRecord, len(entries))
	for _, e := range entries {
		recs[e.Record.ID] = e.Record
	}
	out := map[string]bool{}
	for _, l := range routes {
		r, ok := recs[l.SandboxID]
		if ok && r.Route == l && r.State == store.StateRunning {
			out[l.SandboxID] = true
			continue
		}
		if ok && r.Route == l && r.Op != nil {
			continue // an operation holds it; look again when it ends
		}
		if !ok || r.State.Terminal() || r.Route.Generation > l.Generation {
			// Nothing will recover it: the worker's record and files of
			// that execution go now (a kill or a move whose teardown or
			// retire the crash cut off would leave them for good).
			if u, alive := s.liveWorker(ctx, l.WorkerID); alive {
				if err := s.node.teardown(ctx, u, l); err != nil && !errors.Is(err, errdefs.ErrConflict) {
					s.log.Warn("reaper: teardown of a lost execution nothing recovers failed; retried on the next pass",
						"sandbox", l.SandboxID, "generation", l.Generation, "worker", l.WorkerID, "err", err)
					continue
				}
			}
		}
		if err := s.st.DeleteLost(ctx, l); err != nil {
			s.log.Debug("reaper: dropping a lost-execution marker failed", "sandbox", l.SandboxID, "err", err)
		}
	}
	return out
}

// spawnRecoverLost brings back a running sandbox whose execution's
// processes died with its worker: a move (a new execution with the files
// restored from the old worker's disk; the scheduler may pick the same
// worker), keeping its timeout. The marker goes once the move succeeded.
func (s *Server) spawnRecoverLost(sem *reapPool, id string, lost identity.Route) {
	s.spawnReap(sem, id, "recovery of a lost execution", func(ctx context.Context) error {
		rec, op, err := s.beginOp(ctx, id, "", opMigrate, store.StateMigrating, "", func(r store.SandboxRecord) error {
			if r.Route != lost || r.State != store.StateRunning {
				return fmt.Errorf("%w: sandbox %s no longer runs the lost execution", errdefs.ErrConflict, id)
			}
			return nil
		})
		if err != nil {
			return err
		}
		s.log.Warn("recovering a sandbox whose execution was lost with its worker", "sandbox", id,
			"generation", lost.Generation, "worker", lost.WorkerID)
		rec, _, err = s.move(ctx, rec, op, "", nil, 0, nil)
		if err != nil {
			s.log.Error("recovery of a lost execution failed; retried on the next pass", "sandbox", id, "err", err)
			return err
		}
		s.log.Info("lost execution recovered", "sandbox", id, "generation", rec.Route.Generation, "worker", rec.Route.WorkerID)
		return s.st.DeleteLost(ctx, lost)
	})
}

// spawnRecover releases a record held by an operation past its deadline,
// or by one whose control plane died.
func (s *Server) spawnRecover(sem *reapPool, id, opID string, orphaned bool) {
	s.spawnReap(sem, id, "lifecycle step", func(ctx context.Context) error { return s.recoverOp(ctx, id, opID, orphaned) })
}

// orphans returns the sandboxes held by an operation (or a create) of
// another control plane instance that is no longer registered: it died (a
// crash of space up, of space-api) with the operation in flight, and nobody
// would release the record before the operation's deadline, minutes later
// (a create that never finishes is killed: its client got no sandbox).
func (s *Server) orphans(ctx context.Context, entries []store.SandboxEntry) map[string]bool {
	var live map[string]bool
	out := map[string]bool{}
	for _, e := range entries {
		owner := e.Record.Creator
		if e.Record.State != store.StateCreating {
			owner = ""
			if e.Record.Op != nil {
				owner = e.Record.Op.Owner
			}
		}
		if owner == "" || owner == s.instance {
			continue
		}
		if live == nil {
			var err error
			if live, err = s.st.ControlPlanes(ctx); err != nil {
				return nil // unknown: the deadline still applies
			}
		}
		if !live[owner] {
			out[e.Record.ID] = true
		}
	}
	return out
}

// spawnReap runs fn for sandbox id on the reaper's pool (sem), at most
// once at a time per sandbox; a refusal (the record changed since the
// reaper read it) is logged as a skipped step.
func (s *Server) spawnReap(sem *reapPool, id, step string, fn func(context.Context) error) {
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
	case sem.slots <- struct{}{}:
	case <-sem.ctx.Done():
		release()
		return
	}
	sem.wg.Add(1)
	go func() {
		defer sem.wg.Done()
		defer func() { <-sem.slots; release() }()
		if err := fn(sem.ctx); err != nil {
			s.log.Debug("reaper: "+step+" skipped", "sandbox", id, "err", err)
		}
	}()
}
