// Package nodeapi is node-api, the HTTP entry point of one worker. It serves
// the control plane's install, teardown, pause, resume, snapshot, retire
// and metrics calls (each carrying a control capability bound to this
// worker and to exactly the route in its body) and hands every other
// request to sbx-manager, which admits it before forwarding.
package nodeapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/sbxmanager"
)

// MaxControlBody bounds install and teardown request bodies.
const MaxControlBody = 1 << 20

// Config configures a node-api server.
type Config struct {
	// Addr is the listen address, e.g. 127.0.0.1:0.
	Addr string
	// WorkerID must match the manager's.
	WorkerID string
	// Gatherer serves /metrics (nil: prometheus.DefaultGatherer).
	Gatherer prometheus.Gatherer
	// Registerer receives node-api's own series (control-call durations,
	// installs); nil: not registered.
	Registerer prometheus.Registerer
	// Logger receives the server's logs (default slog.Default()).
	Logger *slog.Logger
}

// withDefaults returns c with its unset fields set to the documented
// defaults.
func (c Config) withDefaults() Config {
	if c.Gatherer == nil {
		c.Gatherer = prometheus.DefaultGatherer
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate checks c; fields left zero take their defaults in New.
func (c Config) Validate() error {
	if c.Addr == "" || c.WorkerID == "" {
		return fmt.Errorf("nodeapi: %w: addr and worker id are required", errdefs.ErrInvalid)
	}
	return nil
}

// Server is a worker's node-api.
type Server struct {
	cfg Config
	mgr *sbxmanager.Manager
	ver *capability.Verifier
	ln  net.Listener
	srv *http.Server
	obs *obs
}

// New listens on cfg.Addr; Run serves.
func New(cfg Config, mgr *sbxmanager.Manager, ver *capability.Verifier) (*Server, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if mgr == nil || ver == nil {
		return nil, fmt.Errorf("nodeapi: %w: manager and verifier are required", errdefs.ErrInvalid)
	}
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("nodeapi: listen: %w", err)
	}
	s := &Server{cfg: cfg, mgr: mgr, ver: ver, ln: ln, obs: newObs(cfg.Registerer)}
	s.srv = &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 30 * time.Second}
	return s, nil
}

// URL is the base URL the control plane and edge use to reach this node.
func (s *Server) URL() string { return "http://" + s.ln.Addr().String() }

// Handler routes control paths, health and metrics, and the data plane.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+spacev1.NodePathInstall, s.install())
	mux.HandleFunc("POST "+spacev1.NodePathTeardown, s.teardown())
	mux.HandleFunc("POST "+spacev1.NodePathPause, s.lifecycle(s.mgr.Pause))
	mux.HandleFunc("POST "+spacev1.NodePathResume, s.lifecycle(s.mgr.Resume))
	mux.HandleFunc("POST "+spacev1.NodePathRetire, s.lifecycle(s.mgr.Retire))
	mux.HandleFunc("POST "+spacev1.NodePathSnapshot, s.snapshot())
	mux.HandleFunc("POST "+spacev1.NodePathMetrics, s.metrics())
	mux.HandleFunc("POST "+spacev1.NodePathMetricsRange, s.metricsRange())
	mux.HandleFunc("POST "+spacev1.NodePathNetwork, s.network())
	mux.HandleFunc("POST "+spacev1.NodePathAgentLog, s.agentLog()) // events: sandbox logs (agentlog.go)
	mux.HandleFunc("GET "+spacev1.NodePathHealth, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"worker":%q,"active":%d}`, s.cfg.WorkerID, s.mgr.Active())
	})
	mux.Handle("GET /space/node/v1/metrics", promhttp.HandlerFor(s.cfg.Gatherer, promhttp.HandlerOpts{}))
	mux.Handle("/", s.mgr)
	return s.traced(s.unlessFenced(mux))
}

// unlessFenced refuses the control plane's calls about executions while
// the worker is fenced (sbxmanager.Manager.Fence): 503 Unavailable, so no
// lifecycle operation runs on a worker whose lease may have lapsed. Retire
// still runs (it only narrows what is served); health, metrics and the
// data plane (which sbx-manager refuses by itself) pass.
func (s *Server) unlessFenced(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, spacev1.NodePathInstall) && r.URL.Path != spacev1.NodePathRetire {
			if err := s.mgr.FencedError(); err != nil {
				WriteError(w, err)
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

// Run serves until ctx ends, then shuts down within a bounded time.
func (s *Server) Run(ctx context.Context) error {
	errc := make(chan error, 1)
	go func() { errc <- s.srv.Serve(s.ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.srv.Shutdown(sctx); err != nil {
		s.srv.Close()
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Close stops serving at once.
func (s *Server) Close() error { return s.srv.Close() }

// AuthorizeControl checks a control-plane call's capability: verified by
// ver (signed by a key of the bundle it trusts), purpose control, for
// worker and exactly route (the one the body names). Every refusal is an
// errdefs.ErrDenied. It is what node-api runs before any control call; a
// simulated worker (internal/fleetsim) runs the same.
func AuthorizeControl(ver *capability.Verifier, worker string, r *http.Request, route identity.Route) error {
	c, err := ver.Verify(r.Header.Get(spacev1.HeaderCapability), capability.PurposeControl)
	if err != nil {
		return fmt.Errorf("%w: control capability: %v", errdefs.ErrDenied, err)
	}
	if c.WorkerID != worker {
		return fmt.Errorf("%w: control capability is for worker %q", errdefs.ErrDenied, c.WorkerID)
	}
	if c.Route != route {
		return fmt.Errorf("%w: control capability names another execution", errdefs.ErrDenied)
	}
	return nil
}

// WriteError writes err as SPACE's JSON error body with the status of its
// class (errdefs.HTTPStatus). It is the one place on a worker that maps
// error classes to HTTP statuses: the control calls here answer through
// it, and sbx-manager gets it (sbxmanager.Deps.WriteError) for the
// requests it refuses. node-api is internal: the body carries the error's
// full text.
func WriteError(w http.ResponseWriter, err error) {
	status := errdefs.HTTPStatus(err)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(spacev1.Error{Code: status, Message: err.Error(), Reason: errdefs.Reason(err)})
}

func decode(r *http.Request, v any) error {
	dec := json.NewDecoder(io.LimitReader(r.Body, MaxControlBody+1))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("%w: malformed request body: %v", errdefs.ErrInvalid, err)
	}
	return nil
}

// control serves one control-plane call on this worker (ControlHandler,
// observed by node-api's series).
func control[T any](s *Server, route func(*T) identity.Route, do func(context.Context, *T) (any, error)) http.HandlerFunc {
	return ControlHandler(s.ver, s.cfg.WorkerID, route, do, s.obs.controlDone)
}

// ControlHandler serves one control-plane call the way node-api does:
// decode the body (a T; unknown fields and bodies over MaxControlBody are
// refused), authorize the control capability for worker and exactly the
// route the body names (AuthorizeControl), run do. A nil result is
// answered 204 No Content, anything else as JSON; errors through
// WriteError. done, when set, is told how each call that got to do went.
func ControlHandler[T any](ver *capability.Verifier, worker string, route func(*T) identity.Route,
	do func(context.Context, *T) (any, error), done func(r *http.Request, start time.Time, err error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req T
		if err := decode(r, &req); err != nil {
			WriteError(w, err)
			return
		}
		if err := AuthorizeControl(ver, worker, r, route(&req)); err != nil {
			WriteError(w, err)
			return
		}
		start := time.Now()
		resp, err := do(r.Context(), &req)
		if done != nil {
			done(r, start, err)
		}
		if err != nil {
			WriteError(w, err)
			return
		}
		if resp == nil {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(resp)
	}
}

// install answers once the record is durable and the guest serves.
func (s *Server) install() http.HandlerFunc {
	return control(s, func(q *spacev1.InstallRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.InstallRequest) (any, error) { return s.mgr.Install(ctx, *q) })
}

func (s *Server) teardown() http.HandlerFunc {
	return control(s, func(q *spacev1.TeardownRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.TeardownRequest) (any, error) {
			return nil, s.mgr.Teardown(ctx, q.Route)
		})
}

// lifecycle serves pause, resume and retire (all idempotent).
func (s *Server) lifecycle(op func(context.Context, identity.Route) error) http.HandlerFunc {
	return control(s, func(q *spacev1.LifecycleRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.LifecycleRequest) (any, error) { return nil, op(ctx, q.Route) })
}

// snapshot answers once the archive is durable in the snapshot store.
func (s *Server) snapshot() http.HandlerFunc {
	return control(s, func(q *spacev1.SnapshotRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.SnapshotRequest) (any, error) {
			return s.mgr.Snapshot(ctx, q.Route, q.SnapshotID)
		})
}

// metrics answers one sample of the execution's resource usage.
func (s *Server) network() http.HandlerFunc {
	return control(s, func(q *spacev1.NetworkRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.NetworkRequest) (any, error) {
			return nil, s.mgr.SetNetwork(ctx, q.Route, q.Network)
		})
}

// metricsRange answers the samples the worker kept of the execution.
func (s *Server) metricsRange() http.HandlerFunc {
	return control(s, func(q *spacev1.MetricsRangeRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.MetricsRangeRequest) (any, error) {
			samples, err := s.mgr.MetricsRange(ctx, q.Route, q.Start, q.End)
			if q.Last > 0 && len(samples) > q.Last {
				samples = samples[len(samples)-q.Last:]
			}
			return spacev1.MetricsRangeResponse{Samples: samples}, err
		})
}

func (s *Server) metrics() http.HandlerFunc {
	return control(s, func(q *spacev1.LifecycleRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.LifecycleRequest) (any, error) {
			return s.mgr.Metrics(ctx, q.Route)
		})
}
