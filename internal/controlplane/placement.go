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
// sandboxes: placedOn), which may be ahead of the report. Workers and
// placements come from the watched view (placements.go) once it is in;
// exact reads them from the store instead (every worker entry and every
// sandbox record read and decoded).
func (s *Server) workersWithLoad(ctx context.Context, substrate string, exact bool) ([]spacev1.Worker, error) {
	ws, _, err := s.workersWithLoadFrom(ctx, substrate, exact)
	return ws, err
}

// pick places one sandbox of substrate, not on a worker in exclude: the
// scheduler's pick among the watched view, or, when that view has no
// room for it (not delivered yet, or behind a worker that just
// registered), among the workers and records read from the store now. A
// failed pick wraps scheduler.ErrNoCapacity.
func (s *Server) pick(ctx context.Context, substrate string, exclude []string) (spacev1.Worker, error) {
	ws, viewed, err := s.workersWithLoadFrom(ctx, substrate, false)
	if err == nil {
		w, perr := s.sched.Pick(ws, exclude...)
		if perr == nil || !viewed {
			return w, perr
		}
	}
	if !viewed {
		return spacev1.Worker{}, err
	}
	if ws, err = s.workersWithLoad(ctx, substrate, true); err != nil {
		return spacev1.Worker{}, err
	}
	return s.sched.Pick(ws, exclude...)
}

// workersWithLoadFrom is workersWithLoad, also saying whether the answer
// came from the watched view.
func (s *Server) workersWithLoadFrom(ctx context.Context, substrate string, exact bool) (_ []spacev1.Worker, viewed bool, _ error) {
	var placedCh chan placedCount
	cached, ok := s.placed.counts()
	all, wok := s.placed.registered()
	viewed = !exact && ok && wok
	if !viewed {
		// The two reads are independent: the sandbox records are read
		// while the workers are.
		placedCh = make(chan placedCount, 1)
		go func() { placedCh <- s.listPlaced(ctx) }()
		var err error
		if all, err = s.st.ListWorkers(ctx); err != nil {
			return nil, false, fmt.Errorf("%w: worker registry: %v", errdefs.ErrUnavailable, err)
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
		if len(why) > 0 {
			return nil, viewed, fmt.Errorf("%w: no registered worker runs the %s substrate (%s)", errdefs.ErrUnavailable, substrate, strings.Join(why, "; "))
		}
		return nil, viewed, fmt.Errorf("%w: no registered worker runs the %s substrate", errdefs.ErrUnavailable, substrate)
	}
	placed := cached
	if placedCh != nil {
		l := <-placedCh
		if l.err != nil {
			return nil, false, fmt.Errorf("%w: sandbox records: %v", errdefs.ErrUnavailable, l.err)
		}
		placed = l.n
	}
	for i := range ws {
		ws[i].Load = max(ws[i].Load, placed[ws[i].ID])
	}
	return ws, viewed, nil
}

// placedCount is the per-worker placements listed from the records.
type placedCount struct {
	n   map[string]int
	err error
}

// listPlaced counts the placements per worker from every sandbox record.
func (s *Server) listPlaced(ctx context.Context) placedCount {
	entries, err := s.st.ListSandboxes(ctx)
	if err != nil {
		return placedCount{err: err}
	}
	n := map[string]int{}
	for _, e := range entries {
		p := placedOn(e.Record)
		for _, w := range []string{p.route, p.pending} {
			if w != "" {
				n[w]++
			}
		}
	}
	return placedCount{n: n}
}

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
