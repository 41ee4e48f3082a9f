// Package spacev1 holds the JSON wire contracts of SPACE's own APIs: the
// control plane's extensions under /space/v1 and the node API the control
// plane uses to install and tear down executions on workers. The
// E2B-compatible REST contract lives in package e2bapi.
package spacev1

import (
	"time"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/netpolicy"
)

// Header names.
const (
	// HeaderCapability carries a capability token from the edge (or the
	// control plane) to node-api.
	HeaderCapability = "Space-Capability"
	// HeaderRouteOutcome tells the caller how a receiver judged the
	// capability: "refresh-route" (HTTP 421) or "deny" (HTTP 403).
	HeaderRouteOutcome = "Space-Route-Outcome"
	// HeaderRequestHost carries, from the edge to netgtw, the Host a
	// sandbox's service sees: the client's, or the sandbox's
	// maskRequestHost. The edge replaces any value a client sent.
	HeaderRequestHost = "Space-Request-Host"
	// HeaderExecution is set by spaced-host on every response:
	// "<sandbox>/<generation>/<execution_id>" as reported by the guest.
	HeaderExecution = "Space-Execution"
	// HeaderAPIKey authenticates callers of the control plane (E2B's name).
	HeaderAPIKey = "X-API-Key"
	// HeaderAccessToken is the sandbox's envd access token (E2B's name).
	HeaderAccessToken = "X-Access-Token"
)

// Route outcomes on the wire.
const (
	OutcomeRefreshRoute = "refresh-route"
	OutcomeDeny         = "deny"
)

// Error is the JSON body of every error SPACE returns over HTTP.
// Code is the HTTP status (E2B's convention); Reason is a stable
// machine-readable class for SPACE's own clients.
type Error struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
	Reason  string `json:"reason,omitempty"`
}

// CapabilityRequest is the body of POST /space/v1/sandboxes/{id}/capabilities.
type CapabilityRequest struct {
	Purpose  string `json:"purpose"`
	Port     int    `json:"port,omitempty"`
	Protocol string `json:"protocol,omitempty"`
	// Repair asks for the current route after a RefreshRoute. Only the
	// edge's service key may set it; it authorizes nothing new and the
	// response's AuthorizedUntil must not be used to extend a cache entry.
	Repair bool `json:"repair,omitempty"`
}

// CapabilityResponse answers a CapabilityRequest.
type CapabilityResponse struct {
	Token string         `json:"token"`
	Route identity.Route `json:"route"`
	// NodeURL is the base URL of the selected worker's node-api.
	NodeURL string `json:"node_url"`
	// ExpiresAt is the token's expiry.
	ExpiresAt time.Time `json:"expires_at"`
	// AuthorizedUntil bounds how long the caller's authorization may be
	// cached by the edge (never past the sandbox's end).
	AuthorizedUntil time.Time `json:"authorized_until"`
	EnvdVersion     string    `json:"envd_version,omitempty"`
	// MaskRequestHost is the sandbox's network.maskRequestHost (service
	// ports): the Host its services see, "${PORT}" standing for the port.
	MaskRequestHost string `json:"mask_request_host,omitempty"`
}

// Worker is one entry of GET /space/v1/workers.
type Worker struct {
	ID       string    `json:"id"`
	NodeURL  string    `json:"node_url"`
	State    string    `json:"state"` // "ready", "draining"
	Capacity int       `json:"capacity"`
	Load     int       `json:"load"`
	Since    time.Time `json:"since"`
	// Substrates the worker runs (identity.SubstrateNS, ...); empty means
	// ns only (workers that predate the field).
	Substrates []string `json:"substrates,omitempty"`
	// Unavailable names the substrates this worker has but cannot run,
	// with the reason (e.g. "microvm": "no working accelerator (kvm: ...;
	// tcg: ...)"); they are not in Substrates.
	Unavailable map[string]string `json:"unavailable,omitempty"`
	// Accelerators names the accelerator each substrate in Substrates that
	// has one runs on ("microvm": "kvm" or "tcg"), as found by booting a
	// probe guest at start-up.
	Accelerators map[string]string `json:"accelerators,omitempty"`
}

// Serves reports whether w runs sandboxes of substrate.
func (w Worker) Serves(substrate string) bool {
	if len(w.Substrates) == 0 {
		return substrate == identity.SubstrateNS
	}
	for _, s := range w.Substrates {
		if s == substrate {
			return true
		}
	}
	return false
}

// Execution is one entry of GET /space/v1/sandboxes/{id}/executions.
type Execution struct {
	Route     identity.Route `json:"route"`
	State     string         `json:"state"` // "running", "paused", "retired", "killed"
	StartedAt time.Time      `json:"started_at"`
	EndedAt   *time.Time     `json:"ended_at,omitempty"`
}

// Limits are per-sandbox resource limits; zero means the worker's default.
type Limits struct {
	MemoryBytes int64 `json:"memory_bytes,omitempty"`
	Pids        int64 `json:"pids,omitempty"`
	CPUMillis   int64 `json:"cpu_millis,omitempty"`
	// DiskBytes caps the writable layer (the template's diskSizeMB).
	DiskBytes int64 `json:"disk_bytes,omitempty"`
}

// InstallRequest is the body of POST /space/node/v1/executions: the control
// plane asks a worker to persist and activate an execution. The request
// carries a control-purpose capability for that worker in HeaderCapability.
type InstallRequest struct {
	Route    identity.Route    `json:"route"`
	Template string            `json:"template"`
	EnvVars  map[string]string `json:"env_vars,omitempty"`
	Limits   Limits            `json:"limits"`
	// RestoreSnapshot, when set, restores the writable layer from that
	// snapshot before the sandbox starts (resume elsewhere: files kept,
	// processes restarted).
	RestoreSnapshot string `json:"restore_snapshot,omitempty"`
	// Network, when set, gives the execution a link to the worker's
	// egress proxy under that policy; nil: loopback only.
	Network *Network `json:"network,omitempty"`
	// Image, when set, is the root file system: an OCI image the worker
	// pulls (once per layer) into its layer store; nil runs Template's
	// own. It carries registry credentials: never log it.
	Image *ImageSource `json:"image,omitempty"`
	// Volumes are the team volumes the execution mounts (every execution
	// of the sandbox: they come from its record).
	Volumes []VolumeMount `json:"volumes,omitempty"`
}

// ImageSource names an OCI image and the credentials to pull it with.
type ImageSource struct {
	Ref      string `json:"ref"`
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
}

// VolumeMount is one volume an execution mounts: the worker resolves ID to
// the volume's files and mounts them at Path inside the sandbox.
type VolumeMount struct {
	ID       string `json:"id"`
	Name     string `json:"name"`
	Path     string `json:"path"`
	ReadOnly bool   `json:"read_only,omitempty"`
}

// Network is an execution's egress configuration as a worker enforces it.
// Spec has its secret placeholders resolved (it carries secret values:
// never log it). CAKey is the sandbox's interception CA key; only
// CACert reaches the sandbox.
type Network struct {
	Spec   netpolicy.Spec `json:"spec"`
	CACert string         `json:"ca_cert,omitempty"`
	CAKey  string         `json:"ca_key,omitempty"`
}

// NetworkRequest is the body of POST /space/node/v1/executions/network:
// replace the running execution's egress policy (E2B updateNetwork). Live
// connections the new policy denies are cut before the worker answers.
type NetworkRequest struct {
	Route   identity.Route `json:"route"`
	Network Network        `json:"network"`
}

// InstallResponse answers an install once the runtime record is persisted
// and the guest is serving.
type InstallResponse struct {
	Route       identity.Route `json:"route"`
	EnvdVersion string         `json:"envd_version"`
	// ProcessesKept: the execution was restored from its snapshot's whole
	// state (a substrate that saves state), so its processes kept
	// running; otherwise a restore brought back files only.
	ProcessesKept bool `json:"processes_kept,omitempty"`
}

// TeardownRequest is the body of POST /space/node/v1/executions/teardown:
// stop the execution and delete its record (kill).
type TeardownRequest struct {
	Route identity.Route `json:"route"`
}

// Node API paths.
const (
	NodePathInstall  = "/space/node/v1/executions"
	NodePathTeardown = "/space/node/v1/executions/teardown"
	NodePathHealth   = "/space/node/v1/health"
)

// Lifecycle calls from the control plane to a worker. Each carries a
// control capability for exactly the route in its body.
const (
	// NodePathPause freezes the execution (same execution, processes kept).
	NodePathPause = "/space/node/v1/executions/pause"
	// NodePathResume thaws a paused execution on the same worker.
	NodePathResume = "/space/node/v1/executions/resume"
	// NodePathSnapshot archives the execution's writable layer into the
	// snapshot store under SnapshotRequest.SnapshotID. The execution must
	// be paused (so the layer is quiescent).
	NodePathSnapshot = "/space/node/v1/executions/snapshot"
	// NodePathRetire marks the execution retired (persisted) and stops it:
	// from then on the worker answers RefreshRoute for it, even for
	// unexpired capabilities, and its streams end.
	NodePathRetire = "/space/node/v1/executions/retire"
	// NodePathMetrics reads the execution's current resource usage (body
	// LifecycleRequest, answer MetricsResponse). It changes nothing.
	NodePathMetrics = "/space/node/v1/executions/metrics"
	// NodePathNetwork replaces the execution's egress policy (NetworkRequest).
	NodePathNetwork = "/space/node/v1/executions/network"
)

// LifecycleRequest is the body of pause, resume and retire.
type LifecycleRequest struct {
	Route identity.Route `json:"route"`
}

// SnapshotRequest is the body of NodePathSnapshot.
type SnapshotRequest struct {
	Route      identity.Route `json:"route"`
	SnapshotID string         `json:"snapshot_id"`
}

// SnapshotResponse answers a snapshot.
type SnapshotResponse struct {
	SnapshotID string `json:"snapshot_id"`
	SizeBytes  int64  `json:"size_bytes"`
}

// MetricsResponse answers NodePathMetrics: one sample of the execution's
// resource usage, taken by the worker at Timestamp. DiskTotal is 0 when the
// substrate has no disk size of its own (the control plane fills in the
// template's nominal size).
type MetricsResponse struct {
	Timestamp  time.Time `json:"timestamp"`
	CPUCount   int       `json:"cpu_count"`
	CPUUsedPct float64   `json:"cpu_used_pct"`
	MemUsed    int64     `json:"mem_used"`
	MemTotal   int64     `json:"mem_total"`
	MemCache   int64     `json:"mem_cache"`
	DiskUsed   int64     `json:"disk_used"`
	DiskTotal  int64     `json:"disk_total"`
}

// ReasonExecutionReplaced is the reason (and Connect error message prefix)
// with which streams of a replaced or retired execution end.
const ReasonExecutionReplaced = "execution replaced"

// ReasonExecutionLost is node-api's reason for an operation on an
// execution whose record the worker holds but whose processes are gone
// (the worker restarted): its files are on the worker's disk, so the
// control plane recovers it as a new execution instead of failing.
const ReasonExecutionLost = "execution_lost"

// ReasonPaused is the reason of a refusal because the sandbox is paused
// (node-api's 409 for a frozen execution, the control plane's 409 for a
// capability). The edge answers clients E2B's 502 with this reason.
const ReasonPaused = "paused"

// PathSignedFilesSandbox is where the edge asks which sandbox a signed
// /files URL that names none was signed for (POST, edge key, the URL's
// signature, signature_expiration, path, username and operation as the
// query). The e2b SDK builds such URLs on E2B_SANDBOX_URL.
const PathSignedFilesSandbox = "/space/v1/signed-files/sandbox"

// SignedFilesSandbox answers PathSignedFilesSandbox.
type SignedFilesSandbox struct {
	SandboxID string `json:"sandboxID"`
}
