package controlplane

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

// handleHealth answers 200 while the store answers (GET /health).
func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := s.st.Ping(ctx); err != nil {
		s.writeError(w, r, fmt.Errorf("%w: store not answering", errdefs.ErrUnavailable))
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// handleWorkers lists the worker registry (admin keys and the edge).
func (s *Server) handleWorkers(w http.ResponseWriter, r *http.Request) {
	c, err := s.authenticate(r.Context(), r.Header.Get(spacev1.HeaderAPIKey))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if !c.operator() && !c.edge() {
		s.writeError(w, r, fmt.Errorf("%w: listing workers needs an admin key of the bootstrap team", errdefs.ErrDenied))
		return
	}
	ws, _, err := s.workersWithLoad(r.Context(), "", true)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, ws)
}

// handleExecutions lists a sandbox's executions (owner's key or the edge),
// tombstoned sandboxes included until they are purged.
func (s *Server) handleExecutions(w http.ResponseWriter, r *http.Request) {
	// An API key, the edge's key, or an access token (the dashboard's).
	c, err := s.authenticateRequest(r)
	if err != nil {
		s.authFailed(w, r, err)
		return
	}
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	rec, _, err := s.st.GetSandbox(r.Context(), id)
	if errors.Is(err, errdefs.ErrNotFound) || (err == nil && !c.edge() && rec.TeamID != c.TeamID) {
		s.writeError(w, r, fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id))
		return
	}
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	out := rec.Executions
	if out == nil {
		out = []spacev1.Execution{}
	}
	writeJSON(w, http.StatusOK, out)
}
