package controlplane

import (
	"context"
	"fmt"
	"net/http"

	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// handlePause is E2B's POST /sandboxes/{id}/pause: 204 once the execution
// is frozen, 409 when the sandbox is not running.
func (s *Server) handlePause(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	// memory:false asks for a filesystem-only pause; the ns substrate's
	// freezer keeps the processes anyway, which is more than asked.
	var req struct {
		Memory *bool `json:"memory"`
	}
	if err := decodeOptionalJSON(w, r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.pauseSandbox(r.Context(), id, c.TeamID, nil); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

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
	if err := s.node.pause(ctx, nodeURL, rec.Route); err != nil {
		log.Warn("pause failed", "err", err)
		back := store.StateRunning
		if !definiteRefusal(err) {
			// Unknown outcome: thaw, so a running record never hides a
			// frozen execution; if that fails too, keep it paused
			// (no capability is issued; a resume retries).
			if rerr := s.node.resume(ctx, nodeURL, rec.Route); rerr != nil {
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
	crashpoint.Hit(crashpoint.PauseFrozen)
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
