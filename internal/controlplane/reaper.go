package controlplane

import (
	"context"
	"fmt"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// maxConcurrentKills bounds the reaper's teardowns in flight.
const maxConcurrentKills = 8

// reapLoop kills sandboxes whose timeout passed (pauses those created with
// autoPause), releases records whose lifecycle operation overran its
// deadline, fails records stuck in creating (a crashed create), and purges
// old tombstones. It works from the
// store only, so a restarted (or another) control plane resumes it.
func (s *Server) reapLoop() {
	defer s.wg.Done()
	t := time.NewTicker(s.cfg.ReapInterval)
	defer t.Stop()
	sem := make(chan struct{}, maxConcurrentKills)
	for {
		s.reapOnce(sem)
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (s *Server) reapOnce(sem chan struct{}) {
	ctx, cancel := context.WithTimeout(s.ctx, 30*time.Second)
	defer cancel()
	entries, err := s.st.ListSandboxes(ctx)
	if err != nil {
		if s.ctx.Err() == nil {
			s.log.Warn("reaper: listing sandboxes failed", "err", err)
		}
		return
	}
	now := s.now()
	staleCreate := 2*s.cfg.InstallTimeout + 30*time.Second
	for _, e := range entries {
		r := e.Record
		switch {
		case r.State == store.StateRunning && r.AutoPause && !r.EndAt.After(now):
			s.spawnAutoPause(sem, r.ID)
		case r.Op != nil && now.Sub(r.Op.StartedAt) > s.opDeadline():
			s.spawnRecover(sem, r.ID, r.Op.ID)
		case (r.State == store.StateRunning || r.State == store.StatePaused) && !r.EndAt.After(now):
			s.spawnKill(sem, r.ID, "timeout", func(cur store.SandboxRecord) error {
				if cur.EndAt.After(s.now()) {
					return fmt.Errorf("%w: timeout extended", errdefs.ErrConflict)
				}
				return nil
			})
		case r.State == store.StateCreating && now.Sub(r.CreatedAt) > staleCreate:
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
func (s *Server) spawnKill(sem chan struct{}, id, reason string, check func(store.SandboxRecord) error) {
	s.spawnReap(sem, id, "kill", func(ctx context.Context) error { return s.killSandbox(ctx, id, "", reason, check) })
}

// spawnAutoPause pauses a running sandbox whose timeout passed and which was
// created with autoPause (instead of killing it).
func (s *Server) spawnAutoPause(sem chan struct{}, id string) {
	s.spawnReap(sem, id, "lifecycle step", func(ctx context.Context) error {
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
	s.spawnReap(sem, id, "lifecycle step", func(ctx context.Context) error { return s.recoverOp(ctx, id, opID) })
}

// spawnReap runs fn for sandbox id on the reaper's pool (sem), at most
// once at a time per sandbox; a refusal (the record changed since the
// reaper read it) is logged as a skipped step.
func (s *Server) spawnReap(sem chan struct{}, id, step string, fn func(context.Context) error) {
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
			s.log.Debug("reaper: "+step+" skipped", "sandbox", id, "err", err)
		}
	}()
}
