// Package errdefs defines the one set of error classes every SPACE
// component uses (containerd's errdefs is the model). Core code wraps a
// class with %w (fmt.Errorf("pause %s: %w: ...", id, errdefs.ErrConflict));
// only the API edges (the control plane's REST server, the node API, the
// edge) turn a class into an HTTP status or Connect code, each through one
// function of its own that calls HTTPStatus, and clients turn a status they
// receive back into a class with FromHTTPStatus.
package errdefs

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"
)

// Error classes.
var (
	// ErrNotFound: the named thing does not exist (or is not visible to
	// the caller).
	ErrNotFound = errors.New("not found")
	// ErrConflict: the thing exists but is in a state that forbids the
	// operation (a paused sandbox, a lost revision race).
	ErrConflict = errors.New("conflict")
	// ErrInvalid: the request itself is malformed or out of range.
	ErrInvalid = errors.New("invalid request")
	// ErrUnauthenticated: the caller did not prove who it is.
	ErrUnauthenticated = errors.New("unauthenticated")
	// ErrDenied: the caller is known but may not do this.
	ErrDenied = errors.New("permission denied")
	// ErrTooLarge: a body, archive or value exceeds its limit.
	ErrTooLarge = errors.New("too large")
	// ErrTimeout: the client was too slow (a body that stalled).
	ErrTimeout = errors.New("timed out")
	// ErrUnavailable: not possible now; retrying later may succeed (no
	// capacity, a worker not ready, a budget spent).
	ErrUnavailable = errors.New("unavailable")
	// ErrUpstream: a component this one called failed or answered
	// something unusable (a worker's 5xx, an unreachable sandbox).
	ErrUpstream = errors.New("upstream error")
)

// HTTPStatus maps an error's class to an HTTP status: 500 when it has
// none, 504 for a context deadline.
func HTTPStatus(err error) int {
	switch {
	case err == nil:
		return http.StatusOK
	case errors.Is(err, ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, ErrConflict):
		return http.StatusConflict
	case errors.Is(err, ErrInvalid):
		return http.StatusBadRequest
	case errors.Is(err, ErrUnauthenticated):
		return http.StatusUnauthorized
	case errors.Is(err, ErrDenied):
		return http.StatusForbidden
	case errors.Is(err, ErrTooLarge):
		return http.StatusRequestEntityTooLarge
	case errors.Is(err, ErrTimeout):
		return http.StatusRequestTimeout
	case errors.Is(err, ErrUnavailable):
		return http.StatusServiceUnavailable
	case errors.Is(err, ErrUpstream):
		return http.StatusBadGateway
	case errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// ConnectCode maps an error's class to a Connect error code
// (connectrpc.com/docs/protocol#error-codes).
func ConnectCode(err error) string {
	switch {
	case errors.Is(err, ErrNotFound):
		return "not_found"
	case errors.Is(err, ErrConflict):
		return "failed_precondition"
	case errors.Is(err, ErrInvalid):
		return "invalid_argument"
	case errors.Is(err, ErrUnauthenticated):
		return "unauthenticated"
	case errors.Is(err, ErrDenied):
		return "permission_denied"
	case errors.Is(err, ErrTooLarge):
		return "resource_exhausted"
	case errors.Is(err, ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		return "deadline_exceeded"
	case errors.Is(err, ErrUnavailable), errors.Is(err, ErrUpstream):
		return "unavailable"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	return "internal"
}

// FromHTTPStatus is the class of an HTTP error status a client received
// (nil for a 2xx/3xx); msg becomes the error's text. Statuses without a
// class of their own (500 and other 5xx) are ErrUpstream: the remote side
// failed.
func FromHTTPStatus(status int, msg string) error {
	var class error
	switch status {
	case http.StatusBadRequest, http.StatusUnprocessableEntity:
		class = ErrInvalid
	case http.StatusUnauthorized:
		class = ErrUnauthenticated
	case http.StatusForbidden:
		class = ErrDenied
	case http.StatusNotFound, http.StatusGone:
		class = ErrNotFound
	case http.StatusConflict, http.StatusPreconditionFailed:
		class = ErrConflict
	case http.StatusRequestEntityTooLarge:
		class = ErrTooLarge
	case http.StatusRequestTimeout:
		class = ErrTimeout
	case http.StatusTooManyRequests, http.StatusServiceUnavailable:
		class = ErrUnavailable
	case http.StatusGatewayTimeout:
		class = context.DeadlineExceeded
	default:
		if status < 400 {
			return nil
		}
		class = ErrUpstream
	}
	if msg == "" {
		return class
	}
	return Message(class, msg)
}

// Message is an error of class whose text is exactly msg (fmt.Errorf("%w:
// ...") would put the class's name in front): for answers whose wording
// clients read, and for statuses received from another component.
func Message(class error, msg string) error { return &messageError{class: class, msg: msg} }

type messageError struct {
	class error
	msg   string
}

func (e *messageError) Error() string { return e.msg }
func (e *messageError) Unwrap() error { return e.class }

// reasonError carries an explicit wire reason and retry hint.
type reasonError struct {
	err        error
	reason     string
	retryAfter time.Duration
}

func (e *reasonError) Error() string { return e.err.Error() }
func (e *reasonError) Unwrap() error { return e.err }

// WithReason attaches a stable wire reason (e.g. "paused",
// "sandbox_not_found") to err; Reason returns it instead of the class
// name. err keeps its class.
func WithReason(err error, reason string) error {
	if err == nil {
		return nil
	}
	return &reasonError{err: err, reason: reason}
}

// WithRetryAfter marks err as a refusal about load: an edge sends
// Retry-After with d (whole seconds, at least 1).
func WithRetryAfter(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return &reasonError{err: err, retryAfter: d}
}

// RetryAfter is the Retry-After value (seconds) an edge sends with err, or
// "" when err carries none.
func RetryAfter(err error) string {
	for e := err; e != nil; e = errors.Unwrap(e) {
		if re, ok := e.(*reasonError); ok && re.retryAfter > 0 {
			return strconv.Itoa(max(1, int(re.retryAfter/time.Second)))
		}
	}
	return ""
}

// Reason is a stable lower-case name for err in JSON bodies: the reason
// WithReason attached (the outermost), else its class's name.
func Reason(err error) string {
	for e := err; e != nil; e = errors.Unwrap(e) {
		if re, ok := e.(*reasonError); ok && re.reason != "" {
			return re.reason
		}
	}
	switch {
	case errors.Is(err, ErrNotFound):
		return "not_found"
	case errors.Is(err, ErrConflict):
		return "conflict"
	case errors.Is(err, ErrInvalid):
		return "invalid"
	case errors.Is(err, ErrUnauthenticated):
		return "unauthenticated"
	case errors.Is(err, ErrDenied):
		return "denied"
	case errors.Is(err, ErrTooLarge):
		return "too_large"
	case errors.Is(err, ErrTimeout):
		return "timeout"
	case errors.Is(err, ErrUnavailable):
		return "unavailable"
	case errors.Is(err, ErrUpstream):
		return "upstream"
	case errors.Is(err, context.DeadlineExceeded):
		return "deadline_exceeded"
	}
	return "internal"
}

// PublicMessage is the text an edge may return to a client for err:
// classified errors say what went wrong; an unclassified (internal) error's
// text may hold host details and is replaced.
func PublicMessage(err error) string {
	switch HTTPStatus(err) {
	case http.StatusInternalServerError:
		return "internal error"
	case http.StatusGatewayTimeout:
		return "deadline exceeded"
	}
	return err.Error()
}
