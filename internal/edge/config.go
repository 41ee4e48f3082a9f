package edge

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// EnvdPort is the sandbox port of the guest agent's API (E2B's envd port).
const EnvdPort = 49983

// Defaults.
const (
	DefaultAddr            = "127.0.0.1:3001"
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
)

// Config configures an Edge. Zero values take the documented defaults.
type Config struct {
	// Addr is the listen address used by Run. Default DefaultAddr.
	Addr string
	// ControlPlaneURL is the base URL of space-api (required), e.g.
	// "http://127.0.0.1:3000".
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
	MaxBufferedBody int64
	// RenewBefore: a cached capability that expires within this window is
	// renewed before use. Default 20s.
	RenewBefore time.Duration
	// MaxEntries bounds the route cache. Default 65536.
	MaxEntries int
	// ControlPlaneClient sends capability requests. Default: a client with
	// a DefaultControlPlaneTimeout timeout.
	ControlPlaneClient *http.Client
	// NodeTransport forwards requests to node-api. It must not impose an
	// overall timeout (streams are long-lived). Default: a clone of
	// http.DefaultTransport.
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

// withDefaults returns cfg with zero values replaced by defaults.
func (cfg Config) withDefaults() Config {
	if cfg.Addr == "" {
		cfg.Addr = DefaultAddr
	}
	if cfg.Domain == "" {
		cfg.Domain = DefaultDomain
	}
	cfg.Domain = strings.ToLower(strings.TrimSuffix(cfg.Domain, "."))
	if cfg.MaxBufferedBody == 0 {
		cfg.MaxBufferedBody = DefaultMaxBufferedBody
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
		cfg.NodeTransport = http.DefaultTransport.(*http.Transport).Clone()
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
	cfg.ControlPlaneURL = strings.TrimRight(cfg.ControlPlaneURL, "/")
	return cfg
}

// Validate reports configuration errors (after defaults are applied).
func (cfg Config) Validate() error {
	cfg = cfg.withDefaults()
	var errs []error
	if cfg.ControlPlaneURL == "" {
		errs = append(errs, errors.New("edge: ControlPlaneURL is required"))
	} else if u, err := url.Parse(cfg.ControlPlaneURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		errs = append(errs, fmt.Errorf("edge: ControlPlaneURL %q is not an http(s) URL", cfg.ControlPlaneURL))
	}
	if cfg.EdgeKey == "" {
		errs = append(errs, errors.New("edge: EdgeKey is required"))
	}
	if cfg.MaxBufferedBody < 0 {
		errs = append(errs, errors.New("edge: MaxBufferedBody must not be negative"))
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
