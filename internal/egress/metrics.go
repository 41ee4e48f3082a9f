package egress

import "github.com/prometheus/client_golang/prometheus"

// metrics are always created (so the code never checks for nil) and
// registered only when Config.Registerer is set.
type metrics struct {
	conns   *prometheus.CounterVec
	queries *prometheus.CounterVec
	bytes   *prometheus.CounterVec
	active  prometheus.Gauge
	dial    prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		conns: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_egress_connections_total",
			Help: "Sandbox TCP connections by verdict (allow, deny, error) and reason.",
		}, []string{"verdict", "reason"}),
		queries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_egress_dns_queries_total",
			Help: "Sandbox DNS queries by verdict (allow, deny, error) and reason.",
		}, []string{"verdict", "reason"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_egress_bytes_total",
			Help: "Bytes relayed: out = sandbox to destination, in = destination to sandbox.",
		}, []string{"direction"}),
		active: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "space_egress_active_connections",
			Help: "Sandbox TCP connections currently relayed.",
		}),
		dial: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "space_egress_dial_seconds",
			Help:    "Time to connect to a destination (or through the upstream SOCKS5 proxy).",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 8),
		}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.conns, m.queries, m.bytes, m.active, m.dial} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}
