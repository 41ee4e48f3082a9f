package sdk

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

	"connectrpc.com/connect"

	"github.com/spacesbx/space/internal/errdefs"
)

// Error classes. Every error returned for a server answer is an *Error that
// wraps one of them, so callers can test with errors.Is(err, sdk.ErrNotFound).
// Where a class is one of the platform's own (internal/errdefs) it is that
// very value, so errors.Is agrees on both sides; the others are the
// client's view of an answer (a status, not a server-side class).
var (
	ErrBadRequest   = errors.New("bad request")
	ErrUnauthorized = errors.New("unauthorized")
	ErrForbidden    = errors.New("forbidden")
	ErrNotFound     = errdefs.ErrNotFound
	ErrConflict     = errdefs.ErrConflict
	ErrTooLarge     = errdefs.ErrTooLarge
	ErrRateLimited  = errors.New("rate limited")
	// ErrRouteRefresh means the request reached an execution the control
	// plane no longer selects and the edge's one rebuilt attempt failed too
	// (HTTP 421). Retrying later is safe.
	ErrRouteRefresh = errors.New("route refresh required")
	ErrUnavailable  = errdefs.ErrUnavailable
	ErrServer       = errors.New("server error")
	ErrTimeout      = errdefs.ErrTimeout
)

// Error is a server's answer: HTTP status (or Connect code) and the JSON
// {code, message} it sent.
type Error struct {
	// Status is the HTTP status (0 for Connect errors sent in-band).
	Status int
	// Code is the Connect code name for RPC errors ("not_found"); empty
	// for REST errors.
	Code string
	// Message is the server's message.
	Message string
	// Reason is SPACE's machine-readable class, when sent.
	Reason string
	kind   error
}

func (e *Error) Error() string {
	if e.Message == "" {
		return e.kind.Error()
	}
	return fmt.Sprintf("%s: %s", e.kind, e.Message)
}

// Unwrap returns the error class (ErrNotFound, ...).
func (e *Error) Unwrap() error { return e.kind }

// ReasonSandboxNotFound is the edge's reason for a sandbox that is gone; it
// comes with status 502 as on E2B.
const ReasonSandboxNotFound = "sandbox_not_found"

// ReasonPaused is the reason of the edge's 502 for a paused sandbox (E2B's
// proxy answers 502 too); the SDK classes it as a conflict: resume, retry.
const ReasonPaused = "paused"

// kindFor classifies a response by status, letting a known reason refine it.
func kindFor(status int, reason string) error {
	switch reason {
	case ReasonSandboxNotFound:
		return ErrNotFound
	case ReasonPaused:
		return ErrConflict // the edge's 502 for a paused sandbox
	}
	return kindForStatus(status)
}

func kindForStatus(status int) error {
	switch {
	case status == http.StatusBadRequest, status == http.StatusUnprocessableEntity:
		return ErrBadRequest
	case status == http.StatusUnauthorized:
		return ErrUnauthorized
	case status == http.StatusForbidden:
		return ErrForbidden
	case status == http.StatusNotFound, status == http.StatusGone:
		return ErrNotFound
	case status == http.StatusConflict:
		return ErrConflict
	case status == http.StatusRequestEntityTooLarge:
		return ErrTooLarge
	case status == http.StatusTooManyRequests:
		return ErrRateLimited
	case status == http.StatusMisdirectedRequest:
		return ErrRouteRefresh
	case status == http.StatusGatewayTimeout, status == http.StatusRequestTimeout:
		return ErrTimeout
	case status == http.StatusBadGateway, status == http.StatusServiceUnavailable:
		return ErrUnavailable
	case status >= 500:
		return ErrServer
	case status >= 400:
		return ErrBadRequest
	}
	return ErrServer
}

// wireError is the JSON error body of E2B and SPACE APIs.
type wireError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
	Reason  string `json:"reason,omitempty"`
}

// errorFromResponse builds an *Error from a non-2xx response.
func errorFromResponse(res *http.Response) error {
	raw, _ := io.ReadAll(io.LimitReader(res.Body, 64<<10))
	e := &Error{Status: res.StatusCode, kind: kindForStatus(res.StatusCode)}
	var w wireError
	if json.Unmarshal(raw, &w) == nil && w.Message != "" {
		e.Message, e.Reason = w.Message, w.Reason
		e.kind = kindFor(res.StatusCode, w.Reason)
	} else if len(raw) > 0 && len(raw) < 512 {
		e.Message = string(raw)
	} else {
		e.Message = http.StatusText(res.StatusCode)
	}
	return e
}

// fromConnect converts an RPC error into an *Error.
func fromConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return err
	}
	// An HTTP-level error captured by the data-plane transport carries the
	// server's JSON answer.
	var he *Error
	if errors.As(ce.Unwrap(), &he) {
		return he
	}
	e := &Error{Code: ce.Code().String(), Message: ce.Message()}
	switch ce.Code() {
	case connect.CodeInvalidArgument, connect.CodeOutOfRange, connect.CodeFailedPrecondition:
		e.kind = ErrBadRequest
	case connect.CodeUnauthenticated:
		e.kind = ErrUnauthorized
	case connect.CodePermissionDenied:
		e.kind = ErrForbidden
	case connect.CodeNotFound:
		e.kind = ErrNotFound
	case connect.CodeAlreadyExists, connect.CodeAborted:
		e.kind = ErrConflict
	case connect.CodeResourceExhausted:
		e.kind = ErrRateLimited
	case connect.CodeUnavailable:
		e.kind = ErrUnavailable
	case connect.CodeDeadlineExceeded:
		e.kind = ErrTimeout
	case connect.CodeCanceled:
		return err
	default:
		e.kind = ErrServer
	}
	return e
}
