package sbxmanager

import (
	"errors"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
)

// A failed forward is unavailable; a raw transport error (which names host
// sockets) is logged, not returned, while a classed cause keeps its text.
func TestUnreachableHidesTransportDetails(t *testing.T) {
	var logged strings.Builder
	m := &Manager{log: slog.New(slog.NewTextHandler(&logged, nil))}
	r := httptest.NewRequest("GET", "/files", nil)
	raw := errors.New("dial unix /var/lib/space/workers/w1/act/x/host.sock: connect: connection refused")
	err := m.unreachable("sandbox bridge", r, raw)
	if !errors.Is(err, errdefs.ErrUnavailable) || strings.Contains(err.Error(), "host.sock") || err.Error() != "unavailable: sandbox bridge unreachable" {
		t.Fatalf("raw cause: %q", err)
	}
	if !strings.Contains(logged.String(), "host.sock") {
		t.Fatalf("the cause was not logged: %q", logged.String())
	}
	err = m.unreachable("sandbox bridge", r, ErrBridgeConnLost)
	if !errors.Is(err, errdefs.ErrUnavailable) || !errors.Is(err, ErrBridgeConnLost) || !strings.Contains(err.Error(), "bridge connection lost; not retried") {
		t.Fatalf("classed cause: %q", err)
	}
}
