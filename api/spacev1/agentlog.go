package spacev1

import "time"

// NodePathAgentLog reads the newest lines of the execution's agent log
// (spaced-host's, the sandbox's in-host agent; body LifecycleRequest,
// answer AgentLogResponse). A control capability for the route is
// required.
const NodePathAgentLog = "/space/node/v1/executions/agentlog"

// AgentLogLine is one line of an agent log.
type AgentLogLine struct {
	Time time.Time `json:"time"`
	// Level is debug, info, warn or error.
	Level   string `json:"level"`
	Message string `json:"message"`
}

// AgentLogResponse answers NodePathAgentLog: the newest lines, oldest
// first (bounded: see sbxmanager.MaxAgentLogLines).
type AgentLogResponse struct {
	Generation uint64         `json:"generation"`
	Lines      []AgentLogLine `json:"lines"`
}
