package edge

import (
	"cmp"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"
)

// EnvdPort is the sandbox port of the guest agent's API (E2B's envd port).
const EnvdPort = 49983

// Defaults.
const (
	DefaultAddr            = "127.0.0.1:3001"
	DefaultTLSAddr         = "127.0.0.1:3443"
	DefaultDomain          = "localhost"
	DefaultMaxBufferedBody = 16 << 20
	// DefaultRenewBefore is how long before a capability's expiry the edge
	// renews it instead of forwarding it.
	DefaultRenewBefore = 20 * time.Second
	// DefaultMaxEntries bounds the route cache.
	DefaultMaxEntries = 65536
	// DefaultControlPlaneTimeout bounds one capability request.
	DefaultControlPlaneTimeout = 10 * time.Second
	// DefaultReattachAttempts bounds the backend attempts to reattach one
	// process stream after its execution was replaced.
	DefaultReattachAttempts = 3
	// DefaultReattachWindow bounds the time one reattach may take (a move
	// may still be publishing its route).
	DefaultReattachWindow = 30 * time.Second
	// DefaultBufferedBodyBudget bounds the request-body bytes held in
	// memory across all in-flight requests (eight bodies of
	// DefaultMaxBufferedBody, or thousands of typical small ones).
	DefaultBufferedBodyBudget = 128 << 20
	// DefaultBodyIdleTimeout cuts a request body that makes no progress.
	DefaultBodyIdleTimeout = 30 * time.Second
	// DefaultBodyReadTimeout bounds receiving a whole held body.
	DefaultBodyReadTimeout = 60 * time.Second
	// DefaultReadHeaderTimeout bounds receiving a request's headers.
	DefaultReadHeaderTimeout = 10 * time.Second
	// DefaultIdleTimeout closes keep-alive connections idle this long.
	DefaultIdleTimeout = 120 * time.Second
	// DefaultMaxHeaderBytes bounds a request's headers.
	DefaultMaxHeaderBytes = 64 << 10
	// signedLookups bounds the control-plane lookups of signed URLs that
	// name no sandbox in flight at once; signedCacheSize the answers kept.
	signedLookups   = 4
	signedCacheSize = 4096
	// DefaultNodeIdleConnsPerHost is how many idle connections the
	// default NodeTransport keeps to each node-api.
	DefaultNodeIdleConnsPerHost = 256
)

// Config configures an Edge. Zero values take the documented defaults.
type Config struct {
	// Addr is the listen address used by Run. Default DefaultAddr.
	Addr string
	// TLSAddr is the HTTPS listen address used by Run when TLS is set.
	// Default DefaultTLSAddr.
	TLSAddr string
	// TLS, when set, makes Run serve HTTPS on TLSAddr as well: the direct
	// sandbox URLs https://<port>-<sandbox>.<Domain> (package edgecert
	// provides it). The plain listener (Addr) keeps serving.
	TLS *tls.Config
	// ControlPlaneURL is the base URL of space-api (required), e.g.
	// "http://127.0.0.1:3000", or several replicas' comma-separated
	// ("http://10.0.0.1:3000,http://10.0.0.2:3000"): the edge fails over
	// to the next when one cannot answer (controlplanes.go).
	ControlPlaneURL string
	// EdgeKey is the edge's service key for the control plane (required).
	// It is sent as X-API-Key on capability requests and never logged.
	EdgeKey string
	// Domain is the public sandbox domain: requests for
	// "<port>-<sandbox>.<Domain>" are routed to that sandbox's port.
	// Default "localhost".
	Domain string
	// MaxBufferedBody is the largest request body the edge holds in memory
	// so that a rebuilt attempt after RefreshRoute (or a transport retry of
	// an idempotent read) can resend it. Larger bodies, and bodies of
	// client-streaming calls, are streamed and never retried. Default 16 MiB.
	// A body is read only after its caller is authorized.
	MaxBufferedBody int64
	// BufferedBodyBudget bounds the bytes of request bodies held in memory
	// across all in-flight requests, so that many authorized callers
	// together cannot exhaust memory either. A body that would exceed it
	// is answered 503 (reason body_budget_exhausted) with Retry-After
	// instead of waiting. It must be at least MaxBufferedBody. Default
	// 128 MiB.
	BufferedBodyBudget int64
	// BodyIdleTimeout cuts a request body (held or streamed) when no byte
	// of it arrives for this long: a stalled client does not keep its
	// connection, goroutine and budget. Bodies of client-streaming calls
	// (StreamInput, WebSocket, raw TCP, service-port bodies of unknown
	// length) are open-ended by design and exempt. Default 30s.
	BodyIdleTimeout time.Duration
	// BodyReadTimeout bounds the whole time to receive a body the edge
	// holds in memory, so a client trickling bytes cannot keep its share
	// of BufferedBodyBudget. Such a body is answered 408. Default 60s.
	BodyReadTimeout time.Duration
	// ReadHeaderTimeout bounds receiving a request's headers (applied by
	// Serve and HTTPServer). Default 10s.
	ReadHeaderTimeout time.Duration
	// IdleTimeout closes keep-alive connections idle this long (applied by
	// Serve and HTTPServer). Default 120s.
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds a request's header bytes (applied by Serve and
	// HTTPServer). Default 64 KiB.
	MaxHeaderBytes int
	// RenewBefore: a cached capability that expires within this window is
	// renewed before use. Default 20s.
	RenewBefore time.Duration
	// MaxEntries bounds the route cache; beyond it the least recently used
	// route is dropped (its next request is authorized anew). Default
	// 65536.
	MaxEntries int
	// ControlPlaneClient sends capability requests. Default: a client with
	// a DefaultControlPlaneTimeout timeout.
	ControlPlaneClient *http.Client
	// NodeTransport forwards requests to node-api. It must not impose an
	// overall timeout (streams are long-lived). Default: a clone of
	// http.DefaultTransport that keeps DefaultNodeIdleConnsPerHost idle
	// connections per node (http.DefaultTransport keeps 2: every
	// concurrent request beyond that opened a connection and closed it
	// afterwards).
	NodeTransport http.RoundTripper
	// Logger receives structured logs (never tokens or keys). Default
	// slog.Default().
	Logger *slog.Logger
	// Clock is the time source. Default time.Now.
	Clock func() time.Time
	// ReattachAttempts bounds, per replacement, the backend attempts to
	// reattach a process stream (Start, Connect) whose execution was
	// replaced to the process on the new execution. Default 3; negative
	// disables reattaching (the client gets "execution replaced").
	ReattachAttempts int
	// ReattachWindow bounds the time one reattach may take, including
	// waits while the control plane still names the replaced execution.
	// Default 30s.
	ReattachWindow time.Duration
}

// withDefaults returns a copy of cfg with zero fields replaced by the
// documented defaults (and Domain, ControlPlaneURL normalized).
func (cfg Config) withDefaults() Config {
	if cfg.Addr == "" {
		cfg.Addr = DefaultAddr
	}
	if cfg.TLSAddr == "" {
		cfg.TLSAddr = DefaultTLSAddr
	}
	if cfg.Domain == "" {
		cfg.Domain = DefaultDomain
	}
	cfg.Domain = strings.ToLower(strings.TrimSuffix(cfg.Domain, "."))
	if cfg.MaxBufferedBody == 0 {
		cfg.MaxBufferedBody = DefaultMaxBufferedBody
	}
	if cfg.BufferedBodyBudget == 0 {
		cfg.BufferedBodyBudget = DefaultBufferedBodyBudget
	}
	if cfg.BodyIdleTimeout == 0 {
		cfg.BodyIdleTimeout = DefaultBodyIdleTimeout
	}
	if cfg.BodyReadTimeout == 0 {
		cfg.BodyReadTimeout = DefaultBodyReadTimeout
	}
	if cfg.ReadHeaderTimeout == 0 {
		cfg.ReadHeaderTimeout = DefaultReadHeaderTimeout
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = DefaultIdleTimeout
	}
	if cfg.MaxHeaderBytes == 0 {
		cfg.MaxHeaderBytes = DefaultMaxHeaderBytes
	}
	if cfg.RenewBefore == 0 {
		cfg.RenewBefore = DefaultRenewBefore
	}
	if cfg.MaxEntries == 0 {
		cfg.MaxEntries = DefaultMaxEntries
	}
	if cfg.ControlPlaneClient == nil {
		cfg.ControlPlaneClient = &http.Client{Timeout: DefaultControlPlaneTimeout}
	}
	if cfg.NodeTransport == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConnsPerHost = DefaultNodeIdleConnsPerHost
		tr.MaxIdleConns = 4 * DefaultNodeIdleConnsPerHost
		cfg.NodeTransport = tr
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.ReattachAttempts == 0 {
		cfg.ReattachAttempts = DefaultReattachAttempts
	}
	if cfg.ReattachWindow == 0 {
		cfg.ReattachWindow = DefaultReattachWindow
	}
	cfg.ControlPlaneURL = strings.Join(controlPlaneURLs(cfg.ControlPlaneURL), ",")
	return cfg
}

// Validate reports configuration errors. It only checks: a zero field that
// has a default is valid (New applies the defaults first).
func (cfg Config) Validate() error {
	var errs []error
	if err := validControlPlaneURLs(cfg.ControlPlaneURL); err != nil {
		errs = append(errs, err)
	}
	if cfg.EdgeKey == "" {
		errs = append(errs, errors.New("edge: EdgeKey is required"))
	}
	if cfg.MaxBufferedBody < 0 {
		errs = append(errs, errors.New("edge: MaxBufferedBody must not be negative"))
	}
	if cfg.BufferedBodyBudget < 0 {
		errs = append(errs, errors.New("edge: BufferedBodyBudget must not be negative"))
	} else if maxBody, budget := cmp.Or(cfg.MaxBufferedBody, DefaultMaxBufferedBody), cmp.Or(cfg.BufferedBodyBudget, DefaultBufferedBodyBudget); maxBody > budget {
		errs = append(errs, fmt.Errorf("edge: BufferedBodyBudget (%d) must be at least MaxBufferedBody (%d)", budget, maxBody))
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"BodyIdleTimeout", cfg.BodyIdleTimeout}, {"BodyReadTimeout", cfg.BodyReadTimeout},
		{"ReadHeaderTimeout", cfg.ReadHeaderTimeout}, {"IdleTimeout", cfg.IdleTimeout},
	} {
		if d.v < 0 {
			errs = append(errs, fmt.Errorf("edge: %s must not be negative", d.name))
		}
	}
	if cfg.MaxHeaderBytes < 0 {
		errs = append(errs, errors.New("edge: MaxHeaderBytes must not be negative"))
	}
	if cfg.RenewBefore < 0 {
		errs = append(errs, errors.New("edge: RenewBefore must not be negative"))
	}
	if cfg.MaxEntries < 0 {
		errs = append(errs, errors.New("edge: MaxEntries must not be negative"))
	}
	if cfg.ReattachWindow < 0 {
		errs = append(errs, errors.New("edge: ReattachWindow must not be negative"))
	}
	if strings.ContainsAny(cfg.Domain, "/: ") {
		errs = append(errs, fmt.Errorf("edge: Domain %q must be a bare DNS name", cfg.Domain))
	}
	return errors.Join(errs...)
}
