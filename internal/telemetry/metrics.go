package telemetry

// The metrics listener: each component (control plane, edge, node) serves
// Prometheus' /metrics on a listener of its own, at a fixed documented
// default address, apart from its API.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Default metrics addresses (docs/OPERATIONS.md), beside the API (3000) and
// the edge (3001).
const (
	DefaultControlPlaneMetricsAddr = "127.0.0.1:3090"
	DefaultEdgeMetricsAddr         = "127.0.0.1:3091"
	DefaultNodeMetricsAddr         = "127.0.0.1:3092"
)

// NewRegistry returns a registry holding the Go runtime and process
// collectors, for one process's metrics listener.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// MetricsServer serves GET /metrics of one gatherer on its own listener.
type MetricsServer struct {
	ln  net.Listener
	srv *http.Server
	log *slog.Logger
}

// ListenMetrics binds addr ("off" or "": no listener, nil server, nil
// error) for g. Run serves.
func ListenMetrics(addr string, g prometheus.Gatherer, log *slog.Logger) (*MetricsServer, error) {
	if addr == "" || addr == "off" {
		return nil, nil
	}
	if log == nil {
		log = slog.Default()
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics listener: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}))
	return &MetricsServer{ln: ln, log: log, srv: &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}}, nil
}

// Addr is the bound address ("" for a nil server).
func (m *MetricsServer) Addr() string {
	if m == nil {
		return ""
	}
	return m.ln.Addr().String()
}

// URL is the /metrics URL ("" for a nil server).
func (m *MetricsServer) URL() string {
	if m == nil {
		return ""
	}
	return "http://" + m.Addr() + "/metrics"
}

// Run serves until ctx ends (a nil server returns at once).
func (m *MetricsServer) Run(ctx context.Context) error {
	if m == nil {
		return nil
	}
	errc := make(chan error, 1)
	go func() { errc <- m.srv.Serve(m.ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := m.srv.Shutdown(sctx); err != nil {
		m.srv.Close()
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Close stops serving at once (and releases a listener Run never served).
func (m *MetricsServer) Close() error {
	if m == nil {
		return nil
	}
	m.ln.Close()
	return m.srv.Close()
}
