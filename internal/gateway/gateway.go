// Package gateway is netgtw, the per-activation service-port gateway
// (DESIGN.md sections 2, 5, 7 and 9).
//
// sbx-manager launches one netgtw per activation and asks it, over a Unix
// socket, for a guest connection for every service-port request it has
// already admitted (the dial protocol, dial.go). The gateway checks it a
// second time, on its own: the capability must be a valid "service-port"
// capability whose port and protocol match the request, and its identity
// must equal the TRUSTED activation state sbx-manager gave the gateway
// (never anything the request says), compared with identity.Compare with
// this gateway's sandbox as the endpoint sandbox (a capability for another
// sandbox is a Deny). Only then does it open the guest connection: it dials
// 127.0.0.1:<port> from inside the sandbox's network namespace (see
// NetnsDialer) and passes the connected socket to sbx-manager, which
// forwards the request on it (GuestRequest, ProxyOn, ServeTCP). Gateway's
// ServeHTTP runs the same checks and forwarding in one process.
//
// Protocols, as the edge classifies them:
//   - http: no Upgrade header; reverse-proxied.
//   - ws: any Upgrade header but "tcp" (WebSocket); the upgrade is passed
//     through to the guest server and the connection spliced after its 101.
//   - tcp: "Upgrade: tcp" (with "Connection: Upgrade") on any path. The
//     gateway dials the port, answers "101 Switching Protocols" with
//     "Upgrade: tcp" itself and then carries raw bytes both ways. Every HTTP
//     hop (edge, sbx-manager) passes such an upgrade through unchanged, so a
//     raw TCP stream rides the same path and the same checks as WebSocket.
//
// Streams (upgraded connections and in-flight requests) hold a lease tied to
// the identity epoch they were opened under. An activation-attempt-only
// change (SetActivation with the same epoch) keeps them and makes new opens
// require the new identity; a change of epoch (a new execution) or Retire
// ends them at once and the gateway then serves nothing (its network
// namespace belongs to the old execution).
package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/identity"
)

// Service-port protocols.
const (
	ProtocolHTTP = "http"
	ProtocolWS   = "ws"
	ProtocolTCP  = "tcp"
)

// HeaderSandboxPort names the sandbox port a forwarded service-port request
// addresses. The edge sets it on every service-port request it forwards
// (overwriting anything the client sent).
const HeaderSandboxPort = "E2b-Sandbox-Port"

// EnvdPort is the guest agent's port: never a service port.
const EnvdPort = 49983

// ErrEpochChanged is returned by SetActivation for a route of another
// execution: the gateway has retired and ended its streams.
var ErrEpochChanged = errors.New("gateway: identity epoch changed: gateway retired")

// RequestProtocol classifies r the way the edge does: "Upgrade: tcp" is raw
// TCP, any other Upgrade is WebSocket, no Upgrade is plain HTTP.
func RequestProtocol(r *http.Request) string {
	up := r.Header.Get("Upgrade")
	switch {
	case up == "":
		return ProtocolHTTP
	case strings.EqualFold(strings.TrimSpace(up), ProtocolTCP):
		return ProtocolTCP
	default:
		return ProtocolWS
	}
}

// ParsePort parses a port header value (1..65535, digits only).
func ParsePort(s string) (int, error) {
	if len(s) == 0 || len(s) > 5 {
		return 0, fmt.Errorf("invalid port %q", s)
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return 0, fmt.Errorf("invalid port %q", s)
		}
	}
	p, err := strconv.Atoi(s)
	if err != nil || p < 1 || p > 65535 {
		return 0, fmt.Errorf("invalid port %q", s)
	}
	return p, nil
}

// DialFunc opens a connection to 127.0.0.1:port inside the sandbox.
type DialFunc func(ctx context.Context, port int) (net.Conn, error)

// Config configures a Gateway.
type Config struct {
	// Route is the trusted activation state handed over by sbx-manager.
	Route identity.Route
	// Verifier checks capabilities against the current key bundle.
	Verifier *capability.Verifier
	// Dial reaches a port inside the sandbox's network namespace.
	Dial DialFunc
	// DialTimeout bounds one guest dial. Default 10s (also for a negative
	// value).
	DialTimeout time.Duration
	// Logger receives the gateway's logs. Default slog.Default().
	Logger *slog.Logger
}

// withDefaults returns a copy of cfg with unset fields replaced by the
// documented defaults.
func (cfg Config) withDefaults() Config {
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 10 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return cfg
}

// Validate checks cfg; it fills nothing.
func (cfg Config) Validate() error {
	if err := cfg.Route.Validate(); err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	if cfg.Verifier == nil || cfg.Dial == nil {
		return errors.New("gateway: verifier and dialer are required")
	}
	return nil
}

// Admission is the outcome of the gateway's checks on one request.
type Admission struct {
	Decision identity.Decision
	Claims   capability.Claims
	Err      error
	// lease is the epoch context the request was admitted under.
	lease context.Context
}

// Gateway is one activation's netgtw. It is safe for concurrent use.
type Gateway struct {
	ver     *capability.Verifier
	dial    DialFunc
	dialTO  time.Duration
	log     *slog.Logger
	sandbox string
	proxy   *httputil.ReverseProxy
	tr      *http.Transport

	mu      sync.RWMutex
	route   identity.Route
	retired bool
	lease   context.Context
	cancel  context.CancelFunc

	streams atomic.Int64
	// Counters by outcome (allow, refresh-route, deny).
	allows, refreshes, denies atomic.Int64
}

// New returns a gateway serving cfg.Route.
func New(cfg Config) (*Gateway, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	g := &Gateway{ver: cfg.Verifier, dial: cfg.Dial, dialTO: cfg.DialTimeout, sandbox: cfg.Route.SandboxID,
		route: cfg.Route, log: cfg.Logger.With("component", "netgtw", "sandbox", cfg.Route.SandboxID)}
	g.lease, g.cancel = context.WithCancel(context.Background())
	g.tr = &http.Transport{
		DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
			_, ps, err := net.SplitHostPort(addr)
			if err != nil {
				return nil, err
			}
			p, err := ParsePort(ps)
			if err != nil {
				return nil, err
			}
			return g.dialGuest(ctx, p)
		},
		MaxIdleConnsPerHost: 32,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
	}
	g.proxy = &httputil.ReverseProxy{
		Rewrite:       func(pr *httputil.ProxyRequest) {},
		Transport:     g.tr,
		FlushInterval: -1,
		BufferPool:    NewBufferPool(),
		ErrorLog:      slog.NewLogLogger(g.log.Handler(), slog.LevelWarn),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() != nil {
				return
			}
			writeJSON(w, http.StatusBadGateway, "", "sandbox port unreachable: "+err.Error())
		},
	}
	return g, nil
}

func (g *Gateway) dialGuest(ctx context.Context, port int) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, g.dialTO)
	defer cancel()
	return g.dial(ctx, port)
}

// Route returns the trusted activation state the gateway currently serves
// and whether it has retired.
func (g *Gateway) Route() (identity.Route, bool) {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return g.route, g.retired
}

// Streams is the number of open streams and in-flight requests.
func (g *Gateway) Streams() int64 { return g.streams.Load() }

// SetActivation installs the trusted identity of a new activation attempt.
// Within the same epoch established streams are kept and new opens need the
// new identity. A route of another execution retires the gateway (ending
// every stream) and returns ErrEpochChanged; a route of another sandbox is
// refused and changes nothing.
func (g *Gateway) SetActivation(r identity.Route) error {
	if err := r.Validate(); err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	if r.SandboxID != g.sandbox {
		return fmt.Errorf("gateway: route names sandbox %s, this gateway serves %s", r.SandboxID, g.sandbox)
	}
	g.mu.Lock()
	if g.retired {
		g.mu.Unlock()
		return ErrEpochChanged
	}
	if r.Epoch() != g.route.Epoch() {
		g.mu.Unlock()
		g.Retire("new execution " + r.String())
		return ErrEpochChanged
	}
	old := g.route.ActivationID
	g.route = r
	g.mu.Unlock()
	g.log.Info("activation changed; streams kept", "from", old, "to", r.ActivationID, "streams", g.streams.Load())
	return nil
}

// Retire ends every stream and makes the gateway refuse new opens with
// RefreshRoute.
func (g *Gateway) Retire(why string) {
	g.mu.Lock()
	was := g.retired
	g.retired = true
	g.mu.Unlock()
	g.cancel()
	g.tr.CloseIdleConnections()
	// The streams close their connections when they see the lease end;
	// wait (bounded) so that, once Retire returns, no byte passes any more.
	deadline := time.Now().Add(retireWait)
	for g.streams.Load() > 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if !was {
		g.log.Info("gateway retired; streams ended", "why", why, "streams_left", g.streams.Load())
	}
}

// retireWait bounds Retire's wait for the streams to close.
const retireWait = 2 * time.Second

// Close retires the gateway.
func (g *Gateway) Close() { g.Retire("closed") }

// Admit runs the gateway's checks, in order: capability present, parse, key,
// signature, purpose service-port with this port and protocol, time window
// (Verifier.VerifyServicePort), then the identity comparison with the
// trusted activation state, with this gateway's sandbox as the endpoint.
func (g *Gateway) Admit(token string, port int, protocol string) Admission {
	if token == "" {
		return Admission{Decision: identity.Decision{Outcome: identity.Deny, Reason: "missing capability"}}
	}
	c, err := g.ver.VerifyServicePort(token, port, protocol)
	if err != nil {
		return Admission{Decision: identity.Decision{Outcome: identity.Deny, Reason: err.Error()}, Err: err}
	}
	g.mu.RLock()
	rec := identity.Record{Route: g.route, Retired: g.retired}
	lease := g.lease
	g.mu.RUnlock()
	return Admission{Decision: identity.Compare(c.Route, &rec, g.sandbox), Claims: c, lease: lease}
}

func (g *Gateway) count(o identity.Outcome) {
	switch o {
	case identity.Allow:
		g.allows.Add(1)
	case identity.RefreshRoute:
		g.refreshes.Add(1)
	default:
		g.denies.Add(1)
	}
}

// Counts returns the number of allow, refresh-route and deny decisions.
func (g *Gateway) Counts() (allow, refresh, deny int64) {
	return g.allows.Load(), g.refreshes.Load(), g.denies.Load()
}

// ServeHTTP serves one forwarded service-port request: admission, then the
// guest connection.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	port, err := ParsePort(r.Header.Get(HeaderSandboxPort))
	if err != nil || port == EnvdPort {
		writeJSON(w, http.StatusBadRequest, "", "service-port request without a valid "+HeaderSandboxPort)
		return
	}
	proto := RequestProtocol(r)
	ad := g.Admit(r.Header.Get(spacev1.HeaderCapability), port, proto)
	g.count(ad.Decision.Outcome)
	// A refusal is logged; an allowed request only at debug level: it is
	// on every request's path, and sbx-manager's audit log records each
	// admission already.
	level := slog.LevelInfo
	if ad.Decision.Outcome == identity.Allow {
		level = slog.LevelDebug
	}
	g.log.Log(r.Context(), level, "decision", "outcome", ad.Decision.Outcome.String(), "reason", ad.Decision.Reason,
		"jti", ad.Claims.JTI, "port", port, "protocol", proto)
	switch ad.Decision.Outcome {
	case identity.Allow:
	case identity.RefreshRoute:
		writeJSON(w, http.StatusMisdirectedRequest, spacev1.OutcomeRefreshRoute, ad.Decision.Reason)
		return
	default:
		writeJSON(w, http.StatusForbidden, spacev1.OutcomeDeny, ad.Decision.Reason)
		return
	}
	// The stream lives no longer than the epoch it was admitted under.
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stop := context.AfterFunc(ad.lease, cancel)
	defer stop()
	if ad.lease.Err() != nil {
		writeJSON(w, http.StatusMisdirectedRequest, spacev1.OutcomeRefreshRoute, spacev1.ReasonExecutionReplaced)
		return
	}
	g.streams.Add(1)
	defer g.streams.Add(-1)
	if proto == ProtocolTCP {
		if err := CheckTCPUpgrade(r); err != nil {
			writeJSON(w, http.StatusBadRequest, "", err.Error())
			return
		}
		gc, err := g.dialGuest(ctx, port)
		if err != nil {
			writeJSON(w, http.StatusBadGateway, "", "sandbox port unreachable: "+err.Error())
			return
		}
		defer gc.Close()
		ServeTCP(ctx, w, r, gc)
		return
	}
	// The transport reads the request body while the response streams
	// back: without full duplex the server discards and closes that body
	// once the response headers go out, and the transport's last read of
	// it (the one that sees EOF) fails with "invalid Read on closed Body",
	// which closes the guest connection mid-response (a server that
	// answers as soon as it has the body, as the code interpreter does,
	// lost about 1 in 100 responses). In full duplex the handler closes
	// the body itself (golang/go#68560).
	_ = http.NewResponseController(w).EnableFullDuplex()
	defer r.Body.Close()
	g.proxy.ServeHTTP(w, GuestRequest(r.WithContext(ctx), port))
}

func headerHasToken(h http.Header, name, token string) bool {
	for _, v := range h.Values(name) {
		for _, f := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(f), token) {
				return true
			}
		}
	}
	return false
}

func writeJSON(w http.ResponseWriter, status int, outcome, msg string) {
	if outcome != "" {
		w.Header().Set(spacev1.HeaderRouteOutcome, outcome)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	reason := outcome
	if reason == "" {
		reason = strings.ToLower(strings.ReplaceAll(http.StatusText(status), " ", "_"))
	}
	_ = json.NewEncoder(w).Encode(spacev1.Error{Code: status, Message: msg, Reason: reason})
}

// validHost accepts a Host the edge passes on: printable ASCII without
// spaces, at most 255 bytes (anything else: the port's own address).
func validHost(h string) bool {
	if h == "" || len(h) > 255 {
		return false
	}
	for i := 0; i < len(h); i++ {
		if h[i] <= ' ' || h[i] >= 0x7f {
			return false
		}
	}
	return true
}
