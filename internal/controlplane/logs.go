package controlplane

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// Sandbox logs: the platform's lines (the sandbox's lifecycle events,
// rendered) and the agent's, merged by time.

// Bounds of the logs API.
const (
	defaultLogLimit = 100
	maxLogLimit     = 1000
	maxLogSearch    = 256
	// platformLogEvents bounds the events read for one request.
	platformLogEvents = 1000
)

// logQuery is a parsed logs request.
type logQuery struct {
	// Cursor is a time in Unix milliseconds: forward returns lines at or
	// after it, backward lines at or before it (zero: from the start,
	// resp. from now).
	Cursor   int64
	Limit    int
	Backward bool
	MinLevel int
	Search   string
}

// parseLogQuery reads the v2 query (cursor, limit, direction, level,
// search) or, v1, start and limit. Bad values are errdefs.ErrInvalid.
func parseLogQuery(q url.Values, v2 bool) (logQuery, error) {
	lq := logQuery{Limit: defaultLogLimit}
	cursorName := "start"
	if v2 {
		cursorName = "cursor"
	}
	if v := q.Get(cursorName); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return lq, fmt.Errorf("%w: %s must be a non-negative Unix time in milliseconds", errdefs.ErrInvalid, cursorName)
		}
		lq.Cursor = n
	}
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n > maxLogLimit {
			return lq, fmt.Errorf("%w: limit must be 0..%d", errdefs.ErrInvalid, maxLogLimit)
		}
		lq.Limit = n
	}
	if !v2 {
		return lq, nil
	}
	switch q.Get("direction") {
	case "", e2bapi.LogsForward:
	case e2bapi.LogsBackward:
		lq.Backward = true
	default:
		return lq, fmt.Errorf("%w: direction must be forward or backward", errdefs.ErrInvalid)
	}
	if v := q.Get("level"); v != "" {
		if lq.MinLevel = e2bapi.LogLevelRank(v); lq.MinLevel < 0 {
			return lq, fmt.Errorf("%w: level must be debug, info, warn or error", errdefs.ErrInvalid)
		}
	}
	if lq.Search = q.Get("search"); len(lq.Search) > maxLogSearch {
		return lq, fmt.Errorf("%w: search must be at most %d bytes", errdefs.ErrInvalid, maxLogSearch)
	}
	return lq, nil
}

// selectLogs filters the merged lines (sorted oldest first) by q.
func selectLogs(lines []e2bapi.SandboxLogEntry, q logQuery) []e2bapi.SandboxLogEntry {
	sort.SliceStable(lines, func(i, j int) bool { return lines[i].Timestamp.Before(lines[j].Timestamp) })
	keep := func(e e2bapi.SandboxLogEntry) bool {
		ms := e.Timestamp.UnixMilli()
		if q.Backward && q.Cursor > 0 && ms > q.Cursor || !q.Backward && ms < q.Cursor {
			return false
		}
		return e2bapi.LogLevelRank(e.Level) >= q.MinLevel && (q.Search == "" || strings.Contains(e.Message, q.Search))
	}
	out := make([]e2bapi.SandboxLogEntry, 0, min(q.Limit, len(lines)))
	if q.Backward {
		for i := len(lines) - 1; i >= 0 && len(out) < q.Limit; i-- {
			if keep(lines[i]) {
				out = append(out, lines[i])
			}
		}
		return out
	}
	for _, e := range lines {
		if len(out) >= q.Limit {
			break
		}
		if keep(e) {
			out = append(out, e)
		}
	}
	return out
}

// platformLine renders a lifecycle event as a log line.
func platformLine(ev e2bapi.SandboxEvent) e2bapi.SandboxLogEntry {
	var d e2bapi.EventData
	_ = json.Unmarshal(ev.EventData, &d)
	level, msg := e2bapi.LogInfo, ""
	switch ev.Type {
	case e2bapi.EventCreated:
		msg = fmt.Sprintf("sandbox created on worker %s (generation %d)", d.WorkerID, d.Generation)
	case e2bapi.EventPaused:
		msg = "sandbox paused"
	case e2bapi.EventResumed:
		msg = fmt.Sprintf("sandbox resumed on worker %s (generation %d)", d.WorkerID, d.Generation)
	case e2bapi.EventCheckpointed:
		msg = "sandbox snapshot taken"
	case e2bapi.EventUpdated:
		switch {
		case d.Reason == "moved":
			msg = fmt.Sprintf("sandbox moved to worker %s (generation %d)", d.WorkerID, d.Generation)
		case d.Timeout != nil:
			msg = "sandbox timeout set to " + d.Timeout.UTC().Format(time.RFC3339)
		default:
			msg = "sandbox updated"
		}
	case e2bapi.EventKilled:
		msg = "sandbox killed"
		if d.Reason != "" {
			msg += ": " + d.Reason
		}
		if strings.Contains(d.Reason, "fail") {
			level = e2bapi.LogError
		}
	default:
		msg = ev.Type
	}
	return e2bapi.SandboxLogEntry{Timestamp: ev.Timestamp, Level: level, Message: msg, Fields: map[string]string{
		"source": e2bapi.LogSourcePlatform, "generation": strconv.FormatUint(d.Generation, 10), "event": ev.Type, "eventId": ev.ID,
	}}
}

// teamSandbox finds the caller's sandbox id: its record (found false when
// it was purged) and its events, oldest first. errdefs.ErrNotFound when
// the team has neither (another team's sandbox included).
func (s *Server) teamSandbox(ctx context.Context, c caller, id string) (rec store.SandboxRecord, found bool, err error) {
	rec, _, err = s.st.GetSandbox(ctx, id)
	found = err == nil && rec.TeamID == c.TeamID
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return rec, false, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
	}
	if found {
		return rec, true, nil
	}
	evs, err := s.st.ListEvents(ctx, store.EventQuery{TeamID: c.TeamID, SandboxID: id, Limit: 1})
	if err != nil {
		return rec, false, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
	}
	if len(evs) == 0 {
		return rec, false, fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
	}
	return store.SandboxRecord{}, false, nil
}

// sandboxLogs gathers the lines of the caller's sandbox id: 404 when the
// team has neither a record nor events of it.
func (s *Server) sandboxLogs(ctx context.Context, c caller, id string) ([]e2bapi.SandboxLogEntry, error) {
	rec, found, err := s.teamSandbox(ctx, c, id)
	if err != nil {
		return nil, err
	}
	evs, err := s.st.ListEvents(ctx, store.EventQuery{TeamID: c.TeamID, SandboxID: id, Limit: platformLogEvents, Asc: true})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
	}
	lines := make([]e2bapi.SandboxLogEntry, 0, len(evs)+1)
	ended := false
	for _, e := range evs {
		lines = append(lines, platformLine(e.Event))
		ended = ended || e.Event.Type == e2bapi.EventKilled
	}
	if found && rec.State.Terminal() && !ended {
		lines = append(lines, endLine(rec)) // a create that failed is no lifecycle event, but is news
	}
	if found {
		lines = append(lines, s.agentLines(ctx, rec)...)
	}
	return lines, nil
}

// endLine is the platform's line for a sandbox that ended without a
// killed event (its create failed).
func endLine(rec store.SandboxRecord) e2bapi.SandboxLogEntry {
	at := rec.EndedAt
	if at.IsZero() {
		at = rec.CreatedAt
	}
	msg, level := "sandbox "+string(rec.State), e2bapi.LogInfo
	if rec.State == store.StateFailed {
		level = e2bapi.LogError
	}
	if rec.Reason != "" {
		msg += ": " + rec.Reason
	}
	return e2bapi.SandboxLogEntry{Timestamp: at.UTC(), Level: level, Message: msg, Fields: map[string]string{
		"source": e2bapi.LogSourcePlatform, "generation": strconv.FormatUint(rec.Route.Generation, 10),
	}}
}

// handleLogs answers both logs routes: the same selection, in v2's
// structured shape or v1's (lines beside the entries).
func (s *Server) handleLogs(w http.ResponseWriter, r *http.Request, c caller, v2 bool) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	q, err := parseLogQuery(r.URL.Query(), v2)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	lines, err := s.sandboxLogs(r.Context(), c, id)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	sel := selectLogs(lines, q)
	if v2 {
		writeJSON(w, http.StatusOK, e2bapi.SandboxLogsV2Response{Logs: sel})
		return
	}
	out := e2bapi.SandboxLogs{LogEntries: sel, Logs: make([]e2bapi.SandboxLog, 0, len(sel))}
	for _, e := range sel {
		out.Logs = append(out.Logs, e2bapi.SandboxLog{Line: e.Message, Timestamp: e.Timestamp})
	}
	writeJSON(w, http.StatusOK, out)
}

// agentLines are the sandbox's agent lines from its worker (none when the
// sandbox has no live execution or its worker does not answer: the
// platform's lines are still served).
func (s *Server) agentLines(ctx context.Context, rec store.SandboxRecord) []e2bapi.SandboxLogEntry {
	if rec.State.Terminal() || rec.State == store.StateCreating || rec.Route.WorkerID == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, agentLogTimeout)
	defer cancel()
	var resp spacev1.AgentLogResponse
	if err := s.node.call(ctx, s.nodeURL(ctx, rec), spacev1.NodePathAgentLog, rec.Route, spacev1.LifecycleRequest{Route: rec.Route}, &resp); err != nil {
		s.log.Debug("agent log unavailable", "sandbox", rec.ID, "err", err)
		return nil
	}
	gen := strconv.FormatUint(resp.Generation, 10)
	out := make([]e2bapi.SandboxLogEntry, 0, len(resp.Lines))
	for _, l := range resp.Lines {
		if l.Time.IsZero() {
			continue // not a line of the agent's own (no time to merge it by)
		}
		level := l.Level
		if e2bapi.LogLevelRank(level) < 0 {
			level = e2bapi.LogInfo
		}
		out = append(out, e2bapi.SandboxLogEntry{Timestamp: l.Time.UTC(), Level: level, Message: l.Message,
			Fields: map[string]string{"source": e2bapi.LogSourceAgent, "generation": gen}})
	}
	return out
}

// agentLogTimeout bounds the worker call of one logs request.
const agentLogTimeout = 5 * time.Second
