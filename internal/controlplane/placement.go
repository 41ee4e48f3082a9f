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
// sandboxes: placedOn), which may be ahead of the report. It also returns,
// per worker, the revision its load was read at: a placement on a worker
// commits only with the guard placementOf builds from it (the worker's
// placement key has not moved after that revision), so two decisions
// made from the same load (concurrent creates, on one control plane or on
// two) cannot both commit (store.Placement).
//
// Workers and placements come from the watched view (placements.go) once
// it is in; exact reads them from the store instead (every worker entry
// and every sandbox record read and decoded, at one revision).
func (s *Server) workersWithLoad(ctx context.Context, substrate string, exact bool) ([]spacev1.Worker, map[string]int64, error) {
	ws, revs, _, err := s.workersWithLoadFrom(ctx, substrate, exact)
	return ws, revs, err
}

// pick places one sandbox of substrate, not on a worker in exclude: the
// scheduler's pick among the watched view, or, when that view has no
// room for it (not delivered yet, or behind a worker that just
// registered) or exact is set, among the workers and records read from
// the store now. It returns the placement guard for the worker picked. A
// failed pick wraps scheduler.ErrNoCapacity.
func (s *Server) pick(ctx context.Context, substrate string, exclude []string, exact bool) (spacev1.Worker, store.Placement, error) {
	ws, revs, viewed, err := s.workersWithLoadFrom(ctx, substrate, exact)
	if err == nil {
		w, perr := s.sched.Pick(ws, exclude...)
		if perr == nil || !viewed {
			return w, placementOf(revs, w.ID), perr
		}
	}
	if !viewed {
		return spacev1.Worker{}, store.Placement{}, err
	}
	if ws, revs, err = s.workersWithLoad(ctx, substrate, true); err != nil {
		return spacev1.Worker{}, store.Placement{}, err
	}
	w, err := s.sched.Pick(ws, exclude...)
	return w, placementOf(revs, w.ID), err
}

// workersWithLoadFrom is workersWithLoad, also saying whether the answer
// came from the watched view.
func (s *Server) workersWithLoadFrom(ctx context.Context, substrate string, exact bool) (_ []spacev1.Worker, _ map[string]int64, viewed bool, _ error) {
	type listed struct {
		n    map[string]int
		revs map[string]int64
		err  error
	}
	var sbxs chan listed
	cached, viewRev, ok := s.placed.counts()
	all, wok := s.placed.registered()
	viewed = !exact && ok && wok
	if !viewed {
		// The two reads are independent: the sandbox records are read
		// while the workers are.
		sbxs = make(chan listed, 1)
		go func() {
			entries, revs, err := s.st.PlacementView(ctx)
			n := map[string]int{}
			for _, e := range entries {
				p := placedOn(e.Record)
				for _, w := range []string{p.route, p.pending} {
					if w != "" {
						n[w]++
					}
				}
			}
			sbxs <- listed{n, revs, err}
		}()
		var err error
		if all, err = s.st.ListWorkers(ctx); err != nil {
			<-sbxs
			return nil, nil, false, fmt.Errorf("%w: worker registry: %v", errdefs.ErrUnavailable, err)
		}
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
		if sbxs != nil {
			<-sbxs
		}
		if len(why) > 0 {
			return nil, nil, viewed, fmt.Errorf("%w: no registered worker runs the %s substrate (%s)", errdefs.ErrUnavailable, substrate, strings.Join(why, "; "))
		}
		return nil, nil, viewed, fmt.Errorf("%w: no registered worker runs the %s substrate", errdefs.ErrUnavailable, substrate)
	}
	placed, revs := cached, map[string]int64{}
	if sbxs != nil {
		l := <-sbxs
		if l.err != nil {
			return nil, nil, false, fmt.Errorf("%w: sandbox records: %v", errdefs.ErrUnavailable, l.err)
		}
		placed, revs = l.n, l.revs
	} else {
		// The view counts every placement up to viewRev: a worker's
		// guard is that revision.
		for _, w := range ws {
			revs[w.ID] = viewRev
		}
	}
	for i := range ws {
		ws[i].Load = max(ws[i].Load, placed[ws[i].ID])
	}
	return ws, revs, viewed, nil
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
