package sbxmanager

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/snapshot"
	"github.com/spacesbx/space/internal/substrate"
)

// reclaimingSubstrate is fakeSubstrate with a Reclaim that fails with err.
type reclaimingSubstrate struct {
	fakeSubstrate
	err     error
	reclaim []identity.Route
}

func (s *reclaimingSubstrate) Reclaim(_ context.Context, r identity.Route, _ string) error {
	s.reclaim = append(s.reclaim, r)
	return s.err
}

// At start every execution on record is reclaimed; one whose leftovers
// could not be ended is neither reported lost nor snapshotted, the others
// are reported.
func TestUnreclaimedExecutionIsNotRecovered(t *testing.T) {
	f := newFixture(t)
	f.install(t, route("sbxa", 1))
	f.install(t, route("sbxb", 1))
	f.m.Close()
	snaps, err := snapshot.NewLocal(filepath.Join(t.TempDir(), "snapshots"))
	if err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		err  error
		lost int
	}{{errors.New("cgroup busy"), 0}, {nil, 2}} {
		sub := &reclaimingSubstrate{err: tc.err}
		m, err := New(Config{WorkerID: "w1", StateDir: f.dir, SpacedHostPath: spacedHost, AgentPath: "/nonexistent", EnvdVersion: "0.5.7"},
			Deps{Substrates: []substrate.Substrate{sub}, WriteError: writeTestError, Verifier: f.m.ver, Snapshots: snaps})
		if err != nil {
			t.Fatal(err)
		}
		if len(sub.reclaim) != 2 {
			t.Errorf("reclaimed %v at start, want both executions", sub.reclaim)
		}
		if got := m.Lost(); len(got) != tc.lost {
			t.Errorf("reclaim error %v: Lost() = %v, want %d", tc.err, got, tc.lost)
		}
		if layer, ok := m.WritableLayer("sbxa"); ok {
			if err := os.MkdirAll(layer, 0o755); err != nil { // the fake start makes no layer
				t.Fatal(err)
			}
		}
		_, err = m.Snapshot(context.Background(), route("sbxa", 1), "snap-1")
		if tc.err != nil && !errors.Is(err, errdefs.ErrUnavailable) {
			t.Errorf("snapshot of an unreclaimed execution: %v, want unavailable", err)
		}
		if tc.err == nil && err != nil {
			t.Errorf("snapshot of a reclaimed execution: %v", err)
		}
		m.Close()
	}
}

// An activation directory no record names (the process died in an install
// before persisting its record) is removed at start; recorded ones stay.
func TestUnrecordedActivationIsRemovedAtStart(t *testing.T) {
	f := newFixture(t)
	f.install(t, route("sbxa", 1))
	f.m.Close()
	rec, ok := f.m.records["sbxa"]
	if !ok {
		t.Fatal("no record of sbxa")
	}
	if err := os.MkdirAll(rec.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	cut := activationDir(f.dir, route("sbxb", 1))
	if err := os.MkdirAll(filepath.Join(cut, "upper"), 0o700); err != nil {
		t.Fatal(err)
	}
	m, err := New(Config{WorkerID: "w1", StateDir: f.dir, SpacedHostPath: spacedHost, AgentPath: "/nonexistent", EnvdVersion: "0.5.7"},
		Deps{Substrates: []substrate.Substrate{&reclaimingSubstrate{}}, WriteError: writeTestError, Verifier: f.m.ver})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if _, err := os.Stat(cut); !os.IsNotExist(err) {
		t.Errorf("the unrecorded activation %s is still there: %v", cut, err)
	}
	if _, err := os.Stat(rec.Dir); err != nil {
		t.Errorf("the recorded activation's files went: %v", err)
	}
}
