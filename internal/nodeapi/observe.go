package nodeapi

// node-api's spans (one server span per request, continuing the trace of
// the edge or control plane that called) and its series: control-call
// durations by operation and result, installs by result.

import (
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/telemetry"
)

type obs struct {
	ops      *prometheus.HistogramVec
	installs *prometheus.CounterVec
}

func newObs(reg prometheus.Registerer) *obs {
	o := &obs{
		ops: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "space_node_lifecycle_op_seconds", Help: "Control-plane calls on this worker (install, teardown, pause, resume, retire, snapshot, metrics, network) by op and result.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"op", "result"}),
		installs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "space_node_installs_total", Help: "Installs on this worker by result (ok or the error's reason).",
		}, []string{"result"}),
	}
	if reg != nil {
		reg.MustRegister(o.ops, o.installs)
	}
	return o
}

// controlDone records one control call (its op is the path's last part).
func (o *obs) controlDone(r *http.Request, start time.Time, err error) {
	op := r.URL.Path[strings.LastIndexByte(r.URL.Path, '/')+1:]
	if r.URL.Path == spacev1.NodePathInstall {
		op = "install"
	}
	result := "ok"
	if err != nil {
		result = errdefs.Reason(err)
	}
	o.ops.WithLabelValues(op, result).Observe(time.Since(start).Seconds())
	if op == "install" {
		o.installs.WithLabelValues(result).Inc()
	}
}

// traced wraps h in node-api's server span. Callers are SPACE's edge and
// control plane (every request is then admitted by capability), so their
// traceparent is the parent.
func (s *Server) traced(h http.Handler) http.Handler {
	return telemetry.Middleware(telemetry.ScopeNodeAPI, telemetry.Trusted, func(r *http.Request) string { return "node-api " + r.URL.Path }, h)
}
