package store

import (
	"context"
	"errors"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
)

// A lost-execution marker is one per sandbox, replaced by a newer report,
// and deleted only while it still names the execution the deleter handled.
func TestLostMarkers(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()
	r1 := testRecord("sbx-a").Route
	r2 := r1
	r2.Generation, r2.ExecutionID = 2, "e2"
	other := testRecord("sbx-b").Route
	for _, r := range []identity.Route{r1, other, r2} {
		if err := s.PutLost(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	// Two executions of one sandbox (a move cut by a crash: each worker
	// reports its own) are two markers.
	got, err := s.ListLost(ctx)
	if err != nil || len(got) != 3 {
		t.Fatalf("list: %v %+v", err, got)
	}
	// A re-report of an execution with another activation replaces its
	// marker, and deleting the older report leaves the newer one.
	r2b := r2
	r2b.ActivationID = "a2b"
	if err := s.PutLost(ctx, r2b); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteLost(ctx, r2); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.ListLost(ctx); len(got) != 3 {
		t.Fatalf("an older activation's delete removed the newer marker: %+v", got)
	}
	r2 = r2b
	if err := s.DeleteLost(ctx, r1); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.ListLost(ctx); len(got) != 2 {
		t.Fatalf("after deleting one execution's marker: %+v", got)
	}
	if err := s.DeleteLost(ctx, r2); err != nil {
		t.Fatal(err)
	}
	got, _ = s.ListLost(ctx)
	if len(got) != 1 || got[0] != other {
		t.Fatalf("after delete: %+v", got)
	}
	if err := s.PutLost(ctx, identity.Route{SandboxID: "x"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("an invalid route was recorded: %v", err)
	}
}
