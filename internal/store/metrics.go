package store

// etcd request latency, measured on the store's client (unary calls: gets,
// puts, transactions, leases), for the control plane's metrics listener.

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
)

func newOpLatency() *prometheus.HistogramVec {
	return prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "space_etcd_request_duration_seconds",
		Help:    "etcd requests of this process's store by gRPC method and result (ok, error).",
		Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5},
	}, []string{"method", "result"})
}

// latencyInterceptor times every unary etcd call into h.
func latencyInterceptor(h *prometheus.HistogramVec) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		t := time.Now()
		err := invoker(ctx, method, req, reply, cc, opts...)
		result := "ok"
		if err != nil {
			result = "error"
		}
		h.WithLabelValues(method, result).Observe(time.Since(t).Seconds())
		return err
	}
}

// Collector is the store's etcd latency series; the control plane's
// metrics listener serves it.
func (s *Store) Collector() prometheus.Collector { return s.latency }
