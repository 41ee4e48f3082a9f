package telemetry

// HTTP hops: server spans (trusted peers continue the caller's trace,
// clients start a new root linked to theirs) and injection of the current
// span's traceparent into outgoing requests.

import (
	"context"
	"net/http"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Trace-context headers (W3C). Requests from clients lose them at the edge
// and the control plane; SPACE's hops set their own.
const (
	HeaderTraceparent = "Traceparent"
	HeaderTracestate  = "Tracestate"
)

var w3c = propagation.TraceContext{}

// Trust says whether a request's traceparent may parent the receiver's
// span.
type Trust bool

const (
	// Untrusted: a client's request. Its trace context (when well formed)
	// is recorded as a link of a new root span.
	Untrusted Trust = false
	// Trusted: a hop from another SPACE process (edge or control plane to
	// node-api, sbx-manager to spaced-host, spaced-host to the guest).
	Trusted Trust = true
)

// ServerSpan starts the receiver's span for r (kind server, scope's
// tracer). A malformed traceparent is ignored (a new root), never an
// error: it must not let a caller fail or steer a request. With tracing
// off it returns r's context and a no-op span.
func ServerSpan(r *http.Request, scope, name string, trust Trust, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	ctx := r.Context()
	if !on.Load() {
		return ctx, noopSpan
	}
	remote := trace.SpanContextFromContext(w3c.Extract(context.Background(), propagation.HeaderCarrier(r.Header)))
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindServer), trace.WithAttributes(attrs...),
		trace.WithAttributes(attribute.String("http.request.method", r.Method), attribute.String("url.path", r.URL.Path))}
	switch {
	case !remote.IsValid():
	case trust == Trusted:
		ctx = trace.ContextWithRemoteSpanContext(ctx, remote)
	default:
		opts = append(opts, trace.WithNewRoot(), trace.WithLinks(trace.Link{SpanContext: remote,
			Attributes: []attribute.KeyValue{attribute.String("space.link", "client")}}))
	}
	return otel.Tracer(scope).Start(ctx, name, opts...)
}

// Inject replaces h's trace-context headers with ctx's span (or removes
// them when no span records): a hop forwards SPACE's context, never the one
// a client sent.
func Inject(ctx context.Context, h http.Header) {
	h.Del(HeaderTraceparent)
	h.Del(HeaderTracestate)
	if !on.Load() {
		return
	}
	w3c.Inject(ctx, propagation.HeaderCarrier(h))
}

// EndHTTP sets the span's status from an HTTP response code and ends it.
func EndHTTP(span trace.Span, code int) {
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(attribute.Int("http.response.status_code", code))
	if code >= 500 {
		span.SetStatus(codes.Error, http.StatusText(code))
	}
	span.End()
}

// Middleware wraps next in a server span of scope per request (named
// name(r), e.g. the route pattern) and injects nothing: handlers that call
// onward use Inject or Transport. With tracing off it adds one atomic load.
func Middleware(scope string, trust Trust, name func(*http.Request) string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !on.Load() {
			next.ServeHTTP(w, r)
			return
		}
		ctx, span := ServerSpan(r, scope, name(r), trust)
		sw := &StatusWriter{ResponseWriter: w}
		defer func() { EndHTTP(span, sw.CodeOr(http.StatusOK)) }()
		next.ServeHTTP(sw, r.WithContext(ctx))
	})
}

// Transport injects the request context's span into every request rt
// sends (replacing any trace headers already there).
func Transport(rt http.RoundTripper) http.RoundTripper {
	if rt == nil {
		rt = http.DefaultTransport
	}
	return transport{rt}
}

type transport struct{ rt http.RoundTripper }

func (t transport) RoundTrip(r *http.Request) (*http.Response, error) {
	if !on.Load() || !trace.SpanContextFromContext(r.Context()).IsValid() {
		if r.Header.Get(HeaderTraceparent) == "" {
			return t.rt.RoundTrip(r)
		}
	}
	r = r.Clone(r.Context())
	Inject(r.Context(), r.Header)
	return t.rt.RoundTrip(r)
}

// CloseIdleConnections passes through to the wrapped transport.
func (t transport) CloseIdleConnections() {
	if c, ok := t.rt.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// StatusWriter records the response code a handler writes; Flush and
// Unwrap (http.ResponseController: hijack, full duplex) reach the wrapped
// writer. The edge, the control plane and Middleware count and trace with
// it.
type StatusWriter struct {
	http.ResponseWriter
	status int
}

func (w *StatusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *StatusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *StatusWriter) Flush() {
	_ = http.NewResponseController(w.ResponseWriter).Flush()
}

func (w *StatusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// CodeOr is the code written, or none when the handler wrote nothing.
func (w *StatusWriter) CodeOr(none int) int {
	if w.status == 0 {
		return none
	}
	return w.status
}
