package sbxmanager

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/snapshot"
	"github.com/spacesbx/space/internal/substrate"
)

func TestSnapshotAndRestoreOnInstall(t *testing.T) {
	f := newLCFixture(t)
	ctx := context.Background()
	r1 := route("sbxn", 1)
	f.install(t, r1)
	rec1, _ := f.m.records["sbxn"], 0
	upper1 := filepath.Join(rec1.Dir, fakeLayer)
	os.MkdirAll(filepath.Join(upper1, "root"), 0o700)
	os.WriteFile(filepath.Join(upper1, "root", "note"), []byte("kept across workers"), 0o600)

	if _, err := f.m.Snapshot(ctx, r1, "s1"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("snapshot while running: %v", err)
	}
	if _, err := f.m.Snapshot(ctx, r1, "../evil"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad snapshot id: %v", err)
	}
	if err := f.m.Pause(ctx, r1); err != nil {
		t.Fatal(err)
	}
	if _, err := f.m.Snapshot(ctx, route("sbxn", 2), "s1"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("snapshot of another execution: %v", err)
	}
	resp, err := f.m.Snapshot(ctx, r1, "s1")
	if err != nil || resp.SnapshotID != "s1" || resp.SizeBytes < 1024 {
		t.Fatalf("snapshot: %+v %v", resp, err)
	}

	// Failed restores leave the running execution alone.
	if _, err := f.m.Install(ctx, spacev1.InstallRequest{Route: route("sbxn", 2), Template: "base", RestoreSnapshot: "missing"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("restore of a missing snapshot: %v", err)
	}
	var evil bytes.Buffer
	tw := tar.NewWriter(&evil)
	tw.WriteHeader(&tar.Header{Name: "../../escape", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1})
	tw.Write([]byte("x"))
	tw.Close()
	f.snaps.Put(ctx, "evil", &evil)
	if _, err := f.m.Install(ctx, spacev1.InstallRequest{Route: route("sbxn", 2), Template: "base", RestoreSnapshot: "evil"}); !errors.Is(err, snapshot.ErrHostileArchive) {
		t.Fatalf("restore of a hostile snapshot: %v", err)
	}
	if rec, _ := f.m.Installed("sbxn"); rec.Route != r1 || !f.m.Paused("sbxn") {
		t.Fatalf("failed restore touched the running execution: %+v", rec)
	}

	// Resume as execution 2 from the snapshot (same worker here; another
	// worker shares the snapshot store the same way).
	if _, err := f.m.Install(ctx, spacev1.InstallRequest{Route: route("sbxn", 2), Template: "base", RestoreSnapshot: "s1"}); err != nil {
		t.Fatal(err)
	}
	rec2 := f.m.records["sbxn"]
	if b, err := os.ReadFile(filepath.Join(rec2.Dir, fakeLayer, "root", "note")); err != nil || string(b) != "kept across workers" {
		t.Fatalf("restored file: %q %v", b, err)
	}
	if _, err := os.Stat(rec1.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("superseded activation dir kept: %v", err)
	}
	if f.m.Paused("sbxn") {
		t.Fatal("new execution starts paused")
	}
}

func TestSnapshotWithoutStore(t *testing.T) {
	f := newFixture(t)
	f.install(t, route("sbxa", 1))
	if _, err := f.m.Snapshot(context.Background(), route("sbxa", 1), "s"); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("snapshot without store: %v", err)
	}
	if _, err := f.m.Install(context.Background(), spacev1.InstallRequest{Route: route("sbxa", 2), RestoreSnapshot: "s"}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("restore without store: %v", err)
	}
}

// stateSubstrate declares that its instances save their whole state
// (substrate.Capabilities.SavesState, as microvm does): snapshots and
// restores go through StateSaver and Spec.RestoreState, not the layer.
type stateSubstrate struct {
	connectSubstrate
	restoredMu sync.Mutex
	restored   []string // what each start was handed in RestoreState
}

func (s *stateSubstrate) Capabilities() substrate.Capabilities {
	return substrate.Capabilities{SavesState: true, Netns: true}
}

func (s *stateSubstrate) Start(ctx context.Context, spec substrate.Spec) (substrate.Instance, error) {
	var restored string
	if spec.RestoreState != "" {
		b, err := os.ReadFile(spec.RestoreState)
		if err != nil {
			return nil, err
		}
		restored = string(b)
	}
	s.restoredMu.Lock()
	s.restored = append(s.restored, restored)
	s.restoredMu.Unlock()
	inst, err := s.connectSubstrate.Start(ctx, spec)
	if err != nil {
		return nil, err
	}
	return &stateInstance{inst.(*connectInstance)}, nil
}

type stateInstance struct{ *connectInstance }

func (i *stateInstance) SaveState(_ context.Context, w io.Writer) (int64, error) {
	if !i.paused.Load() {
		return 0, errors.New("state saved while running")
	}
	n, err := fmt.Fprintf(w, "state of %s generation %d", i.route.SandboxID, i.route.Generation)
	return int64(n), err
}

// A substrate that saves state is snapshotted as that state (never as a
// layer, though this one has a layer too) and restored from it, whatever
// its name.
func TestSnapshotOfStateSavingSubstrate(t *testing.T) {
	sub := &stateSubstrate{}
	f := newLCFixtureOn(t, &sub.connectSubstrate, sub)
	ctx := context.Background()
	r1 := route("sbxs", 1)
	f.install(t, r1)
	if err := f.m.Pause(ctx, r1); err != nil {
		t.Fatal(err)
	}
	const want = "state of sbxs generation 1"
	resp, err := f.m.Snapshot(ctx, r1, "st1")
	if err != nil || resp.SizeBytes != int64(len(want)) {
		t.Fatalf("snapshot: %+v %v", resp, err)
	}
	rc, err := f.snaps.Open(ctx, "st1")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(rc)
	rc.Close()
	if string(b) != want {
		t.Fatalf("stored %q, want the instance's state", b)
	}

	r2 := route("sbxs", 2)
	if _, err := f.m.Install(ctx, spacev1.InstallRequest{Route: r2, Template: "base", RestoreSnapshot: "st1"}); err != nil {
		t.Fatal(err)
	}
	sub.restoredMu.Lock()
	got := sub.restored[len(sub.restored)-1]
	sub.restoredMu.Unlock()
	if got != want {
		t.Fatalf("restored from %q, want %q", got, want)
	}
	rec2 := f.m.records["sbxs"]
	if _, err := os.Stat(filepath.Join(rec2.Dir, stateFile)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("state file kept after the start: %v", err)
	}

	// Its state exists only while it runs.
	if err := f.m.Retire(ctx, r2); err != nil {
		t.Fatal(err)
	}
	if _, err := f.m.Snapshot(ctx, r2, "st2"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("snapshot of a stopped state-saving instance: %v", err)
	}
}
