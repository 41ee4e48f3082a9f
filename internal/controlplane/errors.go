package controlplane

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

// errSandboxPaused refuses a capability for a paused sandbox: a conflict,
// which the capability endpoint marks with reason "paused" so that the edge
// can tell it apart from other conflicts.
var errSandboxPaused = fmt.Errorf("%w: paused", errdefs.ErrConflict)

// status is the one place the REST API turns an error into an HTTP status
// and the message safe to return: the error's errdefs class decides both.
// Unclassified errors are internal: their text (which may hold host
// details) is not returned.
func status(err error) (int, string) {
	return errdefs.HTTPStatus(err), errdefs.PublicMessage(err)
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// writeError answers err in E2B's error shape ({code, message}); a paused
// sandbox's refusal also carries spacev1.ReasonPaused.
func (s *Server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	code, msg := status(err)
	if code >= 500 {
		s.log.Error("request failed", "method", r.Method, "path", r.URL.Path, "status", code, "err", err)
	} else {
		s.log.Debug("request rejected", "method", r.Method, "path", r.URL.Path, "status", code, "err", err)
	}
	if code == http.StatusUnauthorized {
		w.Header().Set("WWW-Authenticate", `ApiKey header="X-API-Key"`)
	}
	body := spacev1.Error{Code: code, Message: msg}
	if errors.Is(err, errSandboxPaused) {
		body.Reason = spacev1.ReasonPaused
	}
	writeJSON(w, code, body)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
