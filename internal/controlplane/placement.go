package controlplane

import (
	"context"
	"fmt"
	"strings"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/store"
)

// newRoute names a new execution of sandbox id on workerID.
func (s *Server) newRoute(id string, gen uint64, workerID, substrate string) identity.Route {
	return identity.Route{
		SandboxID: id, Generation: gen, ExecutionID: randHex(16), WorkerID: workerID,
		Substrate: substrate, ActivationID: randHex(16),
	}
}

// workersWithLoad lists the registered workers that run substrate ("":
// all of them), with their load: the larger of the worker's own report and
// its placements as the store sees them (creating, running and moving
// sandboxes), which may be ahead of the report. It also returns every
// worker's placement revision at the listing: a placement on a worker
// commits only with the guard placementOf builds from it, so two
// decisions made from the same load (concurrent creates, on one control
// plane or on two) cannot both commit (store.Placement).
func (s *Server) workersWithLoad(ctx context.Context, substrate string) ([]spacev1.Worker, map[string]int64, error) {
	// The two reads are independent: the sandbox records are read while
	// the workers are.
	type listed struct {
		entries []store.SandboxEntry
		revs    map[string]int64
		err     error
	}
	sbxs := make(chan listed, 1)
	go func() {
		e, revs, err := s.st.PlacementView(ctx)
		sbxs <- listed{e, revs, err}
	}()
	all, err := s.st.ListWorkers(ctx)
	if err != nil {
		<-sbxs
		return nil, nil, fmt.Errorf("%w: worker registry: %v", errdefs.ErrUnavailable, err)
	}
	var ws []spacev1.Worker
	var why []string
	for _, w := range all {
		if substrate == "" || w.Serves(substrate) {
			ws = append(ws, w)
		} else if r := w.Unavailable[substrate]; r != "" {
			why = append(why, w.ID+": "+r)
		}
	}
	if len(all) > 0 && len(ws) == 0 {
		<-sbxs
		if len(why) > 0 {
			return nil, nil, fmt.Errorf("%w: no registered worker runs the %s substrate (%s)", errdefs.ErrUnavailable, substrate, strings.Join(why, "; "))
		}
		return nil, nil, fmt.Errorf("%w: no registered worker runs the %s substrate", errdefs.ErrUnavailable, substrate)
	}
	l := <-sbxs
	entries, err := l.entries, l.err
	if err != nil {
		return nil, nil, fmt.Errorf("%w: sandbox records: %v", errdefs.ErrUnavailable, err)
	}
	placed := map[string]int{}
	for _, e := range entries {
		if e.Record.State == store.StateCreating || e.Record.State == store.StateRunning || e.Record.State.Transitional() {
			placed[e.Record.Route.WorkerID]++
		}
		if p := e.Record.PendingRoute; p != nil && !e.Record.State.Terminal() {
			placed[p.WorkerID]++
		}
	}
	for i := range ws {
		ws[i].Load = max(ws[i].Load, placed[ws[i].ID])
	}
	return ws, l.revs, nil
}

// placementOf is the guard of a placement on worker as read in revs.
func placementOf(revs map[string]int64, worker string) store.Placement {
	return store.Placement{WorkerID: worker, Rev: revs[worker]}
}

// maxPlacementRetries bounds the re-reads of one placement whose worker
// took another placement meanwhile.
const maxPlacementRetries = 32

// liveWorker returns the worker's node URL when it is registered now.
func (s *Server) liveWorker(ctx context.Context, id string) (string, bool) {
	w, err := s.st.GetWorker(ctx, id)
	if err != nil || w.NodeURL == "" {
		return "", false
	}
	return w.NodeURL, true
}

// nodeURL is the worker's registered node-api URL, or the one recorded at
// install when the worker is not registered now.
func (s *Server) nodeURL(ctx context.Context, rec store.SandboxRecord) string {
	if w, err := s.st.GetWorker(ctx, rec.Route.WorkerID); err == nil && w.NodeURL != "" {
		return w.NodeURL
	}
	return rec.NodeURL
}

func limitsOf(rec store.SandboxRecord) spacev1.Limits {
	return spacev1.Limits{MemoryBytes: int64(rec.MemoryMB) << 20, CPUMillis: int64(rec.CPUCount) * 1000, DiskBytes: int64(rec.DiskSizeMB) << 20}
}
