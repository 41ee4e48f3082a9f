package edge

// Errors the edge answers. Every refusal is an errdefs class (which decides
// the HTTP status) with the edge's wire reason; errorResponse is the one
// place that turns an error into what the client reads.

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

// Wire reasons the edge's clients (the e2b SDKs, the tests) tell apart.
const (
	// reasonSandboxNotFound marks a control-plane 404: the sandbox is gone.
	reasonSandboxNotFound = "sandbox_not_found"
	reasonBadRequest      = "bad_request"
	reasonControlPlane    = "control_plane_error"
	reasonBodyBudget      = "body_budget_exhausted"
)

// answer is a refusal of class with the wire reason and the message the
// client reads.
func answer(class error, reason, msg string) error {
	return errdefs.WithReason(errdefs.Message(class, msg), reason)
}

func badRequest(msg string) error { return answer(errdefs.ErrInvalid, reasonBadRequest, msg) }

func controlPlaneError(msg string) error { return answer(errdefs.ErrUpstream, reasonControlPlane, msg) }

// pausedError answers a request for a paused sandbox. E2B's proxy cannot
// reach a paused sandbox and answers 502: the e2b SDK's isRunning() reports
// false on exactly that, and other calls raise its "sandbox timed out or
// paused" error. The reason tells it apart from a sandbox that is gone.
func pausedError(sandbox string) error {
	return answer(errdefs.ErrUpstream, spacev1.ReasonPaused,
		"sandbox "+sandbox+" is paused: resume it (connect) and retry")
}

// budgetError refuses a body for load, not for what it is: Retry-After
// tells the client to come back shortly.
func budgetError() error {
	return errdefs.WithRetryAfter(answer(errdefs.ErrUnavailable, reasonBodyBudget,
		"the edge is holding too many request bodies; retry shortly"), time.Second)
}

func bodyTimeoutError() error {
	return answer(errdefs.ErrTimeout, "body_timeout", "request body was not received in time")
}

// isNotFound reports whether err is a control-plane 404 (sandbox gone).
func isNotFound(err error) bool {
	return errdefs.Reason(err) == reasonSandboxNotFound
}

// classified reports whether err carries an errdefs class, i.e. is one of
// the edge's answers rather than a transport failure or a context's end.
func classified(err error) bool {
	st := errorStatus(err)
	return st != http.StatusInternalServerError && st != http.StatusGatewayTimeout
}

// errorStatus is the edge's one mapping from an error (its class) to an
// HTTP status; errorResponse, the metrics and the reattach decisions all
// read the status through it.
func errorStatus(err error) int { return errdefs.HTTPStatus(err) }

// errorResponse is the edge's one mapping from an error to the status,
// headers and JSON body {code, message, reason} the client gets.
func errorResponse(err error) (int, http.Header, []byte) {
	status := errorStatus(err)
	h := http.Header{"Content-Type": {"application/json"}, "Cache-Control": {"no-store"}}
	if ra := errdefs.RetryAfter(err); ra != "" {
		h.Set("Retry-After", ra)
	}
	body, _ := json.Marshal(spacev1.Error{Code: status, Message: errdefs.PublicMessage(err), Reason: errdefs.Reason(err)})
	return status, h, body
}

func writeError(w http.ResponseWriter, err error) {
	status, h, body := errorResponse(err)
	for k, v := range h {
		w.Header()[k] = v
	}
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}
