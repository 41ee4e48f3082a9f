package controlplane

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// E2B defaults for the resume timeouts (seconds).
const (
	resumeDefaultTimeout = 15 // POST /sandboxes/{id}/resume (ResumedSandbox.timeout)
	// connect v2's default is the server's DefaultTimeout (300 s).
	// connectJoinWait bounds how long a connect waits for an operation in
	// flight to end before answering 409.
	connectJoinWait = 2 * time.Minute
)

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

// handleResume is E2B's deprecated POST /sandboxes/{id}/resume: 201 with
// the sandbox, 409 when it is not paused.
func (s *Server) handleResume(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req struct {
		Timeout   *int32 `json:"timeout"`
		AutoPause *bool  `json:"autoPause"`
		Memory    *bool  `json:"memory"`
	}
	if err := decodeOptionalJSON(w, r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	d, err := s.ttl(req.Timeout, resumeDefaultTimeout*time.Second)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if _, err := s.getSandbox(r.Context(), c, id); err != nil {
		s.writeError(w, r, err)
		return
	}
	rec, _, err := s.resumeSandbox(r.Context(), id, c.TeamID, resumeOpts{
		Timeout: d, Restart: req.Memory != nil && !*req.Memory, AutoPause: req.AutoPause,
	})
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, s.sandboxBody(rec))
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
		err := s.node.resume(ctx, nodeURL, rec.Route)
		switch {
		case executionLost(err):
			// The worker restarted: its record and the files are there,
			// the processes are not. Recover as a new execution from the
			// files (a move, which may pick the same worker).
			s.log.Warn("paused execution lost with its worker's restart; recovering it as a new execution",
				"sandbox", id, "generation", rec.Route.Generation, "worker", rec.Route.WorkerID)
		case err != nil:
			s.log.Warn("resume failed; the sandbox stays paused", "sandbox", id, "worker", rec.Route.WorkerID, "err", err)
			s.abortOp(ctx, id, op, store.StatePaused)
			return rec, nil, fmt.Errorf("resume sandbox %s: %w", id, err)
		default:
			crashpoint.Hit(crashpoint.ResumeThawed)
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
	}
	var exclude []string
	if !alive {
		exclude = append(exclude, rec.Route.WorkerID)
	}
	return s.move(ctx, rec, op, "", exclude, o.Timeout, o.AutoPause)
}

// handleConnect is E2B's connect (v1 and v2): a running sandbox gets its
// timeout extended (never shortened) and 200; a paused one is resumed and
// answers 201. A connect that meets another lifecycle operation joins it:
// it waits for the operation to end and acts on the outcome.
func (s *Server) handleConnect(w http.ResponseWriter, r *http.Request, c caller, v2 bool) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req struct {
		Timeout *int32 `json:"timeout"`
		Memory  *bool  `json:"memory"`
	}
	if err := decodeOptionalJSON(w, r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if !v2 && req.Timeout == nil {
		s.writeError(w, r, fmt.Errorf("%w: timeout is required", errdefs.ErrInvalid))
		return
	}
	d, err := s.ttl(req.Timeout, s.cfg.DefaultTimeout)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	rec, resumed, err := s.connectSandbox(r.Context(), c, id, d, req.Memory != nil && !*req.Memory)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	code := http.StatusOK
	if resumed {
		code = http.StatusCreated
	}
	writeJSON(w, code, s.sandboxBody(rec))
}

func (s *Server) connectSandbox(ctx context.Context, c caller, id string, d time.Duration, restart bool) (store.SandboxRecord, bool, error) {
	deadline := time.Now().Add(connectJoinWait)
	for {
		rec, err := s.getSandbox(ctx, c, id)
		if err != nil {
			return rec, false, err
		}
		switch {
		case rec.State.Transitional():
			if time.Now().After(deadline) {
				return rec, false, fmt.Errorf("%w: sandbox %s: a %s operation is still in progress", errBusy, id, rec.Op.Kind)
			}
			if _, err := s.waitSettled(ctx, id, time.Until(deadline)); err != nil {
				return rec, false, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
			}
			continue
		case rec.State == store.StateRunning:
			end := s.now().UTC().Add(d)
			rec, _, err = s.st.MutateSandbox(ctx, id, func(r *store.SandboxRecord) error {
				if !visible(*r, c.TeamID) {
					return fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
				}
				if r.State != store.StateRunning {
					return fmt.Errorf("%w: sandbox %s is %s", errBusy, id, r.State)
				}
				if end.After(r.EndAt) {
					r.EndAt = end
				}
				return nil
			})
			if errors.Is(err, errBusy) && time.Now().Before(deadline) {
				continue
			}
			if errors.Is(err, errdefs.ErrNotFound) {
				err = fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
			}
			return rec, false, err
		case rec.State == store.StatePaused:
			rec, _, err = s.resumeSandbox(ctx, id, c.TeamID, resumeOpts{Timeout: d, Restart: restart})
			if errors.Is(err, errdefs.ErrConflict) && time.Now().Before(deadline) {
				// Another operation (or a resume) got in first: join it.
				continue
			}
			return rec, err == nil, err
		default:
			return rec, false, fmt.Errorf("%w: sandbox %s is %s", errdefs.ErrConflict, id, rec.State)
		}
	}
}
