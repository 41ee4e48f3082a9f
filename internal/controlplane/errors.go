package controlplane

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/scheduler"
	"github.com/spacesbx/space/internal/store"
)

// Error classes of the core. Errors wrap one of them; the HTTP edge maps the
// class to a status (and nothing else decides statuses).
var (
	ErrInvalid         = errors.New("invalid request")
	ErrUnauthenticated = errors.New("unauthenticated")
	ErrDenied          = errors.New("permission denied")
	ErrNotFound        = errors.New("not found")
	ErrConflict        = errors.New("conflict")
	ErrUnavailable     = errors.New("unavailable")
	ErrUpstream        = errors.New("worker error")
	ErrTooLarge        = errors.New("request body too large")
)

// errSandboxPaused refuses a capability for a paused sandbox: a conflict,
// which the capability endpoint marks with reason "paused".
var errSandboxPaused = fmt.Errorf("%w: paused", ErrConflict)

// status maps an error to its HTTP status and the message safe to return.
// Unclassified errors are internal: their text is not returned.
func status(err error) (int, string) {
	msg := err.Error()
	switch {
	case errors.Is(err, ErrTooLarge):
		return http.StatusRequestEntityTooLarge, msg
	case errors.Is(err, ErrInvalid), errors.Is(err, store.ErrInvalid):
		return http.StatusBadRequest, msg
	case errors.Is(err, ErrUnauthenticated):
		return http.StatusUnauthorized, msg
	case errors.Is(err, ErrDenied):
		return http.StatusForbidden, msg
	case errors.Is(err, ErrNotFound), errors.Is(err, store.ErrNotFound):
		return http.StatusNotFound, msg
	case errors.Is(err, ErrConflict), errors.Is(err, store.ErrConflict):
		return http.StatusConflict, msg
	case errors.Is(err, ErrUnavailable), errors.Is(err, scheduler.ErrNoCapacity):
		return http.StatusServiceUnavailable, msg
	case errors.Is(err, ErrUpstream):
		return http.StatusBadGateway, msg
	case errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout, "deadline exceeded"
	}
	return http.StatusInternalServerError, "internal error"
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

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
	writeJSON(w, code, e2bapi.Error{Code: code, Message: msg})
}
