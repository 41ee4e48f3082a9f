package store

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

func TestLifecycleStateAndSnapshots(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()

	rec := testRecord("lifecycle0000000000a")
	rev, err := s.CreateSandbox(ctx, rec)
	if err != nil {
		t.Fatal(err)
	}
	// A transitional state needs an operation and vice versa.
	bad := rec
	bad.State = StateMigrating
	if _, err := s.UpdateSandbox(ctx, rec.ID, rev, bad); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("transitional without op: %v", err)
	}
	bad = rec
	bad.Op = &LifecycleOp{ID: "op1", Kind: "pause", From: StateRunning}
	if _, err := s.UpdateSandbox(ctx, rec.ID, rev, bad); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("op on a stable state: %v", err)
	}
	// A pending route must lie above the published route, within the counter.
	bad = rec
	bad.State, bad.Op = StateMigrating, &LifecycleOp{ID: "op1", Kind: "migrate", From: StateRunning}
	p := rec.Route
	bad.PendingRoute = &p
	if _, err := s.UpdateSandbox(ctx, rec.ID, rev, bad); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("pending route at the published generation: %v", err)
	}
	good := bad
	good.Generation = 2
	p.Generation, p.ExecutionID = 2, "e2"
	good.PendingRoute = &p
	if _, err := s.UpdateSandbox(ctx, rec.ID, rev, good); err != nil {
		t.Fatal(err)
	}
	got, _, err := s.GetSandbox(ctx, rec.ID)
	if err != nil || got.Op == nil || got.Op.ID != "op1" || got.PendingRoute == nil || got.PendingRoute.ExecutionID != "e2" || !got.State.Transitional() {
		t.Fatalf("round trip: %+v %v", got, err)
	}

	snap := SnapshotRecord{ID: "snap-1", TeamID: "team-a", SandboxID: rec.ID, TemplateID: "base", CreatedAt: time.Now().UTC()}
	if err := s.CreateSnapshot(ctx, snap); err != nil {
		t.Fatal(err)
	}
	if err := s.CreateSnapshot(ctx, snap); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("duplicate: %v", err)
	}
	if err := s.CreateSnapshot(ctx, SnapshotRecord{ID: "../x", TeamID: "t"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad id: %v", err)
	}
	if g, err := s.GetSnapshot(ctx, "snap-1"); err != nil || g.SandboxID != rec.ID {
		t.Fatalf("get: %+v %v", g, err)
	}
	if _, err := s.GetSnapshot(ctx, "Bad/Id"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("get bad id: %v", err)
	}
	if l, err := s.ListSnapshots(ctx); err != nil || len(l) != 1 {
		t.Fatalf("list: %v %v", l, err)
	}
	if err := s.DeleteSnapshot(ctx, "snap-1"); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteSnapshot(ctx, "snap-1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("delete twice: %v", err)
	}
}
