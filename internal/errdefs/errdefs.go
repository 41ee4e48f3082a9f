// Package errdefs defines the error classes shared by SPACE's components
// (containerd style). Core code wraps one of these with %w; only API edges
// turn a class into an HTTP status or Connect code.
package errdefs

import (
	"errors"
	"net/http"
)

// Error classes.
var (
	ErrNotFound    = errors.New("not found")
	ErrConflict    = errors.New("conflict")
	ErrInvalid     = errors.New("invalid argument")
	ErrDenied      = errors.New("permission denied")
	ErrUnavailable = errors.New("unavailable")
)

// HTTPStatus maps an error's class to an HTTP status (500 when it has none).
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
	case errors.Is(err, ErrDenied):
		return http.StatusForbidden
	case errors.Is(err, ErrUnavailable):
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

// Reason is a stable lower-case name of err's class for JSON bodies.
func Reason(err error) string {
	switch {
	case errors.Is(err, ErrNotFound):
		return "not_found"
	case errors.Is(err, ErrConflict):
		return "conflict"
	case errors.Is(err, ErrInvalid):
		return "invalid"
	case errors.Is(err, ErrDenied):
		return "denied"
	case errors.Is(err, ErrUnavailable):
		return "unavailable"
	}
	return "internal"
}
