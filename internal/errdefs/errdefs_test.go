package errdefs

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"
)

func TestClassesRoundTripThroughHTTP(t *testing.T) {
	for _, class := range []error{ErrNotFound, ErrConflict, ErrInvalid, ErrUnauthenticated, ErrDenied, ErrTooLarge, ErrTimeout, ErrUnavailable, ErrUpstream, context.DeadlineExceeded} {
		err := fmt.Errorf("op: %w: detail", class)
		st := HTTPStatus(err)
		back := FromHTTPStatus(st, "remote said so")
		if !errors.Is(back, class) {
			t.Errorf("%v -> %d -> %v: class lost", class, st, back)
		}
		if back.Error() != "remote said so" {
			t.Errorf("message %q", back.Error())
		}
	}
}

func TestUnclassifiedIsInternalAndHidden(t *testing.T) {
	err := errors.New("open /var/lib/space/secret: permission denied")
	if HTTPStatus(err) != http.StatusInternalServerError || Reason(err) != "internal" || ConnectCode(err) != "internal" {
		t.Fatalf("unclassified: %d %s %s", HTTPStatus(err), Reason(err), ConnectCode(err))
	}
	if PublicMessage(err) != "internal error" {
		t.Fatalf("internal text leaked: %q", PublicMessage(err))
	}
	if got := PublicMessage(fmt.Errorf("%w: sandbox x", ErrNotFound)); got != "not found: sandbox x" {
		t.Fatalf("classified text: %q", got)
	}
	if FromHTTPStatus(204, "") != nil || !errors.Is(FromHTTPStatus(500, ""), ErrUpstream) {
		t.Fatal("FromHTTPStatus: 2xx must be nil, 500 upstream")
	}
}

func TestReasonAndRetryAfter(t *testing.T) {
	base := fmt.Errorf("%w: sandbox s is paused", ErrUpstream)
	err := WithReason(base, "paused")
	if Reason(err) != "paused" || HTTPStatus(err) != http.StatusBadGateway || err.Error() != base.Error() {
		t.Fatalf("reason %q status %d text %q", Reason(err), HTTPStatus(err), err)
	}
	if RetryAfter(err) != "" {
		t.Fatal("retry-after without one set")
	}
	busy := WithRetryAfter(WithReason(fmt.Errorf("%w: body budget spent", ErrUnavailable), "body_budget_exhausted"), 300*time.Millisecond)
	if RetryAfter(busy) != "1" || Reason(busy) != "body_budget_exhausted" || !errors.Is(busy, ErrUnavailable) {
		t.Fatalf("retry %q reason %q", RetryAfter(busy), Reason(busy))
	}
	if WithReason(nil, "x") != nil || WithRetryAfter(nil, time.Second) != nil {
		t.Fatal("nil must stay nil")
	}
}

func TestMessageKeepsExactText(t *testing.T) {
	err := Message(ErrUpstream, "sandbox s is paused")
	if err.Error() != "sandbox s is paused" || !errors.Is(err, ErrUpstream) || HTTPStatus(err) != http.StatusBadGateway {
		t.Fatalf("%q %d", err, HTTPStatus(err))
	}
}
