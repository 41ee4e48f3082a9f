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

// reapLoop kills sandboxes whose timeout passed, fails records stuck in
// creating (a crashed create), and purges old tombstones. It works from the
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

func (s *Server) spawnKill(sem chan struct{}, id, reason string, check func(store.SandboxRecord) error) {
	s.reapMu.Lock()
	if s.reaping[id] {
		s.reapMu.Unlock()
		return
	}
	s.reaping[id] = true
	s.reapMu.Unlock()
	select {
	case sem <- struct{}{}:
	case <-s.ctx.Done():
		s.reapMu.Lock()
		delete(s.reaping, id)
		s.reapMu.Unlock()
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer func() {
			<-sem
			s.reapMu.Lock()
			delete(s.reaping, id)
			s.reapMu.Unlock()
		}()
		if err := s.killSandbox(s.ctx, id, "", reason, check); err != nil {
			s.log.Debug("reaper: kill skipped", "sandbox", id, "err", err)
		}
	}()
}
