package controlplane

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/scheduler"
)

func TestStatusMapping(t *testing.T) {
	cases := map[error]int{
		errdefs.ErrInvalid: 400, errdefs.ErrUnauthenticated: 401, errdefs.ErrDenied: 403, errdefs.ErrNotFound: 404,
		errdefs.ErrConflict: 409, errdefs.ErrTooLarge: 413, scheduler.ErrNoCapacity: 503,
		errdefs.ErrUnavailable: 503, errdefs.ErrUpstream: 502, context.DeadlineExceeded: 504, errors.New("secret detail"): 500,
	}
	for err, want := range cases {
		got, msg := status(err)
		if got != want {
			t.Errorf("%v: %d want %d", err, got, want)
		}
		if want == 500 && strings.Contains(msg, "secret") {
			t.Errorf("internal error text leaked: %q", msg)
		}
	}
}

// A worker's refusal reaches the client as 503 when the worker is
// unavailable and 502 otherwise: the worker's 404 or 409 is about its
// execution, not the client's request.
func TestNodeErrorStatus(t *testing.T) {
	for worker, want := range map[int]int{400: 502, 404: 502, 409: 502, 429: 503, 500: 502, 503: 503, 504: 502} {
		if got, _ := status(fmt.Errorf("pause: %w", &nodeError{Status: worker, Worker: "w1", Message: "x"})); got != want {
			t.Errorf("worker %d: client gets %d, want %d", worker, got, want)
		}
	}
}
