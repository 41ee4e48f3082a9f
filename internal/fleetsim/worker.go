package fleetsim

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/nodeapi"
	"github.com/spacesbx/space/internal/store"
)

// Worker is one simulated worker.
type Worker struct {
	f   *Fleet
	id  string
	ver *capability.Verifier
	ln  net.Listener
	srv *http.Server

	mu    sync.Mutex
	execs map[string]*execution // by sandbox id
	// stopRun ends run (Remove); stopped is closed when run has returned.
	stopRun context.CancelFunc
	stopped chan struct{}
	started bool

	installs, teardowns, denied, calls atomic.Int64
}

// execution is what the worker holds of one sandbox.
type execution struct {
	route   identity.Route
	paused  bool
	retired bool
}

// Stats are a worker's counters.
type Stats struct {
	ID string
	// Active executions installed now (not retired).
	Active int
	// Installs and Teardowns that succeeded; Denied control calls refused
	// for their capability (403); Calls is every control call answered.
	Installs, Teardowns, Denied, Calls int64
}

func newWorker(f *Fleet, id string) (*Worker, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(f.cfg.Host, "0"))
	if err != nil {
		return nil, fmt.Errorf("fleetsim: worker %s: listen: %w", id, err)
	}
	// An empty bundle trusts no key: until one arrives every capability
	// is denied, as on a real worker.
	ver, _ := capability.NewVerifier(capability.Bundle{Revision: -1})
	w := &Worker{f: f, id: id, ver: ver, ln: ln, execs: map[string]*execution{}, stopped: make(chan struct{})}
	w.srv = &http.Server{Handler: w.handler(), ReadHeaderTimeout: 10 * time.Second}
	return w, nil
}

// ID is the worker's id.
func (w *Worker) ID() string { return w.id }

// URL is the worker's node-api base URL.
func (w *Worker) URL() string { return "http://" + w.ln.Addr().String() }

// Verifier is the worker's capability verifier (its watched bundle).
func (w *Worker) Verifier() *capability.Verifier { return w.ver }

// Stats returns the worker's counters.
func (w *Worker) Stats() Stats {
	return Stats{ID: w.id, Active: w.active(), Installs: w.installs.Load(), Teardowns: w.teardowns.Load(),
		Denied: w.denied.Load(), Calls: w.calls.Load()}
}

func (w *Worker) active() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, e := range w.execs {
		if !e.retired {
			n++
		}
	}
	return n
}

func (w *Worker) entry(load int) spacev1.Worker {
	cfg := w.f.cfg
	return spacev1.Worker{ID: w.id, NodeURL: w.URL(), State: "ready", Capacity: cfg.Capacity, Load: load,
		Substrates: slices.Clone(cfg.Substrates)}
}

// run serves until ctx ends or the worker is removed.
func (w *Worker) run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	w.mu.Lock()
	w.started, w.stopRun = true, cancel
	w.mu.Unlock()
	defer close(w.stopped)
	log := w.f.log.With("worker", w.id)

	first := make(chan struct{})
	var once sync.Once
	var wg sync.WaitGroup
	// Last: stop serving, end the watch, wait for both.
	defer func() {
		cancel()
		sctx, c := context.WithTimeout(context.Background(), 5*time.Second)
		defer c()
		if w.srv.Shutdown(sctx) != nil {
			w.srv.Close()
		}
		wg.Wait()
	}()
	wg.Go(func() {
		err := w.f.st.WatchBundle(ctx, func(b capability.Bundle) {
			if err := w.ver.SetBundle(b); err != nil {
				log.Error("key bundle rejected", "revision", b.Revision, "err", err)
				return
			}
			once.Do(func() { close(first) })
		})
		if err != nil && ctx.Err() == nil {
			log.Error("key bundle watch ended", "err", err)
		}
	})
	serveErr := make(chan error, 1)
	wg.Go(func() { serveErr <- w.srv.Serve(w.ln) })

	select {
	case <-first:
	case <-time.After(w.f.cfg.BundleWait):
		return fmt.Errorf("fleetsim: worker %s: %w: no key bundle after %s", w.id, errdefs.ErrUnavailable, w.f.cfg.BundleWait)
	case err := <-serveErr:
		return fmt.Errorf("fleetsim: worker %s: serve: %w", w.id, err)
	case <-ctx.Done():
		return nil
	}
	reg, err := w.f.st.RegisterWorker(ctx, w.entry(0), w.f.cfg.LeaseTTL)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("fleetsim: worker %s: register: %w", w.id, err)
	}
	defer func() {
		if err := reg.Close(); err != nil {
			log.Warn("deregister", "err", err)
		}
	}()
	w.f.registered()
	w.reportLoad(ctx, reg)
	return nil
}

// reportLoad updates the registration with the worker's load every
// LoadInterval when it changed, until ctx ends.
func (w *Worker) reportLoad(ctx context.Context, reg *store.Registration) {
	if w.f.cfg.LoadInterval < 0 {
		<-ctx.Done()
		return
	}
	t := time.NewTicker(w.f.cfg.LoadInterval)
	defer t.Stop()
	last := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if n := w.active(); n != last {
			if err := reg.Update(ctx, w.entry(n)); err != nil {
				if ctx.Err() == nil {
					w.f.log.Warn("load report", "worker", w.id, "err", err)
				}
				continue
			}
			last = n
		}
	}
}

// stop ends run (deregistering and stopping node-api) and waits for it.
func (w *Worker) stop(ctx context.Context) error {
	w.mu.Lock()
	started, cancel := w.started, w.stopRun
	w.mu.Unlock()
	if !started {
		return fmt.Errorf("fleetsim: worker %s: %w: not running", w.id, errdefs.ErrConflict)
	}
	cancel()
	select {
	case <-w.stopped:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// handler serves the control calls through node-api's own decoding and
// capability check; every other path is the data plane, which a simulated
// worker does not have.
func (w *Worker) handler() http.Handler {
	mux := http.NewServeMux()
	id := w.id
	ctl := func(path string, h http.HandlerFunc) { mux.Handle("POST "+path, w.count(h)) }
	ctl(spacev1.NodePathInstall, nodeapi.ControlHandler(w.ver, id, func(q *spacev1.InstallRequest) identity.Route { return q.Route }, w.install, nil))
	ctl(spacev1.NodePathTeardown, nodeapi.ControlHandler(w.ver, id, func(q *spacev1.TeardownRequest) identity.Route { return q.Route }, w.teardown, nil))
	for path, op := range map[string]func(*execution){
		spacev1.NodePathPause:  func(e *execution) { e.paused = true },
		spacev1.NodePathResume: func(e *execution) { e.paused = false },
		spacev1.NodePathRetire: func(e *execution) { e.retired = true },
	} {
		ctl(path, nodeapi.ControlHandler(w.ver, id, func(q *spacev1.LifecycleRequest) identity.Route { return q.Route },
			func(ctx context.Context, q *spacev1.LifecycleRequest) (any, error) {
				return nil, w.with(ctx, q.Route, path == spacev1.NodePathRetire, op)
			}, nil))
	}
	ctl(spacev1.NodePathSnapshot, nodeapi.ControlHandler(w.ver, id, func(q *spacev1.SnapshotRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.SnapshotRequest) (any, error) {
			if err := w.with(ctx, q.Route, false, func(*execution) {}); err != nil {
				return nil, err
			}
			return spacev1.SnapshotResponse{SnapshotID: q.SnapshotID, SizeBytes: 4096}, nil
		}, nil))
	ctl(spacev1.NodePathNetwork, nodeapi.ControlHandler(w.ver, id, func(q *spacev1.NetworkRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.NetworkRequest) (any, error) {
			return nil, w.with(ctx, q.Route, false, func(*execution) {})
		}, nil))
	ctl(spacev1.NodePathMetrics, nodeapi.ControlHandler(w.ver, id, func(q *spacev1.LifecycleRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.LifecycleRequest) (any, error) {
			if err := w.with(ctx, q.Route, false, func(*execution) {}); err != nil {
				return nil, err
			}
			return sample(time.Now()), nil
		}, nil))
	ctl(spacev1.NodePathMetricsRange, nodeapi.ControlHandler(w.ver, id, func(q *spacev1.MetricsRangeRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.MetricsRangeRequest) (any, error) {
			if err := w.with(ctx, q.Route, false, func(*execution) {}); err != nil {
				return nil, err
			}
			return spacev1.MetricsRangeResponse{Samples: []spacev1.MetricsResponse{sample(time.Now())}}, nil
		}, nil))
	ctl(spacev1.NodePathAgentLog, nodeapi.ControlHandler(w.ver, id, func(q *spacev1.LifecycleRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.LifecycleRequest) (any, error) {
			if err := w.with(ctx, q.Route, false, func(*execution) {}); err != nil {
				return nil, err
			}
			return spacev1.AgentLogResponse{Generation: q.Route.Generation}, nil
		}, nil))
	mux.HandleFunc("GET "+spacev1.NodePathHealth, func(rw http.ResponseWriter, r *http.Request) {
		rw.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(rw, `{"worker":%q,"active":%d}`, id, w.active())
	})
	mux.HandleFunc("/", func(rw http.ResponseWriter, r *http.Request) {
		nodeapi.WriteError(rw, fmt.Errorf("%w: simulated worker %s has no data plane", errdefs.ErrNotFound, id))
	})
	return mux
}

// sample is one plausible resource sample.
func sample(now time.Time) spacev1.MetricsResponse {
	return spacev1.MetricsResponse{Timestamp: now.UTC(), CPUCount: 2, CPUUsedPct: 1.5, MemUsed: 24 << 20, MemTotal: 512 << 20,
		DiskUsed: 1 << 20, DiskTotal: 4 << 30}
}

// count counts control calls and those refused for their capability.
func (w *Worker) count(h http.Handler) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		sw := &statusWriter{ResponseWriter: rw}
		h.ServeHTTP(sw, r)
		w.calls.Add(1)
		if sw.code == http.StatusForbidden {
			w.denied.Add(1)
		}
	})
}

type statusWriter struct {
	http.ResponseWriter
	code int
}

func (s *statusWriter) WriteHeader(code int) {
	if s.code == 0 {
		s.code = code
	}
	s.ResponseWriter.WriteHeader(code)
}

// delay waits d or until ctx ends.
func delay(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("%w: %v", errdefs.ErrUnavailable, ctx.Err())
	}
}

// install checks the route as sbx-manager does (valid, this worker, a
// substrate served here, not older than what is installed; the same route
// again is an idempotent retry) and records it.
func (w *Worker) install(ctx context.Context, q *spacev1.InstallRequest) (any, error) {
	r := q.Route
	if err := r.Validate(); err != nil {
		return nil, fmt.Errorf("install: %w: %v", errdefs.ErrInvalid, err)
	}
	if r.WorkerID != w.id {
		return nil, fmt.Errorf("install: %w: route names worker %q, this is %q", errdefs.ErrInvalid, r.WorkerID, w.id)
	}
	if !slices.Contains(w.f.cfg.Substrates, r.Substrate) {
		return nil, fmt.Errorf("install: %w: substrate %q not served on worker %s", errdefs.ErrInvalid, r.Substrate, w.id)
	}
	if err := delay(ctx, w.f.cfg.InstallDelay); err != nil {
		return nil, fmt.Errorf("install: %w", err)
	}
	resp := spacev1.InstallResponse{Route: r, EnvdVersion: w.f.cfg.EnvdVersion}
	w.mu.Lock()
	defer w.mu.Unlock()
	if old, ok := w.execs[r.SandboxID]; ok {
		if old.route == r && !old.retired {
			return resp, nil
		}
		if old.route.Generation > r.Generation {
			return nil, fmt.Errorf("install: %w: generation %d is older than installed %d", errdefs.ErrConflict, r.Generation, old.route.Generation)
		}
		if old.route == r {
			return nil, fmt.Errorf("install: %w: execution %s is retired", errdefs.ErrConflict, r.ExecutionID)
		}
	}
	w.execs[r.SandboxID] = &execution{route: r}
	w.installs.Add(1)
	return resp, nil
}

// teardown removes the execution: 404 when none is installed, 409 when
// another one is.
func (w *Worker) teardown(ctx context.Context, q *spacev1.TeardownRequest) (any, error) {
	if err := delay(ctx, w.f.cfg.CallDelay); err != nil {
		return nil, fmt.Errorf("teardown: %w", err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	e, ok := w.execs[q.Route.SandboxID]
	if !ok {
		return nil, fmt.Errorf("teardown %s: %w", q.Route.SandboxID, errdefs.ErrNotFound)
	}
	if e.route.Epoch() != q.Route.Epoch() {
		return nil, fmt.Errorf("teardown %s: %w: installed execution is %s", q.Route.SandboxID, errdefs.ErrConflict, e.route)
	}
	delete(w.execs, q.Route.SandboxID)
	w.teardowns.Add(1)
	return nil, nil
}

// with applies op to the installed execution of route: 404 when none is
// (or, unless retiring, it is retired), 409 when another one is.
func (w *Worker) with(ctx context.Context, route identity.Route, retiring bool, op func(*execution)) error {
	if err := delay(ctx, w.f.cfg.CallDelay); err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	e, ok := w.execs[route.SandboxID]
	if !ok || (e.retired && !retiring) {
		return fmt.Errorf("execution of %s: %w", route.SandboxID, errdefs.ErrNotFound)
	}
	if e.route.Epoch() != route.Epoch() {
		return fmt.Errorf("execution of %s: %w: installed execution is %s", route.SandboxID, errdefs.ErrConflict, e.route)
	}
	op(e)
	return nil
}
