// Package events records SPACE's sandbox lifecycle events (E2B's events
// API) and delivers them to webhooks.
//
// Events are derived from the committed sandbox records rather than
// emitted by each lifecycle handler: every state change a control plane
// commits is in etcd's history, so the recorder (one per cluster, elected
// through etcd) reads that history from its durable cursor and records
// the events together with the cursor in one transaction. A crash of any
// control plane loses nothing (the history is the outbox) and records
// nothing twice. Each event a webhook subscribes to becomes a delivery in
// the same transaction; the dispatcher (the same elected process) posts
// the deliveries, signed, retried with exponential backoff and kept in
// etcd until acknowledged or given up, so a restart resumes them.
package events

import (
	"encoding/json"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/store"
)

// Lifecycle operation kinds as the control plane names them
// (store.LifecycleOp.Kind).
const (
	opSnapshot = "snapshot"
)

// observed is the recorder's digest of the last record of a sandbox it
// derived events from.
type observed struct {
	State string `json:"s"`
	// Stable is the last running or paused state seen.
	Stable string    `json:"st,omitempty"`
	Gen    uint64    `json:"g,omitempty"`
	EndAt  time.Time `json:"e,omitzero"`
	// Op is the kind of the lifecycle operation seen in flight since
	// Stable (cleared when the record is stable again).
	Op      string `json:"op,omitempty"`
	Created bool   `json:"c,omitempty"`
	Ended   bool   `json:"x,omitempty"`
	// Team, Template and Exec name the sandbox for an event written
	// after its record is gone.
	Team     string `json:"t,omitempty"`
	Template string `json:"tp,omitempty"`
	Exec     string `json:"ex,omitempty"`
	Worker   string `json:"w,omitempty"`
}

// sandbox is the little of a record the digest of sandbox id keeps.
func (o observed) sandbox(id string) store.SandboxRecord {
	return store.SandboxRecord{ID: id, TeamID: o.Team, TemplateID: o.Template,
		Route: identity.Route{SandboxID: id, Generation: o.Gen, ExecutionID: o.Exec, WorkerID: o.Worker}}
}

// derived is one event a record change causes.
type derived struct {
	Type string
	Data e2bapi.EventData
}

// derive returns the digest of rec and the events the change from p to
// rec means. It is a pure function: the recorder replays it on restart
// and gets the same answer, so it never records an event twice.
func derive(p observed, rec store.SandboxRecord) (observed, []derived) {
	n := p
	n.State = string(rec.State)
	n.Team, n.Template, n.Exec, n.Worker = rec.TeamID, rec.TemplateID, rec.Route.ExecutionID, rec.Route.WorkerID
	meta := rec.Metadata
	exec := func(at time.Time) *e2bapi.EventExecution {
		started := rec.StartedAt
		if started.IsZero() {
			started = rec.CreatedAt
		}
		ms := int64(0)
		if !at.IsZero() && at.After(started) {
			ms = at.Sub(started).Milliseconds()
		}
		return &e2bapi.EventExecution{StartedAt: started.UTC(), VCPUCount: rec.CPUCount, MemoryMB: rec.MemoryMB, ExecutionTime: ms}
	}
	base := func(reason string) e2bapi.EventData {
		return e2bapi.EventData{SandboxMetadata: meta, Reason: reason, Generation: rec.Route.Generation, WorkerID: rec.Route.WorkerID}
	}
	var out []derived
	switch {
	case rec.State == store.StateCreating:
	case rec.State.Terminal():
		if p.Created && !p.Ended {
			d := base(rec.Reason)
			d.Execution = exec(rec.EndedAt)
			out = append(out, derived{e2bapi.EventKilled, d})
		}
		n.Ended, n.Op = true, ""
	case rec.State.Transitional():
		if rec.Op != nil {
			n.Op = rec.Op.Kind
		}
	default: // running or paused
		state := string(rec.State)
		switch {
		case !p.Created:
			out = append(out, derived{e2bapi.EventCreated, base("")})
			n.Created = true
			if rec.State == store.StatePaused {
				d := base("")
				d.Execution = exec(time.Time{})
				out = append(out, derived{e2bapi.EventPaused, d})
			}
		case p.Stable == string(store.StateRunning) && rec.State == store.StatePaused:
			d := base("")
			d.Execution = exec(time.Time{})
			if ex := lastExecEnd(rec); !ex.IsZero() {
				d.Execution = exec(ex)
			}
			out = append(out, derived{e2bapi.EventPaused, d})
		case p.Stable == string(store.StatePaused) && rec.State == store.StateRunning:
			out = append(out, derived{e2bapi.EventResumed, base("")})
		case p.Op == opSnapshot:
			out = append(out, derived{e2bapi.EventCheckpointed, base("")})
		case rec.Route.Generation != p.Gen && p.Gen != 0:
			out = append(out, derived{e2bapi.EventUpdated, base("moved")})
		case !rec.EndAt.Equal(p.EndAt) && p.Op == "" && rec.State == store.StateRunning:
			d := base("timeout")
			t := rec.EndAt.UTC()
			d.Timeout = &t
			out = append(out, derived{e2bapi.EventUpdated, d})
		}
		n.Stable, n.Op, n.Gen, n.EndAt = state, "", rec.Route.Generation, rec.EndAt
	}
	return n, out
}

// lastExecEnd is when the record's newest execution ended (zero if it
// has not).
func lastExecEnd(rec store.SandboxRecord) time.Time {
	for i := len(rec.Executions) - 1; i >= 0; i-- {
		if e := rec.Executions[i].EndedAt; e != nil {
			return *e
		}
	}
	return time.Time{}
}

func decodeObserved(b []byte) observed {
	var o observed
	_ = json.Unmarshal(b, &o) // an unreadable digest is a sandbox never seen
	return o
}
