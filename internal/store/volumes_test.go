package store

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

// Volume names are unique per team; another team finds nothing by id or
// name; updates and deletes are revision-guarded.
func TestVolumes(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()
	a := VolumeRecord{ID: "vol_a", TeamID: "team-a", Name: "data", Token: "tok", CreatedAt: time.Now().UTC()}
	if err := s.CreateVolume(ctx, a); err != nil {
		t.Fatal(err)
	}
	if err := s.CreateVolume(ctx, VolumeRecord{ID: "vol_a2", TeamID: "team-a", Name: "data"}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("duplicate name: %v", err)
	}
	if err := s.CreateVolume(ctx, VolumeRecord{ID: "vol_b", TeamID: "team-b", Name: "data"}); err != nil {
		t.Fatalf("same name, other team: %v", err)
	}
	if err := s.CreateVolume(ctx, VolumeRecord{ID: "vol_c", TeamID: "team-a", Name: "a/b"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("name with a slash: %v", err)
	}
	for _, key := range []string{"vol_a", "data"} {
		got, _, err := s.GetVolume(ctx, "team-a", key)
		if err != nil || got.ID != "vol_a" || got.Token != "tok" {
			t.Fatalf("get %s: %+v %v", key, got, err)
		}
	}
	if _, _, err := s.GetVolume(ctx, "team-b", "vol_a"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("other team by id: %v", err)
	}
	if got, _, err := s.GetVolume(ctx, "team-b", "data"); err != nil || got.ID != "vol_b" {
		t.Fatalf("team-b's own: %+v %v", got, err)
	}
	list, err := s.ListVolumes(ctx, "team-a")
	if err != nil || len(list) != 1 || list[0].ID != "vol_a" {
		t.Fatalf("list: %+v %v", list, err)
	}
	_, rev, _ := s.GetVolume(ctx, "team-a", "vol_a")
	a.Deleting = true
	rev2, err := s.UpdateVolume(ctx, rev, a)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.UpdateVolume(ctx, rev, a); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("stale update: %v", err)
	}
	if err := s.DeleteVolume(ctx, a, rev); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("stale delete: %v", err)
	}
	if err := s.DeleteVolume(ctx, a, rev2); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.GetVolume(ctx, "team-a", "data"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("after delete: %v", err)
	}
}
