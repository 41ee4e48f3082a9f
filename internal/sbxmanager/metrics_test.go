package sbxmanager

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

// statsSubstrate wraps fakeSubstrate with instances that report stats.
type statsSubstrate struct{ fakeSubstrate }

type statsInstance struct {
	substrate.Instance
}

var testStats = substrate.Stats{
	Timestamp: time.Date(2026, 1, 2, 3, 4, 5, 0, time.FixedZone("x", 3600)),
	CPUCount:  2, CPUUsedPct: 12.5, MemUsed: 1 << 20, MemTotal: 512 << 20, MemCache: 4096, DiskUsed: 3 << 20,
}

func (statsInstance) Stats(context.Context) (substrate.Stats, error) { return testStats, nil }

func (s *statsSubstrate) Start(ctx context.Context, spec substrate.Spec) (substrate.Instance, error) {
	in, err := s.fakeSubstrate.Start(ctx, spec)
	if err != nil {
		return nil, err
	}
	return statsInstance{in}, nil
}

func TestMetrics(t *testing.T) {
	ctx := context.Background()
	// A substrate without StatsReporter: unavailable, not a crash.
	f := newFixture(t)
	r := route("sbxm", 1)
	f.install(t, r)
	if _, err := f.m.Metrics(ctx, r); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("fake substrate: %v", err)
	}
	if _, err := f.m.Metrics(ctx, route("other", 1)); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown: %v", err)
	}
	if _, err := f.m.Metrics(ctx, route("sbxm", 2)); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("other generation: %v", err)
	}
	if _, err := f.m.Metrics(ctx, identity.Route{SandboxID: "Bad"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("invalid: %v", err)
	}

	// A reporting substrate: the sample passes through, running or paused.
	pub, _, _ := ed25519.GenerateKey(rand.Reader)
	ver, _ := capability.NewVerifier(capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: pub}}})
	m, err := New(Config{WorkerID: "w1", StateDir: t.TempDir(), SpacedHostPath: spacedHost, AgentPath: "/nonexistent", EnvdVersion: "0.5.7"},
		Deps{Substrates: []substrate.Substrate{&statsSubstrate{}}, WriteError: writeTestError, Verifier: ver})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	if _, err := m.Install(ctx, spacev1.InstallRequest{Route: r, Template: "base"}); err != nil {
		t.Fatal(err)
	}
	want := spacev1.MetricsResponse{
		Timestamp: testStats.Timestamp.UTC(), CPUCount: 2, CPUUsedPct: 12.5,
		MemUsed: 1 << 20, MemTotal: 512 << 20, MemCache: 4096, DiskUsed: 3 << 20,
	}
	for _, pause := range []bool{false, true} {
		if pause {
			if err := m.Pause(ctx, r); err != nil {
				t.Fatal(err)
			}
		}
		got, err := m.Metrics(ctx, r)
		if err != nil || got != want {
			t.Fatalf("paused=%v: %+v %v", pause, got, err)
		}
	}
	if err := m.Retire(ctx, r); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Metrics(ctx, r); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("retired: %v", err)
	}
}
