package sbxmanager

import (
	"context"
	"fmt"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
)

// VolumeSource makes a team volume's files available on this host
// (internal/volume.Manager).
type VolumeSource interface {
	// Acquire returns the host directory of volume id's files, valid
	// until release; a sandbox started with it keeps its own mount.
	Acquire(ctx context.Context, id string) (dir string, release func(), err error)
}

// acquireVolumes resolves vols into spec.Volumes; the returned release
// lets go of the worker's hold on them (call it once the instance runs,
// or failed to start).
func (m *Manager) acquireVolumes(ctx context.Context, vols []spacev1.VolumeMount, spec *substrate.Spec) (release func(), err error) {
	var rels []func()
	release = func() {
		for _, r := range rels {
			r()
		}
	}
	if len(vols) == 0 {
		return release, nil
	}
	if m.cfg.Volumes == nil {
		return nil, fmt.Errorf("start sandbox: %w", errdefs.Message(errdefs.ErrUnavailable, "volumes are not available on worker "+m.cfg.WorkerID))
	}
	for _, v := range vols {
		dir, rel, err := m.cfg.Volumes.Acquire(ctx, v.ID)
		if err != nil {
			release()
			return nil, fmt.Errorf("start sandbox: volume %q: %w", v.Name, err)
		}
		rels = append(rels, rel)
		spec.Volumes = append(spec.Volumes, substrate.VolumeMount{Name: v.Name, Source: dir, Path: v.Path, ReadOnly: v.ReadOnly})
	}
	return release, nil
}
