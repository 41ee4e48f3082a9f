package sbxmanager

// Observability of the data plane: the admission span (with the identity
// decision as its attributes) and the per-sandbox and per-state series,
// collected at scrape time from the activations that exist then, so a
// sandbox's series disappear with it and their number is bounded by the
// worker's capacity.

import (
	"context"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/telemetry"
)

// traceDecision records ad on ctx's span (the receiver's admission span):
// outcome, reason, and the sandbox and generation the capability named.
func traceDecision(ctx context.Context, ad Admission) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(telemetry.AttrDecision.String(ad.Decision.Outcome.String()), telemetry.AttrReason.String(ad.Decision.Reason))
	if ad.Claims.SandboxID != "" {
		span.SetAttributes(telemetry.AttrSandbox.String(ad.Claims.SandboxID), telemetry.AttrGeneration.Int64(int64(ad.Claims.Generation)))
	}
}

// usage is an activation's data-plane counters (requests, body bytes in
// and out through the worker).
type usage struct {
	requests, rxBytes, txBytes atomic.Int64
}

// countingBody counts the request body bytes read into u.rxBytes.
type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (c countingBody) Read(p []byte) (int, error) {
	n, err := c.ReadCloser.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// statsTimeout bounds one scrape's resource sampling; statsParallel bounds
// the samples taken at once.
const (
	statsTimeout  = 3 * time.Second
	statsParallel = 8
)

var (
	descSandboxes = prometheus.NewDesc("space_node_sandboxes", "Executions on this worker by state (running, paused).", []string{"state"}, nil)
	descRequests  = prometheus.NewDesc("space_sandbox_requests_total", "Guest API requests admitted for the sandbox's current execution on this worker.", []string{"sandbox"}, nil)
	descNetBytes  = prometheus.NewDesc("space_sandbox_network_bytes_total", "Data-plane body bytes through the worker for the sandbox (rx: to the sandbox, tx: from it).", []string{"sandbox", "direction"}, nil)
	descCPU       = prometheus.NewDesc("space_sandbox_cpu_used_percent", "CPU used over the last sampling interval, percent of one core.", []string{"sandbox"}, nil)
	descMem       = prometheus.NewDesc("space_sandbox_memory_used_bytes", "Memory charged to the sandbox.", []string{"sandbox"}, nil)
	descMemLimit  = prometheus.NewDesc("space_sandbox_memory_limit_bytes", "The sandbox's memory limit.", []string{"sandbox"}, nil)
)

// sandboxCollector reports the series of the activations that exist at
// scrape time.
type sandboxCollector struct{ m *Manager }

func (c sandboxCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descSandboxes, descRequests, descNetBytes, descCPU, descMem, descMemLimit} {
		ch <- d
	}
}

func (c sandboxCollector) Collect(ch chan<- prometheus.Metric) {
	c.m.mu.RLock()
	acts := make([]*activation, 0, len(c.m.active))
	for _, a := range c.m.active {
		acts = append(acts, a)
	}
	c.m.mu.RUnlock()
	var running, paused float64
	for _, a := range acts {
		if a.paused.Load() {
			paused++
		} else {
			running++
		}
		id := a.route.SandboxID
		ch <- prometheus.MustNewConstMetric(descRequests, prometheus.CounterValue, float64(a.use.requests.Load()), id)
		ch <- prometheus.MustNewConstMetric(descNetBytes, prometheus.CounterValue, float64(a.use.rxBytes.Load()), id, "rx")
		ch <- prometheus.MustNewConstMetric(descNetBytes, prometheus.CounterValue, float64(a.use.txBytes.Load()), id, "tx")
	}
	ch <- prometheus.MustNewConstMetric(descSandboxes, prometheus.GaugeValue, running, "running")
	ch <- prometheus.MustNewConstMetric(descSandboxes, prometheus.GaugeValue, paused, "paused")
	ctx, cancel := context.WithTimeout(context.Background(), statsTimeout)
	defer cancel()
	sem := make(chan struct{}, statsParallel)
	var wg sync.WaitGroup
	for _, a := range acts {
		sr, ok := a.inst.(substrate.StatsReporter)
		if !ok || a.ctx.Err() != nil {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			st, err := sr.Stats(ctx)
			if err != nil {
				return // stopped meanwhile: no series
			}
			id := a.route.SandboxID
			ch <- prometheus.MustNewConstMetric(descCPU, prometheus.GaugeValue, st.CPUUsedPct, id)
			ch <- prometheus.MustNewConstMetric(descMem, prometheus.GaugeValue, float64(st.MemUsed), id)
			ch <- prometheus.MustNewConstMetric(descMemLimit, prometheus.GaugeValue, float64(st.MemTotal), id)
		}()
	}
	wg.Wait()
}
