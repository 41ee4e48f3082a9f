// Package e2bapi holds the JSON wire format of SPACE's E2B-compatible REST
// API, field for field as the published `e2b` SDKs send and read it
// (openapi schema of e2b 2.x: NewSandbox, NewSandboxV2, Sandbox,
// SandboxDetail, ListedSandbox, Error).
package e2bapi

import (
	"encoding/json"
	"time"
)

// Header names.
const (
	HeaderAPIKey       = "X-API-Key"
	HeaderAccessToken  = "X-Access-Token"
	HeaderNextToken    = "X-Next-Token"
	HeaderTotalRunning = "X-Total-Running"
)

// Sandbox states as E2B reports them.
const (
	StateRunning = "running"
	StatePaused  = "paused"
)

// Pagination bounds of GET /v2/sandboxes (E2B's paginationLimit).
const (
	DefaultLimit = 100
	MaxLimit     = 100
)

// NewSandbox is the body of POST /sandboxes (v1) and POST /v2/sandboxes.
// v2 ignores Secure: every v2 sandbox gets an envd access token.
type NewSandbox struct {
	TemplateID string `json:"templateID"`
	// Timeout is the time to live in seconds (nil: server default).
	Timeout  *int32            `json:"timeout,omitempty"`
	Metadata map[string]string `json:"metadata,omitempty"`
	EnvVars  map[string]string `json:"envVars,omitempty"`
	// Secure asks for an envd access token (v1 only).
	Secure              *bool                `json:"secure,omitempty"`
	AutoPause           *bool                `json:"autoPause,omitempty"`
	AutoPauseMemory     *bool                `json:"autoPauseMemory,omitempty"`
	AutoResume          *AutoResumeConfig    `json:"autoResume,omitempty"`
	AllowInternetAccess *bool                `json:"allow_internet_access,omitempty"`
	Network             json.RawMessage      `json:"network,omitempty"`
	Mcp                 json.RawMessage      `json:"mcp,omitempty"`
	Iam                 json.RawMessage      `json:"iam,omitempty"`
	VolumeMounts        []SandboxVolumeMount `json:"volumeMounts,omitempty"`
}

// AutoResumeConfig is E2B's SandboxAutoResumeConfig.
type AutoResumeConfig struct {
	Enabled bool `json:"enabled"`
}

// SandboxVolumeMount is E2B's volume mount request entry.
type SandboxVolumeMount struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

// Sandbox answers a create (201).
type Sandbox struct {
	SandboxID          string  `json:"sandboxID"`
	TemplateID         string  `json:"templateID"`
	Alias              string  `json:"alias,omitempty"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken,omitempty"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
	Domain             *string `json:"domain"`
}

// SandboxForkResult is one entry of POST /sandboxes/{sandboxID}/fork's
// answer: exactly one of Sandbox and Error is set.
type SandboxForkResult struct {
	Sandbox *Sandbox `json:"sandbox,omitempty"`
	Error   *Error   `json:"error,omitempty"`
}

// SandboxLifecycle is E2B's lifecycle block of a sandbox detail.
type SandboxLifecycle struct {
	AutoResume bool   `json:"autoResume"`
	OnTimeout  string `json:"onTimeout"` // "kill" | "pause"
}

// SandboxDetail answers GET /sandboxes/{sandboxID}.
type SandboxDetail struct {
	SandboxID       string               `json:"sandboxID"`
	TemplateID      string               `json:"templateID"`
	Alias           string               `json:"alias,omitempty"`
	ClientID        string               `json:"clientID"`
	CPUCount        int                  `json:"cpuCount"`
	MemoryMB        int                  `json:"memoryMB"`
	DiskSizeMB      int                  `json:"diskSizeMB"`
	Domain          *string              `json:"domain"`
	StartedAt       time.Time            `json:"startedAt"`
	EndAt           time.Time            `json:"endAt"`
	EnvdVersion     string               `json:"envdVersion"`
	EnvdAccessToken string               `json:"envdAccessToken,omitempty"`
	Metadata        map[string]string    `json:"metadata,omitempty"`
	State           string               `json:"state"`
	Lifecycle       *SandboxLifecycle    `json:"lifecycle,omitempty"`
	VolumeMounts    []SandboxVolumeMount `json:"volumeMounts"`
	// AllowInternetAccess and Network echo the sandbox's network options
	// (egressProxy without its password).
	AllowInternetAccess *bool           `json:"allowInternetAccess,omitempty"`
	Network             *SandboxNetwork `json:"network,omitempty"`
}

// SandboxNetwork is E2B's SandboxNetworkConfig as GET /sandboxes/{id}
// returns it.
type SandboxNetwork struct {
	AllowOut           []string                 `json:"allowOut,omitempty"`
	DenyOut            []string                 `json:"denyOut,omitempty"`
	Rules              map[string][]NetworkRule `json:"rules,omitempty"`
	EgressProxy        *EgressProxyInfo         `json:"egressProxy,omitempty"`
	AllowPublicTraffic *bool                    `json:"allowPublicTraffic,omitempty"`
	MaskRequestHost    string                   `json:"maskRequestHost,omitempty"`
	HTTPSPorts         []int                    `json:"httpsPorts,omitempty"`
}

// NetworkRule is E2B's SandboxNetworkRule.
type NetworkRule struct {
	Transform *NetworkTransform `json:"transform,omitempty"`
}

// NetworkTransform is E2B's SandboxNetworkTransform.
type NetworkTransform struct {
	Headers map[string]string `json:"headers,omitempty"`
}

// EgressProxyInfo is an egress proxy without its password (the API never
// returns it).
type EgressProxyInfo struct {
	Address  string `json:"address"`
	Username string `json:"username,omitempty"`
}

// ListedSandbox is one entry of GET /sandboxes and GET /v2/sandboxes.
type ListedSandbox struct {
	SandboxID    string               `json:"sandboxID"`
	TemplateID   string               `json:"templateID"`
	Alias        string               `json:"alias,omitempty"`
	ClientID     string               `json:"clientID"`
	CPUCount     int                  `json:"cpuCount"`
	MemoryMB     int                  `json:"memoryMB"`
	DiskSizeMB   int                  `json:"diskSizeMB"`
	StartedAt    time.Time            `json:"startedAt"`
	EndAt        time.Time            `json:"endAt"`
	EnvdVersion  string               `json:"envdVersion"`
	Metadata     map[string]string    `json:"metadata,omitempty"`
	State        string               `json:"state"`
	VolumeMounts []SandboxVolumeMount `json:"volumeMounts"`
}

// TimeoutRequest is the body of POST /sandboxes/{sandboxID}/timeout.
type TimeoutRequest struct {
	// Timeout in seconds from now.
	Timeout int32 `json:"timeout"`
}

// Error is the body of every error response: Code repeats the HTTP status.
type Error struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// SandboxMetric is one entry of GET /sandboxes/{sandboxID}/metrics.
type SandboxMetric struct {
	Timestamp     time.Time `json:"timestamp"`
	TimestampUnix int64     `json:"timestampUnix"`
	CPUCount      int       `json:"cpuCount"`
	CPUUsedPct    float64   `json:"cpuUsedPct"`
	MemUsed       int64     `json:"memUsed"`
	MemTotal      int64     `json:"memTotal"`
	MemCache      int64     `json:"memCache"`
	DiskUsed      int64     `json:"diskUsed"`
	DiskTotal     int64     `json:"diskTotal"`
}
