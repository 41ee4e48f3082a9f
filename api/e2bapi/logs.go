package e2bapi

import "time"

// Log levels (E2B's LogLevel), lowest first.
const (
	LogDebug = "debug"
	LogInfo  = "info"
	LogWarn  = "warn"
	LogError = "error"
)

// LogLevelRank orders the levels (-1: unknown).
func LogLevelRank(l string) int {
	switch l {
	case LogDebug:
		return 0
	case LogInfo:
		return 1
	case LogWarn:
		return 2
	case LogError:
		return 3
	}
	return -1
}

// Log directions (E2B's LogsDirection).
const (
	LogsForward  = "forward"
	LogsBackward = "backward"
)

// Log line sources (SandboxLogEntry.fields["source"]).
const (
	LogSourcePlatform = "platform"
	LogSourceAgent    = "agent"
)

// SandboxLogEntry is one structured log line.
type SandboxLogEntry struct {
	Fields    map[string]string `json:"fields"`
	Level     string            `json:"level"`
	Message   string            `json:"message"`
	Timestamp time.Time         `json:"timestamp"`
}

// SandboxLogsV2Response is GET /v2/sandboxes/{id}/logs.
type SandboxLogsV2Response struct {
	Logs []SandboxLogEntry `json:"logs"`
}

// SandboxLog is a v1 plain log line.
type SandboxLog struct {
	Line      string    `json:"line"`
	Timestamp time.Time `json:"timestamp"`
}

// SandboxLogs is GET /sandboxes/{id}/logs (v1).
type SandboxLogs struct {
	LogEntries []SandboxLogEntry `json:"logEntries"`
	Logs       []SandboxLog      `json:"logs"`
}
