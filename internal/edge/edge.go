// Package edge is space-edge, the client-facing data-plane entry point
// (E2B_SANDBOX_URL). It authenticates callers through the control plane,
// caches routes and capabilities, forwards requests to the node-api of the
// selected worker with a Space-Capability header, and repairs stale routes
// (DESIGN.md sections 2, 4, 6 and 7).
//
// Addressing: the e2b SDKs send E2b-Sandbox-Id and E2b-Sandbox-Port headers;
// public URLs use Host "<port>-<sandbox>.<domain>", served over HTTPS too
// (ServeTLS, Config.TLS: the direct URLs the SDKs build when
// E2B_SANDBOX_URL is unset). A signed /files URL built on E2B_SANDBOX_URL
// names no sandbox: the control plane finds it from the signature
// (signedSandbox). Port 49983 is the guest
// agent (envd): /process.Process/* needs a "process" capability,
// /filesystem.Filesystem/* a "filesystem" one, /files and /health a "files"
// one. Every other port is a service port ("service-port" capability with
// port and protocol http or ws).
//
// Route repair: when node-api answers 421 with Space-Route-Outcome
// refresh-route, the edge resolves the current route from the control plane
// (repair request, edge key) and makes exactly one rebuilt attempt, provided
// the request body is still held. A 403 deny is final.
//
// Request bodies (body.go): no body byte is read before the caller is
// authorized. Bodies up to MaxBufferedBody are held for a rebuilt attempt
// within BufferedBodyBudget across requests (503 with Retry-After when none
// is left); larger ones stream. A body that stalls for BodyIdleTimeout, or
// a held one not received within BodyReadTimeout, is cut (408).
//
// Process streams: a process Start or Connect stream that ends with
// "execution replaced" is reattached to the same pid on the sandbox's new
// execution within the same client response (reattach.go).
package edge

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/telemetry"
)

// Edge is a space-edge instance. It is safe for concurrent use.
type Edge struct {
	cfg     Config
	cps     *controlPlanes
	log     *slog.Logger
	metrics *metrics
	proxy   *httputil.ReverseProxy
	own     *http.ServeMux
	handler http.Handler

	budget bodyBudget

	mu       sync.Mutex
	cache    *simplelru.LRU[cacheKey, *entry]
	inflight map[cacheKey]*flight
	// signed maps a signed /files URL that names no sandbox to the
	// sandbox it was signed for; lookups bounds the control-plane
	// lookups in flight (signedSandbox).
	signed  *simplelru.LRU[string, string]
	lookups chan struct{}

	srvMu  sync.Mutex
	srvs   []*http.Server
	closed bool

	// reattachBackoff is the first wait between reattach tries (tests
	// shorten it).
	reattachBackoff time.Duration
}

// New returns an Edge for cfg.
func New(cfg Config) (*Edge, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	e := &Edge{
		cfg:      cfg,
		log:      cfg.Logger.With("component", "space-edge"),
		metrics:  newMetrics(),
		cache:    newRouteCache(cfg.MaxEntries),
		inflight: make(map[cacheKey]*flight),
		lookups:  make(chan struct{}, signedLookups),

		reattachBackoff: defaultReattachBackoff,
	}
	e.signed, _ = simplelru.NewLRU[string, string](signedCacheSize, nil)
	e.budget.max = cfg.BufferedBodyBudget
	e.cps = &controlPlanes{urls: controlPlaneURLs(cfg.ControlPlaneURL)}
	e.proxy = &httputil.ReverseProxy{
		Rewrite:        e.rewrite,
		Transport:      &forwarder{e: e},
		FlushInterval:  -1, // flush every write: Connect server streams, PTY output
		BufferPool:     newBufferPool(),
		ErrorHandler:   e.proxyError,
		ModifyResponse: e.modifyResponse,
		ErrorLog:       slog.NewLogLogger(e.log.Handler(), slog.LevelWarn),
	}
	e.own = http.NewServeMux()
	e.own.Handle("GET /metrics", promhttp.HandlerFor(e.metrics.reg, promhttp.HandlerOpts{}))
	e.own.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(w, "ok\n")
	})
	e.own.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		writeError(w, answer(errdefs.ErrInvalid, "no_sandbox",
			"request names no sandbox: set "+HeaderSandboxID+" and "+HeaderSandboxPort+" or use host <port>-<sandbox>."+cfg.Domain))
	})
	e.handler = http.HandlerFunc(e.serveHTTP)
	return e, nil
}

// Metrics is the edge's registry (with the Go and process collectors): what
// its metrics listener serves (telemetry.ListenMetrics).
func (e *Edge) Metrics() *prometheus.Registry { return e.metrics.reg }

// Handler returns the edge's HTTP handler: sandbox traffic, and the edge's
// own /metrics and /healthz for requests that address no sandbox.
func (e *Edge) Handler() http.Handler { return e.handler }

// Run listens on cfg.Addr (and, with cfg.TLS, on cfg.TLSAddr) and serves
// until ctx is done or Close is called.
func (e *Edge) Run(ctx context.Context) error {
	ln, err := net.Listen("tcp", e.cfg.Addr)
	if err != nil {
		return err
	}
	if e.cfg.TLS == nil {
		return e.Serve(ctx, ln)
	}
	tln, err := net.Listen("tcp", e.cfg.TLSAddr)
	if err != nil {
		ln.Close()
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 2)
	go func() { errc <- e.Serve(ctx, ln) }()
	go func() { errc <- e.ServeTLS(ctx, tln) }()
	err = <-errc
	cancel() // one listener failed or stopped: stop the other
	return errors.Join(err, <-errc)
}

// HTTPServer returns an http.Server for the edge's handler with the
// configured header and idle limits. It sets no ReadTimeout or
// WriteTimeout: process streams and service-port connections are
// long-lived; request bodies are bounded by the handler instead
// (BodyIdleTimeout, BodyReadTimeout). Serve uses it.
func (e *Edge) HTTPServer() *http.Server {
	return &http.Server{
		Handler:           e.handler,
		ReadHeaderTimeout: e.cfg.ReadHeaderTimeout,
		IdleTimeout:       e.cfg.IdleTimeout,
		MaxHeaderBytes:    e.cfg.MaxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(e.log.Handler(), slog.LevelWarn),
	}
}

// Serve serves on ln until ctx is done or Close is called.
func (e *Edge) Serve(ctx context.Context, ln net.Listener) error {
	return e.serve(ctx, ln, "http")
}

// ServeTLS serves HTTPS on ln with cfg.TLS (the direct sandbox URLs
// https://<port>-<sandbox>.<domain>) until ctx is done or Close is
// called. The requests are the same as on Serve's listener.
func (e *Edge) ServeTLS(ctx context.Context, ln net.Listener) error {
	if e.cfg.TLS == nil {
		ln.Close()
		return errors.New("edge: ServeTLS needs Config.TLS")
	}
	return e.serve(ctx, tls.NewListener(ln, e.cfg.TLS.Clone()), "https")
}

func (e *Edge) serve(ctx context.Context, ln net.Listener, scheme string) error {
	srv := e.HTTPServer()
	e.srvMu.Lock()
	if e.closed {
		e.srvMu.Unlock()
		ln.Close()
		return nil // closed before it served: a clean stop, as after Serve
	}
	e.srvs = append(e.srvs, srv)
	e.srvMu.Unlock()
	e.log.Info("space-edge listening", "addr", ln.Addr().String(), "scheme", scheme, "domain", e.cfg.Domain)
	done := make(chan struct{})
	defer close(done)
	go func() {
		select {
		case <-ctx.Done():
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
			_ = srv.Close()
		case <-done:
		}
	}()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Close stops a running server and releases idle node connections.
func (e *Edge) Close() error {
	e.srvMu.Lock()
	e.closed = true
	srvs := e.srvs
	e.srvMu.Unlock()
	var err error
	for _, srv := range srvs {
		err = errors.Join(err, srv.Close())
	}
	if t, ok := e.cfg.NodeTransport.(interface{ CloseIdleConnections() }); ok {
		t.CloseIdleConnections()
	}
	e.cfg.ControlPlaneClient.CloseIdleConnections()
	return err
}

// reqState travels with a forwarded request in its context.
type reqState struct {
	t           target
	key         cacheKey
	entry       *entry
	body        []byte // held body; nil when streamed
	held        bool   // body is held (possibly empty) and can be resent
	streamBody  io.ReadCloser
	callerToken string
	// reserved is this request's share of the buffered-body budget.
	reserved int64
}

type stateKey struct{}

func (e *Edge) serveHTTP(w http.ResponseWriter, r *http.Request) {
	defer func() {
		if v := recover(); v != nil {
			if v == http.ErrAbortHandler {
				panic(v)
			}
			e.log.Error("panic serving request", "panic", v)
			writeError(w, errors.New("internal error")) // unclassified: 500 "internal"
		}
	}()
	sandbox, port, ok, err := parseSandboxPort(r, e.cfg.Domain)
	if err != nil {
		e.metrics.requests.WithLabelValues("none", "400").Inc()
		dropUnreadBody(w, r)
		writeError(w, err)
		return
	}
	if sig, signed := signatureOf(r); !ok && signed && r.Header.Get(spacev1.HeaderAccessToken) == "" {
		// A signed /files URL built on E2B_SANDBOX_URL: the signature
		// tells the sandbox.
		if sandbox, err = e.signedSandbox(r.Context(), sig); err != nil {
			if r.Context().Err() == nil {
				e.metrics.requests.WithLabelValues("none", statusLabel(errorStatus(err))).Inc()
				dropUnreadBody(w, r)
				writeError(w, err)
			}
			return
		}
		port, ok = EnvdPort, true
	}
	if !ok {
		dropUnreadBody(w, r) // the edge's own endpoints read no body
		e.own.ServeHTTP(w, r)
		return
	}
	t, err := classify(r, sandbox, port)
	if err != nil {
		e.metrics.requests.WithLabelValues("none", statusLabel(errorStatus(err))).Inc()
		dropUnreadBody(w, r)
		writeError(w, err)
		return
	}
	sw := &telemetry.StatusWriter{ResponseWriter: w}
	defer func() {
		e.metrics.requests.WithLabelValues(string(t.purpose), statusLabel(sw.CodeOr(statusClientClosed))).Inc()
	}()
	// A new trace root per request: a client's traceparent is a link at
	// most, never the parent (package telemetry).
	ctx, span := telemetry.ServerSpan(r, telemetry.ScopeEdge, "edge "+string(t.purpose), telemetry.Untrusted,
		telemetry.AttrSandbox.String(t.sandbox), telemetry.AttrPurpose.String(string(t.purpose)))
	defer func() { telemetry.EndHTTP(span, sw.CodeOr(statusClientClosed)) }()
	r = r.WithContext(ctx)

	callerToken := r.Header.Get(spacev1.HeaderAccessToken)
	if t.purpose == capability.PurposeServicePort {
		// Service ports are public unless the sandbox was created with
		// private traffic; then E2B's traffic access token authorizes.
		callerToken = r.Header.Get(HeaderTrafficAccessToken)
	}
	key := keyFor(t, callerToken)
	if callerToken == "" && t.purpose == capability.PurposeFiles {
		// A signed uploadUrl/downloadUrl: no access token, the signature
		// stands in for it (the control plane verifies it).
		if sig, ok := signatureOf(r); ok {
			t.sig = sig
			key = keyFor(t, sig.cacheToken())
		}
	}
	st := &reqState{t: t, key: key, callerToken: callerToken}
	// Authorize before reading any body byte: an unauthenticated caller
	// must not make the edge buffer (or even wait for) its body.
	ent, err := e.resolve(r.Context(), st.key, t, callerToken)
	if err != nil {
		// A control plane that did not answer in time is answered (504),
		// not left to an empty 200; only a client that is gone is not.
		if r.Context().Err() == nil {
			dropUnreadBody(w, r)
			writeError(sw, err)
		}
		return
	}
	defer e.releaseBody(st)
	if err := e.holdBody(w, r, st); err != nil {
		writeError(sw, err)
		return
	}
	if st.held && len(st.body) > 0 && !e.usable(ent) {
		// Receiving the body took long enough that the route's
		// authorization or capability is due: resolve it again.
		if ent, err = e.resolve(r.Context(), st.key, t, callerToken); err != nil {
			if r.Context().Err() == nil {
				writeError(sw, err)
			}
			return
		}
	}
	st.entry = ent
	if t.clientStream {
		// Let the handler read the request body while the response
		// streams (HTTP/1.1 full duplex).
		_ = http.NewResponseController(w).EnableFullDuplex()
	}
	e.proxy.ServeHTTP(sw, r.WithContext(context.WithValue(r.Context(), stateKey{}, st)))
}
