package sbxmanager

// The manager's Prometheus metrics, and resource samples of one
// execution (the control plane's metrics call).

import (
	"context"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

// metrics are the manager's own series (registered with
// Config.Registerer).
type metrics struct {
	decisions     *prometheus.CounterVec
	bridgeRejects prometheus.Counter
	bridgeChecks  *prometheus.CounterVec
	activations   prometheus.Gauge
	// fenced is 1 while the worker is fenced (fence.go);
	// fencedRefusals counts the data-plane requests refused meanwhile.
	fenced         prometheus.Gauge
	fences         prometheus.Counter
	fencedRefusals prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_node_admission_decisions_total", Help: "Capability admission decisions by outcome.",
		}, []string{"outcome"}),
		bridgeRejects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "space_node_bridge_verification_failures_total", Help: "Bridge connections refused by peer verification.",
		}),
		bridgeChecks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_node_bridge_checks_total", Help: "Peer checks of new connections to spaced-host, by result (ok, rejected).",
		}, []string{"result"}),
		activations: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "space_node_activations", Help: "Running activations.",
		}),
		fenced: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "space_node_fenced", Help: "1 while the worker is fenced (its registration lease may have lapsed): it serves nothing.",
		}),
		fences: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "space_node_fences_total", Help: "Times the worker fenced itself (its registration lease renewals went unanswered past the deadline).",
		}),
		fencedRefusals: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "space_node_fenced_refusals_total", Help: "Data-plane requests refused (RefreshRoute) because the worker was fenced.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.decisions, m.bridgeRejects, m.bridgeChecks, m.activations, m.fenced, m.fences, m.fencedRefusals)
	}
	return m
}

// Metrics samples the resource usage of the execution named by route
// (running or paused). Substrates whose instances do not implement
// substrate.StatsReporter answer ErrUnavailable.
func (m *Manager) Metrics(ctx context.Context, route identity.Route) (spacev1.MetricsResponse, error) {
	if err := validRoute("metrics", route); err != nil {
		return spacev1.MetricsResponse{}, err
	}
	act, err := m.liveActivation("metrics", route)
	if err != nil {
		return spacev1.MetricsResponse{}, err
	}
	sr, ok := act.inst.(substrate.StatsReporter)
	if !ok {
		return spacev1.MetricsResponse{}, fmt.Errorf("metrics %s: %w: substrate %s reports no metrics", route.SandboxID, errdefs.ErrUnavailable, route.Substrate)
	}
	st, err := sr.Stats(ctx)
	if err != nil {
		return spacev1.MetricsResponse{}, fmt.Errorf("metrics %s: %w: %v", route.SandboxID, errdefs.ErrUnavailable, err)
	}
	return spacev1.MetricsResponse{
		Timestamp: st.Timestamp.UTC(), CPUCount: st.CPUCount, CPUUsedPct: st.CPUUsedPct,
		MemUsed: st.MemUsed, MemTotal: st.MemTotal, MemCache: st.MemCache,
		DiskUsed: st.DiskUsed, DiskTotal: st.DiskTotal,
	}, nil
}
