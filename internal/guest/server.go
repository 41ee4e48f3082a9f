package guest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/spacesbx/space/api/envd/filesystem/filesystempbconnect"
	"github.com/spacesbx/space/api/envd/process/processpbconnect"
)

// Paths served besides the Connect services.
const (
	PathFiles    = "/files"
	PathHealth   = "/health"
	PathIdentity = "/_space/identity"
)

// keepaliveHeader is the request header the e2b SDK sets on streaming calls
// (Start, Connect, WatchDir): interval in seconds between keepalive events.
const keepaliveHeader = "Keepalive-Ping-Interval"

// Server is the guest agent. Create it with New, serve with Serve, stop with
// Close.
type Server struct {
	cfg     Config
	log     *slog.Logger
	handler http.Handler
	http    *http.Server

	// ctx is the parent of every request context and owned goroutine; it is
	// canceled by Close.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup // every goroutine the server owns

	// act is the per-activation part of the configuration; Reactivate
	// replaces it as a whole.
	act atomic.Pointer[activation]

	mu        sync.Mutex
	closed    bool
	procs     map[uint32]*proc
	drains    map[*os.File]struct{} // output drained after its stream ended (drainOrphaned)
	watchers  map[string]*pollWatcher
	nwatches  int // live WatchDir streams + pollWatchers
	closeOnce sync.Once
	closeErr  error
}

// New validates cfg and returns a server ready to Serve.
func New(cfg Config) (*Server, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("guest: invalid config: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{
		cfg:      cfg,
		log:      cfg.Logger,
		ctx:      ctx,
		cancel:   cancel,
		procs:    make(map[uint32]*proc),
		drains:   make(map[*os.File]struct{}),
		watchers: make(map[string]*pollWatcher),
	}
	s.act.Store(&activation{Identity: cfg.Identity, Env: cfg.Env, DefaultUser: cfg.DefaultUser, DefaultCwd: cfg.DefaultCwd})
	opts := []connect.HandlerOption{connect.WithReadMaxBytes(cfg.MaxMessageBytes)}
	mux := http.NewServeMux()
	mux.Handle(processpbconnect.NewProcessHandler(&processService{s}, opts...))
	mux.Handle(filesystempbconnect.NewFilesystemHandler(&filesystemService{s}, opts...))
	mux.HandleFunc("GET "+PathFiles, s.handleDownload)
	mux.HandleFunc("POST "+PathFiles, s.handleUpload)
	mux.HandleFunc("GET "+PathHealth, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Cache-Control", "no-store")
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("GET "+PathIdentity, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		_ = json.NewEncoder(w).Encode(s.Identity())
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeJSONError(w, http.StatusNotFound, "no route for "+r.Method+" "+r.URL.Path)
	})
	s.handler = reportSpans(mux)
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	s.http = &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: 30 * time.Second,
		MaxHeaderBytes:    1 << 20,
		Protocols:         &protocols,
		BaseContext:       func(net.Listener) context.Context { return s.ctx },
		ErrorLog:          slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelWarn),
	}
	if os.Getpid() == 1 {
		s.wg.Add(1)
		go func() { defer s.wg.Done(); s.reapOrphans() }()
	}
	s.applyNetwork(cfg.Network)
	return s, nil
}

// applyNetwork writes n's resolver and CA to the server's paths (see
// network.go); a failure is logged, not returned.
func (s *Server) applyNetwork(n *NetworkConfig) {
	if n == nil {
		return
	}
	c := s.cfg
	c.Network = n
	if err := applyNetworkFiles(c); err != nil {
		s.log.Error("network: resolver and CA not applied; the sandbox may have no verified way out", "err", err)
		return
	}
	s.log.Info("network: resolver and CA applied", "dns", n.DNS, "ca", n.CACert != "")
}

// activation is what an activation sets and a later one (after a VM
// restore) replaces atomically: requests read it once through s.act.
type activation struct {
	Identity    Identity
	Env         map[string]string
	DefaultUser string
	DefaultCwd  string
}

// Identity returns the identity the agent currently holds.
func (s *Server) Identity() Identity { return s.act.Load().Identity }

// Reactivate replaces the per-activation configuration (identity, env,
// default user) with cfg's, atomically: requests that start afterwards
// see only the new values, and applies cfg.Network's resolver and CA
// (when set). The other fields of cfg are ignored (limits, paths and the
// cgroup keep their first values). Processes keep running.
func (s *Server) Reactivate(cfg Config) error {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("guest: invalid config: %w", err)
	}
	old := s.act.Swap(&activation{Identity: cfg.Identity, Env: cfg.Env, DefaultUser: cfg.DefaultUser, DefaultCwd: cfg.DefaultCwd})
	s.log.Info("agent reactivated", "sandbox", cfg.Identity.Sandbox, "generation", cfg.Identity.Generation,
		"execution", cfg.Identity.Execution, "activation", cfg.Identity.Activation, "previous_activation", old.Identity.Activation)
	s.applyNetwork(cfg.Network)
	return nil
}

// Handler returns the HTTP handler of the whole API (for tests and for
// embedding). Requests served through it outside Serve are not canceled by
// Close, but processes and watchers they started are.
func (s *Server) Handler() http.Handler { return s.handler }

// Serve serves the API on l until Close. It returns nil after Close.
func (s *Server) Serve(l net.Listener) error {
	err := s.http.Serve(l)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Close stops serving, kills every process the server started (SIGKILL to
// its process group), stops every watcher and waits for every goroutine the
// server owns, bounded by Config.ShutdownTimeout.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		deadline := time.Now().Add(s.cfg.ShutdownTimeout)
		s.mu.Lock()
		s.closed = true
		procs := make([]*proc, 0, len(s.procs))
		for _, p := range s.procs {
			procs = append(procs, p)
		}
		drains := make([]*os.File, 0, len(s.drains))
		for f := range s.drains {
			drains = append(drains, f)
		}
		watchers := make([]*pollWatcher, 0, len(s.watchers))
		for id, w := range s.watchers {
			watchers = append(watchers, w)
			delete(s.watchers, id)
		}
		s.mu.Unlock()

		s.cancel() // ends streaming handlers and owned goroutines
		for _, p := range procs {
			p.kill()
		}
		for _, f := range drains {
			_ = f.Close() // ends its drainOrphaned reader
		}
		for _, w := range watchers {
			w.stop()
		}
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		defer cancel()
		if err := s.http.Shutdown(ctx); err != nil {
			_ = s.http.Close()
		}
		done := make(chan struct{})
		go func() { s.wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(time.Until(deadline)):
			s.closeErr = errors.New("guest: close: timed out waiting for goroutines")
		}
	})
	return s.closeErr
}

var errClosing = connect.NewError(connect.CodeUnavailable, errors.New("agent is shutting down"))

// users loads the account database.
func (s *Server) users() (*userDB, error) {
	return loadUserDB(s.cfg.PasswdPath, s.cfg.GroupPath)
}

// userFromAuth returns the account named by an "Authorization: Basic
// base64(user:)" header (as sent by the e2b SDK), or the default user.
func (s *Server) userFromAuth(h http.Header) (*account, *userDB, error) {
	name := s.act.Load().DefaultUser
	if a := h.Get("Authorization"); a != "" {
		u, ok := basicUser(a)
		if !ok {
			return nil, nil, connect.NewError(connect.CodeUnauthenticated, errors.New("malformed authorization header: want Basic base64(user:)"))
		}
		if u != "" {
			name = u
		}
	}
	db, err := s.users()
	if err != nil {
		return nil, nil, connect.NewError(connect.CodeInternal, err)
	}
	acct, err := db.lookup(name)
	if err != nil {
		return nil, nil, connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("invalid username: %s", quote(name)))
	}
	return acct, db, nil
}

// envdError is the JSON error body of the envd HTTP API.
type envdError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func writeJSONError(w http.ResponseWriter, status int, msg string) {
	h := w.Header()
	h.Del("Content-Disposition")
	h.Del("Content-Encoding")
	h.Del("Content-Length")
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(envdError{Code: status, Message: msg})
}
