// Package telemetry is SPACE's one setup of OpenTelemetry tracing and of the
// Prometheus listener every component serves /metrics on, so that the edge,
// the control plane, the workers and spaced-host trace and expose metrics
// the same way.
//
// Tracing is off unless Setup was called with an exporter or an OTLP
// endpoint: then the global tracer provider stays OpenTelemetry's no-op one
// and the helpers here (ServerSpan, Inject, StartSpan) return before they
// allocate, so an untraced request pays one atomic load per hop.
//
// Trust: a trace context that arrives from a client (the edge's listener,
// the control plane's API) never becomes the parent of SPACE's spans: the
// receiver starts a new root and records the client's context as a link
// only. Hops between SPACE's own processes (edge to node-api, sbx-manager to
// spaced-host, spaced-host to the guest) carry W3C traceparent as the
// parent. No hop ever takes span attributes from a request: they are set by
// the receiver from what it decided (e.g. the identity decision).
package telemetry

import (
	"context"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/spacesbx/space/internal/errdefs"
)

// Environment variables: the mains read them (and only the mains), and a
// worker passes its tracing configuration to the helper processes it
// starts (spaced-host) through them (Env, FromEnv).
const (
	// EnvOTLPEndpoint is OpenTelemetry's standard variable; --otlp-endpoint
	// defaults to it.
	EnvOTLPEndpoint = "OTEL_EXPORTER_OTLP_ENDPOINT"
	// EnvSampleRatio is the default of --trace-sample-ratio.
	EnvSampleRatio = "SPACE_TRACE_SAMPLE_RATIO"
)

// Config chooses where spans go. The zero Config traces nothing.
type Config struct {
	// OTLPEndpoint is the OTLP/gRPC collector: host:port (plaintext) or a
	// URL (http:// plaintext, https:// TLS). Empty: no OTLP export.
	OTLPEndpoint string
	// SampleRatio is the fraction of new traces recorded (a child follows
	// its parent's decision). Default 1 (every request) when tracing is
	// on; 0 < SampleRatio <= 1.
	SampleRatio float64
	// ServiceName is the resource's service.name (the process: space-up,
	// space-edge, spaced-host...). Default "space".
	ServiceName string
	// Exporter receives spans in addition to (or instead of) OTLP: tests
	// pass an in-memory one. Nil: none.
	Exporter sdktrace.SpanExporter
	// Record turns tracing on without any exporter (spans are made and
	// dropped): the benchmark's "on" case.
	Record bool
}

func (c Config) enabled() bool { return c.OTLPEndpoint != "" || c.Exporter != nil || c.Record }

func (c Config) withDefaults() Config {
	if c.SampleRatio == 0 {
		c.SampleRatio = 1
	}
	if c.ServiceName == "" {
		c.ServiceName = "space"
	}
	return c
}

// Validate checks c; zero fields take their defaults.
func (c Config) Validate() error {
	if c.SampleRatio < 0 || c.SampleRatio > 1 {
		return fmt.Errorf("telemetry: sample ratio %v: %w: want 0 < ratio <= 1", c.SampleRatio, errdefs.ErrInvalid)
	}
	if e := c.OTLPEndpoint; e != "" && !strings.Contains(e, "://") {
		if i := strings.LastIndexByte(e, ':'); i <= 0 || i == len(e)-1 {
			return fmt.Errorf("telemetry: otlp endpoint %q: %w: want host:port or a URL", e, errdefs.ErrInvalid)
		}
	}
	return nil
}

// Flags registers --otlp-endpoint and --trace-sample-ratio on fs with def
// (from EnvOTLPEndpoint and EnvSampleRatio, read by the main) as defaults.
func Flags(fs *flag.FlagSet, def Config) *Config {
	c := &Config{}
	fs.StringVar(&c.OTLPEndpoint, "otlp-endpoint", def.OTLPEndpoint, "OTLP/gRPC collector for traces, host:port or http(s)://host:port (default $"+EnvOTLPEndpoint+"; empty: no tracing)")
	fs.Float64Var(&c.SampleRatio, "trace-sample-ratio", def.SampleRatio, "fraction of new traces recorded, 0 < r <= 1 (default $"+EnvSampleRatio+", else 1)")
	return c
}

// FromEnv reads the tracing Config from getenv (mains and helper
// processes only). A malformed ratio is left 0 (the default).
func FromEnv(getenv func(string) string) Config {
	c := Config{OTLPEndpoint: getenv(EnvOTLPEndpoint)}
	if r, err := strconv.ParseFloat(getenv(EnvSampleRatio), 64); err == nil {
		c.SampleRatio = r
	}
	return c
}

// Env is c as the environment of a helper process (spaced-host), which
// exports its own spans to the same collector. Nothing without an
// endpoint.
func Env(c Config) []string {
	if c.OTLPEndpoint == "" {
		return nil
	}
	env := []string{EnvOTLPEndpoint + "=" + c.OTLPEndpoint}
	if c.SampleRatio != 0 {
		env = append(env, EnvSampleRatio+"="+strconv.FormatFloat(c.SampleRatio, 'g', -1, 64))
	}
	return env
}

// on is set while a recording provider is installed: the fast path of
// every helper when tracing is off.
var on atomic.Bool

// Enabled reports whether spans are being recorded in this process.
func Enabled() bool { return on.Load() }

// Provider is the process's installed tracer provider.
type Provider struct {
	tp *sdktrace.TracerProvider
}

// Setup installs the tracer provider c describes as the process's global
// one (with the W3C trace-context propagator). For a Config that enables
// nothing it installs nothing and returns a Provider whose Shutdown does
// nothing: tracing stays off.
func Setup(ctx context.Context, c Config) (*Provider, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	c = c.withDefaults()
	otel.SetTextMapPropagator(propagation.TraceContext{})
	if !c.enabled() {
		return &Provider{}, nil
	}
	opts := []sdktrace.TracerProviderOption{
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(c.SampleRatio))),
		sdktrace.WithResource(resource.NewSchemaless(semconv.ServiceName(c.ServiceName))),
	}
	if c.OTLPEndpoint != "" {
		var eo []otlptracegrpc.Option
		if strings.Contains(c.OTLPEndpoint, "://") {
			eo = append(eo, otlptracegrpc.WithEndpointURL(c.OTLPEndpoint))
		} else {
			eo = append(eo, otlptracegrpc.WithEndpoint(c.OTLPEndpoint), otlptracegrpc.WithInsecure())
		}
		exp, err := otlptracegrpc.New(ctx, eo...)
		if err != nil {
			return nil, fmt.Errorf("telemetry: otlp exporter: %w", err)
		}
		opts = append(opts, sdktrace.WithBatcher(exp))
	}
	if c.Exporter != nil {
		opts = append(opts, sdktrace.WithBatcher(c.Exporter))
	}
	tp := sdktrace.NewTracerProvider(opts...)
	otel.SetTracerProvider(tp)
	on.Store(true)
	return &Provider{tp: tp}, nil
}

// ForceFlush exports the spans ended so far (tests; before a helper exits).
func (p *Provider) ForceFlush(ctx context.Context) error {
	if p == nil || p.tp == nil {
		return nil
	}
	return p.tp.ForceFlush(ctx)
}

// Shutdown flushes and stops the provider and turns tracing off again.
func (p *Provider) Shutdown(ctx context.Context) error {
	if p == nil || p.tp == nil {
		return nil
	}
	on.Store(false)
	otel.SetTracerProvider(noop.NewTracerProvider())
	return p.tp.Shutdown(ctx)
}

// Scope names: the instrumentation scope of each component's spans (what a
// trace view shows as the span's library), so one process running several
// components (space up) still tells them apart.
const (
	ScopeEdge         = "space/edge"
	ScopeNodeAPI      = "space/node-api"
	ScopeSbxManager   = "space/sbx-manager"
	ScopeBridge       = "space/spaced-host"
	ScopeGuest        = "space/guest"
	ScopeControlPlane = "space/control-plane"
)

// Attribute keys SPACE sets on its spans.
const (
	AttrSandbox    = attribute.Key("space.sandbox")
	AttrGeneration = attribute.Key("space.generation")
	AttrWorker     = attribute.Key("space.worker")
	AttrPurpose    = attribute.Key("space.purpose")
	// AttrDecision is the receiver's identity decision: allow,
	// refresh_route or deny.
	AttrDecision = attribute.Key("space.identity.decision")
	AttrReason   = attribute.Key("space.identity.reason")
)

// StartSpan starts an internal span of scope under ctx's span; with
// tracing off it returns ctx and a no-op span without allocating.
func StartSpan(ctx context.Context, scope, name string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	if !on.Load() {
		return ctx, noopSpan
	}
	return otel.Tracer(scope).Start(ctx, name, trace.WithAttributes(attrs...))
}

var noopSpan = trace.SpanFromContext(context.Background())

// SpanFromContext is ctx's span (a no-op span when none records).
func SpanFromContext(ctx context.Context) trace.Span { return trace.SpanFromContext(ctx) }
