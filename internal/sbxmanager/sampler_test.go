package sbxmanager

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
)

func TestSampleRing(t *testing.T) {
	base := time.Unix(1_700_000_000, 0)
	at := func(i int) spacev1.MetricsResponse {
		return spacev1.MetricsResponse{Timestamp: base.Add(time.Duration(i) * time.Second), CPUUsedPct: float64(i)}
	}
	r := &sampleRing{buf: make([]spacev1.MetricsResponse, 4)}
	if got := r.window(time.Time{}, time.Time{}); len(got) != 0 {
		t.Fatalf("empty: %+v", got)
	}
	for i := range 6 { // wraps: 2..5 kept
		r.add(at(i))
	}
	r.add(at(3)) // out of order: dropped
	got := r.window(time.Time{}, time.Time{})
	if len(got) != 4 || got[0] != at(2) || got[3] != at(5) {
		t.Fatalf("wrapped: %+v", got)
	}
	got = r.window(at(3).Timestamp, at(4).Timestamp)
	if len(got) != 2 || got[0] != at(3) || got[1] != at(4) {
		t.Fatalf("window: %+v", got)
	}
	if got := r.window(at(9).Timestamp, time.Time{}); len(got) != 0 {
		t.Fatalf("after: %+v", got)
	}
}

func TestMetricsRangeRefusals(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	r := route("sbxm", 1)
	f.install(t, r)
	now := time.Now()
	for _, c := range []struct {
		route      identity.Route
		start, end time.Time
		want       error
	}{
		{identity.Route{SandboxID: "Bad"}, time.Time{}, time.Time{}, errdefs.ErrInvalid},
		{r, now, now.Add(-time.Second), errdefs.ErrInvalid},
		{route("other", 1), time.Time{}, time.Time{}, errdefs.ErrNotFound},
		{route("sbxm", 2), time.Time{}, time.Time{}, errdefs.ErrConflict},
		// The fake substrate reports no stats.
		{r, time.Time{}, time.Time{}, errdefs.ErrUnavailable},
	} {
		if _, err := f.m.MetricsRange(ctx, c.route, c.start, c.end); !errors.Is(err, c.want) {
			t.Fatalf("%v [%v, %v]: %v, want %v", c.route, c.start, c.end, err, c.want)
		}
	}
}
