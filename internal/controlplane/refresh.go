package controlplane

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// E2B's bounds of a refresh (SandboxRefreshRequest.duration, seconds).
const (
	refreshDefault = 15
	refreshMax     = 3600
)

// handleRefresh serves E2B's POST /sandboxes/{id}/refreshes {duration}:
// the running sandbox is kept alive for at least duration seconds from now
// (default 15, at most 3600 and the server's MaxTimeout). Like E2B's
// keep-alive it only extends: a timeout already further away stays. 204;
// unknown, killed, other teams' and paused sandboxes are 404 (a paused
// sandbox has no time to live to extend), a bad duration 400.
func (s *Server) handleRefresh(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req e2bapi.SandboxRefreshRequest
	if err := decodeOptionalJSON(w, r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	secs := int64(refreshDefault)
	if req.Duration != nil {
		secs = *req.Duration
	}
	if secs < 0 || secs > refreshMax || time.Duration(secs)*time.Second > s.cfg.MaxTimeout {
		s.writeError(w, r, fmt.Errorf("%w: duration must be 0..%d seconds", errdefs.ErrInvalid, min(refreshMax, int64(s.cfg.MaxTimeout/time.Second))))
		return
	}
	end := s.now().UTC().Add(time.Duration(secs) * time.Second)
	_, _, err = s.st.MutateSandbox(r.Context(), id, func(rec *store.SandboxRecord) error {
		running := rec.State == store.StateRunning || (rec.Op != nil && rec.Op.From == store.StateRunning)
		if !visible(*rec, c.TeamID) || !running {
			return fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
		}
		if end.After(rec.EndAt) {
			rec.EndAt = end
		}
		return nil
	})
	if errors.Is(err, errdefs.ErrNotFound) {
		err = fmt.Errorf("%w: sandbox %s is not running", errdefs.ErrNotFound, id)
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
