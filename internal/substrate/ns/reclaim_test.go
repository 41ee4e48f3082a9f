//go:build linux

package ns

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

// What a dead worker leaves of a paused sandbox (its frozen tasks, which
// ignore the parent-death signal until thawed, and its cgroups) is ended by
// Reclaim; its files stay. (The layer disk's release needs the worker that
// mounted it gone: the restart suite, test/restart, covers it.)
func TestReclaimEndsAFrozenSandbox(t *testing.T) {
	s, inst, spec := startWith(t, Config{StateDir: t.TempDir(), NoDiskQuota: true})
	mustOK(t, inst, 1000, `echo kept > /home/user/file; sleep 1000 </dev/null >/dev/null 2>&1 &`)
	ctx := context.Background()
	if err := inst.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	dirs := append([]string(nil), inst.cg.dirs...)
	if err := s.Reclaim(ctx, spec.Route, spec.Dir); err != nil {
		t.Fatal(err)
	}
	select {
	case <-inst.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the frozen sandbox's init survived Reclaim")
	}
	for _, d := range dirs {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("cgroup %s left: %v", d, err)
		}
	}
	if b, err := os.ReadFile(inst.LayerDir() + "/home/user/file"); err != nil || string(b) != "kept\n" {
		t.Errorf("the files went with the processes: %q %v", b, err)
	}
	// Nothing left is not an error; an unsafe name is refused.
	if err := s.Reclaim(ctx, spec.Route, spec.Dir); err != nil {
		t.Fatalf("second Reclaim: %v", err)
	}
	bad := spec.Route
	bad.ActivationID = "../x"
	if err := s.Reclaim(ctx, bad, spec.Dir); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("unsafe route: %v", err)
	}
}
