package sbxmanager

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/snapshot"
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
