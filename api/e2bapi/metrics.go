package e2bapi

import "time"

// SandboxesWithMetrics answers GET /sandboxes/metrics: the latest sample
// of each requested sandbox, by sandbox id (E2B's SandboxesWithMetrics).
type SandboxesWithMetrics struct {
	Sandboxes map[string]SandboxMetric `json:"sandboxes"`
}

// TeamMetric is one entry of GET /teams/{teamID}/metrics.
type TeamMetric struct {
	Timestamp           time.Time `json:"timestamp"`
	TimestampUnix       int64     `json:"timestampUnix"`
	ConcurrentSandboxes int       `json:"concurrentSandboxes"`
	// SandboxStartRate is sandboxes started per second over the sample's
	// interval.
	SandboxStartRate float64 `json:"sandboxStartRate"`
}

// MaxTeamMetric answers GET /teams/{teamID}/metrics/max.
type MaxTeamMetric struct {
	Timestamp     time.Time `json:"timestamp"`
	TimestampUnix int64     `json:"timestampUnix"`
	Value         float64   `json:"value"`
}

// Team metric names (the metric query parameter of /metrics/max).
const (
	MetricConcurrentSandboxes = "concurrent_sandboxes"
	MetricSandboxStartRate    = "sandbox_start_rate"
)

// SandboxRefreshRequest is the body of POST /sandboxes/{id}/refreshes.
type SandboxRefreshRequest struct {
	// Duration is how long from now the sandbox is kept alive, in
	// seconds (0..3600).
	Duration *int64 `json:"duration,omitempty"`
}
