package sbxmanager

import (
	"context"
	"errors"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
)

type fakeVolumes struct {
	held   map[string]int
	failOn string
}

func (f *fakeVolumes) Acquire(_ context.Context, id string) (string, func(), error) {
	if id == f.failOn {
		return "", nil, errdefs.Message(errdefs.ErrInvalid, "bad volume")
	}
	f.held[id]++
	return "/vol/" + id, func() { f.held[id]-- }, nil
}

// Volumes are resolved into the spec and released together; a worker
// without volumes refuses them; a failure releases what was taken.
func TestAcquireVolumes(t *testing.T) {
	vols := []spacev1.VolumeMount{{ID: "a", Name: "va", Path: "/mnt/a"}, {ID: "b", Name: "vb", Path: "/mnt/b", ReadOnly: true}}
	m := &Manager{cfg: Config{WorkerID: "w1"}}
	var spec substrate.Spec
	if _, err := m.acquireVolumes(context.Background(), vols, &spec); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("no volume source: %v", err)
	}
	rel, err := m.acquireVolumes(context.Background(), nil, &spec)
	if err != nil || len(spec.Volumes) != 0 {
		t.Fatalf("no volumes: %v %+v", err, spec.Volumes)
	}
	rel()
	f := &fakeVolumes{held: map[string]int{}}
	m.cfg.Volumes = f
	rel, err = m.acquireVolumes(context.Background(), vols, &spec)
	if err != nil {
		t.Fatal(err)
	}
	want := []substrate.VolumeMount{{Name: "va", Source: "/vol/a", Path: "/mnt/a"}, {Name: "vb", Source: "/vol/b", Path: "/mnt/b", ReadOnly: true}}
	if len(spec.Volumes) != 2 || spec.Volumes[0] != want[0] || spec.Volumes[1] != want[1] || f.held["a"] != 1 || f.held["b"] != 1 {
		t.Fatalf("spec %+v held %v", spec.Volumes, f.held)
	}
	rel()
	if f.held["a"] != 0 || f.held["b"] != 0 {
		t.Fatalf("not released: %v", f.held)
	}
	f.failOn = "b"
	spec = substrate.Spec{}
	if _, err := m.acquireVolumes(context.Background(), vols, &spec); !errors.Is(err, errdefs.ErrInvalid) || f.held["a"] != 0 {
		t.Fatalf("failure: %v, held %v", err, f.held)
	}
}
