package up

// The platform's observability: tracing installed at start, and one
// metrics listener each for the control plane, the edge and the node (its
// workers' series, labelled worker).

import (
	"context"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacesbx/space/internal/telemetry"
)

// startObservability installs the tracer provider (a no-op one without an
// exporter) before any component starts.
func (p *Platform) startObservability() error {
	tc := p.cfg.Tracing
	if tc.ServiceName == "" {
		tc.ServiceName = "space-up"
	}
	tp, err := telemetry.Setup(context.Background(), tc)
	if err != nil {
		return fmt.Errorf("up: %w", err)
	}
	p.tracer = tp
	return nil
}

// serveMetrics binds the three metrics listeners and serves them until
// ctx ends.
func (p *Platform) serveMetrics(ctx context.Context) error {
	if err := p.cp.Metrics().Register(p.st.Collector()); err != nil {
		return fmt.Errorf("up: metrics: %w", err)
	}
	for _, l := range []struct {
		name, addr string
		g          prometheus.Gatherer
		url        *string
	}{
		{"control plane", p.cfg.APIMetricsAddr, p.cp.Metrics(), &p.APIMetricsURL},
		{"edge", p.cfg.EdgeMetricsAddr, p.edge.Metrics(), &p.EdgeMetricsURL},
		{"node", p.cfg.NodeMetricsAddr, p.host.Metrics(), &p.NodeMetricsURL},
	} {
		ms, err := telemetry.ListenMetrics(l.addr, l.g, p.cfg.Logger)
		if err != nil {
			return fmt.Errorf("up: %s %w", l.name, err)
		}
		if ms == nil {
			continue
		}
		*l.url = ms.URL()
		p.goRun(l.name+" metrics", func() error { return ms.Run(ctx) })
	}
	return nil
}
