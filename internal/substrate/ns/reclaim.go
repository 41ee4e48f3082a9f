//go:build linux

package ns

// Reclaiming an activation whose worker process died and that is not to
// be adopted: its sandbox may still run (a claimed init has no
// parent-death signal; a paused sandbox's tasks are frozen), and its
// tasks keep its mount namespace, so its layer disk stays mounted. Its
// files are kept (a recovery archives them).

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
)

// reclaimDiskWait bounds the wait for a reclaimed activation's layer disk
// to be released (its mount goes with the last task of its namespace).
const reclaimDiskWait = 10 * time.Second

// Reclaim ends what is left of route's activation (substrate.Reclaimer):
// every task of its cgroups is thawed and killed and the groups removed,
// then it waits until no loop device backs the layer disk in dir, so the
// disk can be mounted again without being mounted twice.
func (s *Substrate) Reclaim(ctx context.Context, route identity.Route, dir string) error {
	if !validComponent(route.SandboxID) || !validComponent(route.ActivationID) {
		return fmt.Errorf("ns: reclaim: %w: route %s/%s is not a safe name", errdefs.ErrInvalid, route.SandboxID, route.ActivationID)
	}
	cg := existingCgroup(s.cgroups, s.cfg.CgroupParent, route.SandboxID+"-"+route.ActivationID)
	if err := cg.remove(ctx); err != nil {
		return fmt.Errorf("ns: reclaim %s: %w", route.SandboxID, err)
	}
	img := filepath.Join(dir, DiskImageName)
	ctx, cancel := context.WithTimeout(ctx, reclaimDiskWait)
	defer cancel()
	return pollUntil(ctx, func() (bool, error) {
		dev := loopBacking(img)
		return dev == "", nil
	})
}

// loopBacking returns a loop device (/dev/loopN) attached to img, or "".
func loopBacking(img string) string {
	ents, err := os.ReadDir("/sys/block")
	if err != nil {
		return ""
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "loop") && loopBacks("/dev/"+e.Name(), img) {
			return "/dev/" + e.Name()
		}
	}
	return ""
}
