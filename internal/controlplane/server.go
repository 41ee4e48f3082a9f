package controlplane

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/events"
	"github.com/spacesbx/space/internal/scheduler"
	"github.com/spacesbx/space/internal/snapshot"
	"github.com/spacesbx/space/internal/store"
)

// Server is space-api. Create it with New, serve it with Run (or mount
// Handler), stop it with Close.
type Server struct {
	// reapNow asks the reaper for a pass before its next tick (a lost
	// execution was reported).
	reapNow chan struct{}
	cfg     Config
	st      *store.Store
	log     *slog.Logger
	now     func() time.Time
	signer  *rotatingSigner
	node    *nodeClient
	sched   *scheduler.Scheduler
	snaps   snapshot.Store // nil: snapshot archives are not removed here
	// volumes serves the volume content API (nil: 503).
	volumes VolumeFiles

	apiKey          string
	apiKeyGenerated bool
	bundle          capability.Bundle

	handler http.Handler
	// obs: spans and series of the API (observe.go).
	obs *observability

	ctx       context.Context
	cancel    context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once

	reapMu  sync.Mutex
	reaping map[string]bool
	// workerLoss: workers found unregistered (workerloss.go).
	workerLoss workerLoss
	// leading is true while this replica leads the control-plane
	// election and runs the singletons (leader.go).
	leading atomic.Bool

	// instance names this control plane's lifecycle operations
	// (LifecycleOp.Owner); reg keeps it registered while it runs, so an
	// operation whose owner died is released at once (reaper.go).
	instance string
	reg      *store.Registration

	tb *templateBuilds
	// warm holds the warm snapshots of platform templates (platformtemplate.go).
	warm warmTemplates

	// Metrics over time and autoResume (teammetrics.go, autoresume.go).
	teamMetrics *teamMetrics
	resumes     autoResumes

	// authLog bounds the failed-authentication log lines (auth.go).
	authLog logLimiter

	// events records lifecycle events and delivers webhooks (events.go).
	events *events.Service

	// placed counts the sandboxes per worker for placement, from a watch
	// of the records (placements.go).
	placed *placements
}

// instanceTTL is how long a dead control plane's registration outlives it:
// its operations in flight are released that long after it died.
const instanceTTL = 5 * time.Second

// New loads the replicas' shared signing key from the store (storing one
// first when it has none), publishes its verification key in the store's
// bundle, stores the bootstrap API key's hash and campaigns for the
// control-plane leadership (leader.go). It does not listen: call Run, or serve Handler yourself.
func New(cfg Config, deps Deps) (*Server, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if deps.Store == nil {
		return nil, fmt.Errorf("controlplane: store required")
	}
	deps = deps.withDefaults()
	s := &Server{cfg: cfg, st: deps.Store, log: deps.Logger.With("component", "space-api"), now: deps.Clock,
		sched: scheduler.New(scheduler.DefaultK, nil), snaps: deps.Snapshots, volumes: deps.Volumes, reaping: map[string]bool{},
		placed: newPlacements()}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sk, err := loadSigningKey(ctx, s.st, cfg.DataDir, s.now())
	if err != nil {
		return nil, fmt.Errorf("controlplane: %w", err)
	}
	sg, err := capability.NewSigner(sk.kid, sk.priv)
	if err != nil {
		return nil, fmt.Errorf("controlplane: %w", err)
	}
	s.signer = newRotatingSigner(sg)
	s.node = &nodeClient{http: tracedClient(deps.HTTPClient), signer: s.signer, now: s.now, installTimeout: cfg.InstallTimeout, callTimeout: cfg.NodeTimeout}
	if s.bundle, err = s.publishStartKey(ctx, sk); err != nil {
		return nil, fmt.Errorf("controlplane: publish verification key: %w", err)
	}
	s.log.Info("signing key ready", "kid", sk.kid, "origin", sk.origin, "bundle_revision", s.bundle.Revision)

	s.apiKey = cfg.BootstrapAPIKey
	if s.apiKey == "" {
		s.apiKey, s.apiKeyGenerated = newAPIKey(), true
	}
	h := store.HashAPIKey(s.apiKey)
	if err := s.st.PutAPIKey(ctx, h, store.APIKeyRecord{
		TeamID: cfg.BootstrapTeamID, KeyID: keyIDOfHash(h), Role: store.RoleAdmin, Name: "bootstrap", CreatedAt: s.now().UTC(),
		Mask: maskOf(s.apiKey, apiKeyPrefix),
	}); err != nil {
		return nil, fmt.Errorf("controlplane: store bootstrap api key: %w", err)
	}
	if err := s.bootstrapTeam(ctx); err != nil {
		return nil, fmt.Errorf("controlplane: bootstrap team: %w", err)
	}
	// Upload links are signed by one replica and used against any.
	fresh := make([]byte, 32)
	rand.Read(fresh)
	uploadKey, _, err := s.st.InitClusterKey(ctx, uploadKeyName, fresh)
	if err != nil {
		return nil, fmt.Errorf("controlplane: template upload key: %w", err)
	}

	s.instance = "cp-" + randHex(8)
	if s.reg, err = s.st.RegisterControlPlane(ctx, s.instance, instanceTTL); err != nil {
		return nil, fmt.Errorf("controlplane: %w", err)
	}
	s.tb = newTemplateBuilds(cfg, uploadKey)
	if err := s.startEvents(); err != nil {
		_ = s.reg.Close()
		return nil, err
	}
	s.obs = newObservability()
	s.handler = s.observe(s.routes())
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.reapNow = make(chan struct{}, 1)
	s.startTeamMetrics()
	s.wg.Add(4)
	go s.runLeader()
	go s.watchSigningKey()
	// The placement view: every replica's creates read it.
	go func() {
		defer s.wg.Done()
		_ = s.st.WatchSandboxes(s.ctx, s.placed.apply)
	}()
	go func() {
		defer s.wg.Done()
		_ = s.st.WatchWorkers(s.ctx, s.placed.setWorkers)
	}()
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
	var err error
	s.closeOnce.Do(func() {
		s.cancel()
		s.wg.Wait()
		_ = s.events.Close()
		err = s.reg.Close()
	})
	return err
}
