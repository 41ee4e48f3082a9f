package spacev1

import (
	"time"

	"github.com/spacesbx/space/internal/identity"
)

// NodePathMetricsRange reads the samples a worker kept of an execution's
// resource usage (body MetricsRangeRequest, answer MetricsRangeResponse).
// It changes nothing.
const NodePathMetricsRange = "/space/node/v1/executions/metrics/range"

// MetricsRangeRequest asks for the samples of Route taken in [Start, End]
// (a zero bound is open).
type MetricsRangeRequest struct {
	Route identity.Route `json:"route"`
	Start time.Time      `json:"start,omitzero"`
	End   time.Time      `json:"end,omitzero"`
	// Last, when positive, keeps only the Last newest samples of the
	// window (the control plane's "latest sample" reads).
	Last int `json:"last,omitempty"`
}

// MetricsRangeResponse holds the samples, oldest first. The worker samples
// every execution it runs at a fixed interval (sbxmanager.Config.
// SampleInterval) and keeps them for SampleRetention; an execution with no
// sample yet answers one taken now.
type MetricsRangeResponse struct {
	Samples []MetricsResponse `json:"samples"`
}
