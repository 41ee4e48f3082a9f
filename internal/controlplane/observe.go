package controlplane

// The control plane's observability: a server span per API request
// (clients' trace context is a link only; the edge's, which authenticates
// with the edge key, is the parent, so a capability's issuance lands in
// the trace of the request it is for), spans of capability issuance, and
// the series its metrics listener serves (Metrics): API requests by route,
// code and duration, capability issuance by result, reaper passes.

import (
	"context"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/telemetry"
)

type observability struct {
	reg          *prometheus.Registry
	requests     *prometheus.CounterVec
	durations    *prometheus.HistogramVec
	capabilities *prometheus.CounterVec
	reaps        prometheus.Counter
	// schedule: a create's arrival to its placement decision.
	schedule prometheus.Histogram
	// workerLossRecoveries counts sandboxes of lost workers brought back
	// elsewhere (workerloss.go).
	workerLossRecoveries prometheus.Counter
	// leader is 1 while this replica leads the control-plane election
	// (runs the singletons), leaderChanges counts its wins and losses.
	leader        prometheus.Gauge
	leaderChanges *prometheus.CounterVec
	// placementRetries counts placements re-picked because another one
	// on the same worker committed first (store.ErrPlacementMoved).
	placementRetries prometheus.Counter
	// keyRotations counts rotations completed by this replica.
	keyRotations prometheus.Counter
}

func newObservability() *observability {
	o := &observability{
		reg: telemetry.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_api_requests_total", Help: "API requests by route pattern and status code.",
		}, []string{"route", "code"}),
		durations: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "space_api_request_duration_seconds", Help: "API request durations by route pattern.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"route"}),
		capabilities: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_api_capabilities_total", Help: "Capability requests by purpose and result (issued or the refusal's reason).",
		}, []string{"purpose", "result"}),
		reaps: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "space_api_reaper_passes_total", Help: "Passes of the timeout reaper.",
		}),
		schedule: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "space_api_schedule_seconds", Help: "Scheduling latency: from a create request's arrival to its placement decision (first attempt's worker picked).",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}),
		workerLossRecoveries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "space_api_worker_loss_recoveries_total", Help: "Running sandboxes of lost workers brought back on another worker as new executions.",
		}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "space_api_leader", Help: "1 while this replica leads the control-plane election and runs the singletons (reaper, rotation completion).",
		}),
		leaderChanges: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_api_leader_transitions_total", Help: "Leadership won (event=won) and ended (event=lost) by this replica.",
		}, []string{"event"}),
		placementRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "space_api_placement_retries_total", Help: "Placements picked again because another placement on the same worker committed first.",
		}),
		keyRotations: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "space_api_key_rotations_total", Help: "Signing-key rotations this replica completed.",
		}),
	}
	o.reg.MustRegister(o.requests, o.durations, o.capabilities, o.reaps, o.schedule, o.workerLossRecoveries, o.leader, o.leaderChanges, o.placementRetries, o.keyRotations)
	return o
}

// Metrics is the control plane's registry (with the Go and process
// collectors; the process that opened the store adds its etcd latencies,
// store.Collector): what its metrics listener serves
// (telemetry.ListenMetrics).
func (s *Server) Metrics() *prometheus.Registry { return s.obs.reg }

// observe wraps the API handler: a server span and the request series.
// The route label is the matched pattern (bounded), never the raw path.
func (s *Server) observe(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		trust := telemetry.Untrusted
		if s.cfg.EdgeKey != "" && equalSecret(r.Header.Get(spacev1.HeaderAPIKey), s.cfg.EdgeKey) {
			trust = telemetry.Trusted
		}
		ctx, span := telemetry.ServerSpan(r, telemetry.ScopeControlPlane, "space-api "+r.Method, trust)
		sw := &telemetry.StatusWriter{ResponseWriter: w}
		r = r.WithContext(context.WithValue(ctx, arrivalKey{}, start))
		h.ServeHTTP(sw, r)
		route := r.Pattern
		if route == "" {
			route = "unmatched"
		}
		code := sw.CodeOr(http.StatusOK)
		s.obs.requests.WithLabelValues(route, strconv.Itoa(code)).Inc()
		s.obs.durations.WithLabelValues(route).Observe(time.Since(start).Seconds())
		if span.IsRecording() {
			span.SetName("space-api " + route)
			span.SetAttributes(attribute.String("http.route", route))
		}
		telemetry.EndHTTP(span, code)
	})
}

// arrivalKey keys a request's arrival time in its context (observe).
type arrivalKey struct{}

// arrival is when the request of ctx arrived (observe), or now when ctx is
// not a request's.
func arrival(ctx context.Context) time.Time {
	if t, ok := ctx.Value(arrivalKey{}).(time.Time); ok {
		return t
	}
	return time.Now()
}

// traceCapability starts the span of one capability issuance.
func traceCapability(ctx context.Context, sandbox string, purpose string) (context.Context, func(error)) {
	ctx, span := telemetry.StartSpan(ctx, telemetry.ScopeControlPlane, "issue capability",
		telemetry.AttrSandbox.String(sandbox), telemetry.AttrPurpose.String(purpose))
	return ctx, func(err error) {
		if err != nil && span.IsRecording() {
			span.SetAttributes(attribute.String("space.refusal", errdefs.Reason(err)))
		}
		span.End()
	}
}

// tracedClient is c with a transport that carries the request's trace
// context to node-api (install, lifecycle calls).
func tracedClient(c *http.Client) *http.Client {
	cc := *c
	cc.Transport = telemetry.Transport(c.Transport)
	return &cc
}
