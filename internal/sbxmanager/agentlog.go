package sbxmanager

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
)

// The agent log is what the sandbox's agents write into the activation's
// directory: the in-sandbox agent's log (the ns substrate's agent.log, a
// microVM's console.log, where its guest agent writes) and spaced-host's
// (the in-host bridge). The files themselves are the bounded per-sandbox
// store (the substrates cap them); a read takes only their tails.
const (
	// MaxAgentLogBytes is how much of the file's end a read looks at.
	MaxAgentLogBytes = 256 << 10
	// MaxAgentLogLines bounds the lines answered.
	MaxAgentLogLines = 1000
	// maxAgentLineBytes bounds one line's message.
	maxAgentLineBytes = 4096
)

// AgentLog returns the newest lines of the agent log of the execution
// route names (running or paused).
func (m *Manager) AgentLog(_ context.Context, route identity.Route) (spacev1.AgentLogResponse, error) {
	if err := validRoute("agent log", route); err != nil {
		return spacev1.AgentLogResponse{}, err
	}
	rec, _, err := m.lookup("agent log", route)
	if err != nil {
		return spacev1.AgentLogResponse{}, err
	}
	var lines []spacev1.AgentLogLine
	for _, name := range agentLogFiles {
		data, err := readTail(filepath.Join(rec.Dir, name), MaxAgentLogBytes)
		if err != nil {
			return spacev1.AgentLogResponse{}, fmt.Errorf("agent log %s: %w: %v", route.SandboxID, errdefs.ErrUnavailable, err)
		}
		// A line without a time (a kernel's console, a panic's trace)
		// takes the time of the line before it; one before any is dropped.
		var last time.Time
		for _, l := range ParseAgentLog(data, MaxAgentLogLines) {
			if l.Time.IsZero() {
				l.Time = last
			}
			if last = l.Time; !l.Time.IsZero() {
				lines = append(lines, l)
			}
		}
	}
	sort.SliceStable(lines, func(i, j int) bool { return lines[i].Time.Before(lines[j].Time) })
	if len(lines) > MaxAgentLogLines {
		lines = lines[len(lines)-MaxAgentLogLines:]
	}
	return spacev1.AgentLogResponse{Generation: route.Generation, Lines: lines}, nil
}

// agentLogFiles are the agents' log files in an activation directory
// (those a substrate does not write are simply absent).
var agentLogFiles = []string{"agent.log", "console.log", "spaced-host.log"}

// readTail reads at most max bytes of the end of path, from the first
// whole line ("" for a missing file).
func readTail(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	off := max(fi.Size()-limit, 0)
	data, err := io.ReadAll(io.NewSectionReader(f, off, fi.Size()-off))
	if err != nil {
		return nil, err
	}
	if off > 0 {
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			data = data[i+1:]
		} else {
			data = nil
		}
	}
	return data, nil
}

// ParseAgentLog parses slog lines, text (time=... level=... msg=...) or
// JSON, and returns the newest limit, oldest first. A line that is neither
// is kept whole as an info line without a time (zero Time).
func ParseAgentLog(data []byte, limit int) []spacev1.AgentLogLine {
	var out []spacev1.AgentLogLine
	for _, raw := range bytes.Split(data, []byte("\n")) {
		line := strings.TrimSpace(string(raw))
		if line == "" {
			continue
		}
		out = append(out, parseAgentLine(line))
	}
	if limit >= 0 && len(out) > limit {
		out = out[len(out)-limit:]
	}
	return out
}

func parseAgentLine(line string) spacev1.AgentLogLine {
	if !utf8.ValidString(line) {
		line = strings.ToValidUTF8(line, "\uFFFD")
	}
	if strings.HasPrefix(line, "{") {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil {
			l := spacev1.AgentLogLine{Level: "info"}
			var extra []string
			for k, v := range m {
				s := fmt.Sprint(v)
				switch k {
				case "time":
					l.Time, _ = time.Parse(time.RFC3339Nano, s)
				case "level":
					l.Level = normLevel(s)
				case "msg":
					l.Message = s
				default:
					extra = append(extra, k+"="+s)
				}
			}
			slices.Sort(extra) // the fields are the tenant's: never a quadratic sort
			l.Message = clip(strings.TrimSpace(l.Message + " " + strings.Join(extra, " ")))
			return l
		}
	}
	l := spacev1.AgentLogLine{Level: "info"}
	var rest []string
	msgSeen := false
	for _, kv := range splitFields(line) {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return spacev1.AgentLogLine{Level: "info", Message: clip(line)}
		}
		if uv, err := strconv.Unquote(v); err == nil {
			v = uv
		}
		switch {
		case k == "time" && l.Time.IsZero():
			l.Time, _ = time.Parse(time.RFC3339Nano, v)
		case k == "level" && !msgSeen:
			l.Level = normLevel(v)
		case k == "msg" && !msgSeen:
			l.Message, msgSeen = v, true
		default:
			rest = append(rest, kv)
		}
	}
	if !msgSeen {
		return spacev1.AgentLogLine{Level: "info", Message: clip(line)}
	}
	l.Message = clip(strings.TrimSpace(l.Message + " " + strings.Join(rest, " ")))
	return l
}

// splitFields splits a slog text line at spaces outside quotes.
func splitFields(s string) []string {
	var out []string
	start, quoted, esc := -1, false, false
	for i, r := range s {
		switch {
		case esc:
			esc = false
		case quoted && r == '\\':
			esc = true
		case r == '"':
			quoted = !quoted
		case r == ' ' && !quoted:
			if start >= 0 {
				out = append(out, s[start:i])
				start = -1
			}
			continue
		}
		if start < 0 {
			start = i
		}
	}
	if start >= 0 {
		out = append(out, s[start:])
	}
	return out
}

func normLevel(s string) string {
	switch u := strings.ToUpper(s); {
	case strings.HasPrefix(u, "DEBUG"):
		return "debug"
	case strings.HasPrefix(u, "WARN"):
		return "warn"
	case strings.HasPrefix(u, "ERROR"):
		return "error"
	}
	return "info"
}

// clip makes s a message fit to show: control characters (an escape
// sequence the sandbox wrote, or one its quoted or JSON field decoded to)
// are shown escaped, never passed to the terminal or page that prints the
// line, and the message is cut at maxAgentLineBytes.
func clip(s string) string {
	if strings.IndexFunc(s, unicode.IsControl) >= 0 {
		var b strings.Builder
		for _, r := range s {
			if unicode.IsControl(r) {
				fmt.Fprintf(&b, "\\u%04x", r)
				continue
			}
			b.WriteRune(r)
		}
		s = b.String()
	}
	if len(s) <= maxAgentLineBytes {
		return s
	}
	s = s[:maxAgentLineBytes]
	for !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s + "..."
}
