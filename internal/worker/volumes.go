package worker

import (
	"context"
	"time"
)

// collectVolumes runs Deps.VolumeGC at start and every VolumeGCInterval
// until ctx ends. A failed pass is logged and tried again at the next.
func (w *Worker) collectVolumes(ctx context.Context) {
	t := time.NewTicker(VolumeGCInterval)
	defer t.Stop()
	for {
		if err := w.deps.VolumeGC(ctx); err != nil && ctx.Err() == nil {
			w.log.Warn("volume collection failed; deleted volumes' files stay until the next pass", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
