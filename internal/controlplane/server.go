package controlplane

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/scheduler"
	"github.com/spacesbx/space/internal/snapshot"
	"github.com/spacesbx/space/internal/store"
)

// Server is space-api. Create it with New, serve it with Run (or mount
// Handler), stop it with Close.
type Server struct {
	cfg    Config
	st     *store.Store
	http   *http.Client
	log    *slog.Logger
	now    func() time.Time
	signer *rotatingSigner
	sched  *scheduler.Scheduler
	snaps  snapshot.Store // nil: snapshot archives are not removed here

	apiKey          string
	apiKeyGenerated bool
	bundle          capability.Bundle

	handler http.Handler

	ctx       context.Context
	cancel    context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once

	reapMu  sync.Mutex
	reaping map[string]bool
}

// New loads (or creates) the signing key, publishes its verification key in
// the store's bundle, stores the bootstrap API key's hash and starts the
// timeout loop. It does not listen: call Run, or serve Handler yourself.
func New(cfg Config, deps Deps) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if deps.Store == nil {
		return nil, fmt.Errorf("controlplane: store required")
	}
	s := &Server{cfg: cfg, st: deps.Store, http: deps.HTTPClient, log: deps.Logger, now: deps.Clock,
		sched: scheduler.New(scheduler.DefaultK, nil), snaps: deps.Snapshots, reaping: map[string]bool{}}
	if s.http == nil {
		s.http = &http.Client{}
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	s.log = s.log.With("component", "space-api")
	if s.now == nil {
		s.now = time.Now
	}

	adopted, err := adoptPendingKey(cfg.DataDir)
	if err != nil {
		return nil, fmt.Errorf("controlplane: %w", err)
	}
	priv, created, err := loadOrCreateSigningKey(cfg.DataDir)
	if err != nil {
		return nil, fmt.Errorf("controlplane: %w", err)
	}
	pub := priv.Public().(ed25519.PublicKey)
	kid := KeyID(pub)
	sg, err := capability.NewSigner(kid, priv)
	if err != nil {
		return nil, fmt.Errorf("controlplane: %w", err)
	}
	s.signer = newRotatingSigner(sg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if s.bundle, err = s.publishStartKey(ctx, adopted, kid, pub); err != nil {
		return nil, fmt.Errorf("controlplane: publish verification key: %w", err)
	}
	s.log.Info("signing key ready", "kid", kid, "created", created, "bundle_revision", s.bundle.Revision)

	s.apiKey = cfg.BootstrapAPIKey
	if s.apiKey == "" {
		s.apiKey, s.apiKeyGenerated = newAPIKey(), true
	}
	h := store.HashAPIKey(s.apiKey)
	if err := s.st.PutAPIKey(ctx, h, store.APIKeyRecord{
		TeamID: cfg.BootstrapTeamID, KeyID: keyIDOfHash(h), Role: store.RoleAdmin, Name: "bootstrap", CreatedAt: s.now().UTC(),
	}); err != nil {
		return nil, fmt.Errorf("controlplane: store bootstrap api key: %w", err)
	}

	s.handler = s.routes()
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.reapLoop()
	return s, nil
}

// BootstrapAPIKey returns the bootstrap API key and whether New generated it
// (then print it once for the operator; never log it).
func (s *Server) BootstrapAPIKey() (key string, generated bool) { return s.apiKey, s.apiKeyGenerated }

// KeyID is the id of the signing key in use.
func (s *Server) KeyID() string { return s.signer.KeyID() }

// Handler serves the whole API.
func (s *Server) Handler() http.Handler { return s.handler }

// Run listens on Config.Addr and serves until ctx ends, then shuts the
// listener down gracefully (10 s). It does not Close the server.
func (s *Server) Run(ctx context.Context) error {
	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("controlplane: listen %s: %w", s.cfg.Addr, err)
	}
	return s.Serve(ctx, ln)
}

// Serve serves on ln until ctx ends (see Run). It closes ln.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	hs := &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       60 * time.Second,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	s.log.Info("space-api listening", "addr", ln.Addr().String())
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("controlplane: serve: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := hs.Shutdown(sctx)
	if serr := <-errc; serr != nil && !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	return err
}

// Close stops the timeout loop and waits for kills in flight. The store is
// the caller's to close afterwards.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		s.cancel()
		s.wg.Wait()
	})
	return nil
}

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", s.handleHealth)
	mux.HandleFunc("POST /sandboxes", s.withKey(func(w http.ResponseWriter, r *http.Request, c caller) { s.handleCreate(w, r, c, false) }))
	mux.HandleFunc("POST /v2/sandboxes", s.withKey(func(w http.ResponseWriter, r *http.Request, c caller) { s.handleCreate(w, r, c, true) }))
	mux.HandleFunc("GET /sandboxes", s.withKey(s.handleListV1))
	mux.HandleFunc("GET /v2/sandboxes", s.withKey(s.handleListV2))
	mux.HandleFunc("GET /sandboxes/{id}", s.withKey(s.handleGet))
	mux.HandleFunc("GET /sandboxes/{id}/metrics", s.withKey(s.handleMetrics))
	mux.HandleFunc("DELETE /sandboxes/{id}", s.withKey(s.handleKill))
	mux.HandleFunc("POST /sandboxes/{id}/timeout", s.withKey(s.handleTimeout))
	mux.HandleFunc("GET /space/v1/workers", s.handleWorkers)
	mux.HandleFunc("GET /space/v1/sandboxes/{id}/executions", s.handleExecutions)
	mux.HandleFunc("POST /space/v1/sandboxes/{id}/capabilities", s.settled(s.handleCapability))
	s.lifecycleRoutes(mux)
	s.snapshotExtraRoutes(mux)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, r, fmt.Errorf("%w: no route for %s %s", errdefs.ErrNotFound, r.Method, r.URL.Path))
	})
	return s.recoverer(mux)
}

// recoverer turns a handler panic into a 500 instead of a dropped connection.
func (s *Server) recoverer(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler {
					panic(v)
				}
				s.log.Error("handler panic", "method", r.Method, "path", r.URL.Path, "panic", fmt.Sprint(v))
				writeJSON(w, http.StatusInternalServerError, e2bapi.Error{Code: 500, Message: "internal error"})
			}
		}()
		h.ServeHTTP(w, r)
	})
}

func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := s.st.Ping(ctx); err != nil {
		s.writeError(w, r, fmt.Errorf("%w: store not answering", errdefs.ErrUnavailable))
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// caller is an authenticated API key holder.
type caller struct {
	TeamID string
	KeyID  string
	Role   string
}

func (c caller) edge() bool { return c.Role == store.RoleEdge }

// authenticate resolves an API key: the edge's service key, or a stored key.
func (s *Server) authenticate(ctx context.Context, key string) (caller, error) {
	if key == "" {
		return caller{}, fmt.Errorf("%w: missing %s header", errdefs.ErrUnauthenticated, spacev1.HeaderAPIKey)
	}
	if s.cfg.EdgeKey != "" && equalSecret(key, s.cfg.EdgeKey) {
		return caller{TeamID: "", KeyID: "edge", Role: store.RoleEdge}, nil
	}
	if len(key) > 256 {
		return caller{}, fmt.Errorf("%w: invalid API key", errdefs.ErrUnauthenticated)
	}
	h := store.HashAPIKey(key)
	rec, err := s.st.LookupAPIKey(ctx, h)
	if errors.Is(err, errdefs.ErrNotFound) {
		return caller{}, fmt.Errorf("%w: invalid API key", errdefs.ErrUnauthenticated)
	}
	if err != nil {
		return caller{}, fmt.Errorf("%w: key lookup failed: %v", errdefs.ErrUnavailable, err)
	}
	return caller{TeamID: rec.TeamID, KeyID: rec.KeyID, Role: rec.Role}, nil
}

// withKey authenticates an E2B route: a team's API key (not the edge's).
func (s *Server) withKey(h func(http.ResponseWriter, *http.Request, caller)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		c, err := s.authenticate(r.Context(), r.Header.Get(spacev1.HeaderAPIKey))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		if c.edge() {
			s.writeError(w, r, fmt.Errorf("%w: the edge service key cannot manage sandboxes", errdefs.ErrDenied))
			return
		}
		h(w, r, c)
	}
}
