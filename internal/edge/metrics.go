package edge

// The edge's Prometheus metrics (served on its own /metrics) and the
// response-status recording they need.

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacesbx/space/internal/telemetry"
)

type metrics struct {
	reg        *prometheus.Registry
	requests   *prometheus.CounterVec
	repairs    *prometheus.CounterVec
	denies     *prometheus.CounterVec
	retries    prometheus.Counter
	renewals   prometheus.Counter
	capFetches *prometheus.CounterVec
	// cpFailovers counts control-plane calls moved to another replica.
	cpFailovers prometheus.Counter
	reattaches  *prometheus.CounterVec
	heldBytes   prometheus.Gauge
	bodyRejects *prometheus.CounterVec
}

func newMetrics() *metrics {
	m := &metrics{
		reg: telemetry.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_edge_requests_total", Help: "Sandbox requests by purpose and response status.",
		}, []string{"purpose", "code"}),
		repairs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_edge_route_repairs_total", Help: "RefreshRoute answers and what the edge did with them.",
		}, []string{"result"}),
		denies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_edge_denies_total", Help: "Deny answers from receivers, by purpose.",
		}, []string{"purpose"}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "space_edge_transport_retries_total", Help: "Idempotent reads retried after a transport failure.",
		}),
		renewals: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "space_edge_capability_renewals_total", Help: "Capabilities renewed before expiry.",
		}),
		capFetches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_edge_capability_requests_total", Help: "Capability requests to the control plane.",
		}, []string{"kind", "result"}),
		reattaches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_edge_stream_reattaches_total",
			Help: "Process streams whose execution was replaced, by outcome (reattached, process_gone, failed, client_gone).",
		}, []string{"result"}),
	}
	m.heldBytes = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "space_edge_held_body_bytes", Help: "Request-body bytes reserved in the buffered-body budget.",
	})
	m.bodyRejects = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "space_edge_body_rejections_total",
		Help: "Request bodies refused or cut, by reason (budget: no budget left; timeout: stalled or too slow).",
	}, []string{"reason"})
	m.cpFailovers = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "space_edge_control_plane_failovers_total", Help: "Control-plane calls sent to another replica because one could not answer.",
	})
	m.reg.MustRegister(m.cpFailovers)
	m.reg.MustRegister(m.requests, m.repairs, m.denies, m.retries, m.renewals, m.capFetches, m.reattaches, m.heldBytes, m.bodyRejects)
	return m
}

// statusLabel is the metrics label of HTTP status n: the code itself, or
// "other" outside 100-999 (a bounded label set).
func statusLabel(n int) string {
	if n >= 100 && n <= 999 {
		return strconv.Itoa(n)
	}
	return "other"
}

// statusClientClosed is the code counted for a request that ended before
// any answer was written (the client went away).
const statusClientClosed = 499
