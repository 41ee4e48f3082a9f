package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode"
)

// TestLogsFollow drives `sandbox logs --follow --json` against a server
// that answers as E2B's /v2/sandboxes/{id}/logs does: lines at or after
// the cursor. A line at the cursor comes twice and is printed once.
func TestLogsFollow(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	var (
		mu      sync.Mutex
		cursors []string
	)
	lines := []map[string]any{
		{"timestamp": t0, "level": "info", "message": "sandbox created", "fields": map[string]string{"source": "platform"}},
		{"timestamp": t0.Add(time.Second), "level": "info", "message": "agent started", "fields": map[string]string{"source": "agent"}},
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v2/sandboxes/s1/logs" || r.URL.Query().Get("direction") != "forward" {
			http.Error(w, `{"code":404,"message":"not found: no route"}`, 404)
			return
		}
		c := r.URL.Query().Get("cursor")
		mu.Lock()
		cursors = append(cursors, c)
		n := len(cursors)
		mu.Unlock()
		out := []map[string]any{}
		ms, _ := strconv.ParseInt(c, 10, 64)
		all := lines
		if n > 1 {
			all = append(all, map[string]any{"timestamp": t0.Add(2 * time.Second), "level": "warn", "message": "paused", "fields": map[string]string{"source": "platform"}})
		}
		for _, l := range all {
			if l["timestamp"].(time.Time).UnixMilli() >= ms {
				out = append(out, l)
			}
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"logs": out})
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(t.Context(), pollEvery+pollEvery/2)
	defer cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, []string{"sandbox", "logs", "s1", "--follow", "--json"}, &env{stdin: strings.NewReader(""), stdout: &stdout, stderr: &stderr,
		getenv: func(k string) string { return map[string]string{"SPACE_API_URL": srv.URL, "SPACE_API_KEY": "k"}[k] }})
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	var msgs []string
	for _, l := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		var e struct {
			Message string            `json:"message"`
			Fields  map[string]string `json:"fields"`
		}
		if err := json.Unmarshal([]byte(l), &e); err != nil || e.Fields["source"] == "" {
			t.Fatalf("line %q: %v", l, err)
		}
		msgs = append(msgs, e.Message)
	}
	if strings.Join(msgs, ",") != "sandbox created,agent started,paused" {
		t.Fatalf("printed %q", msgs)
	}
	mu.Lock()
	got := append([]string(nil), cursors...)
	mu.Unlock()
	if len(got) < 2 || got[0] != "" || got[1] != strconv.FormatInt(t0.Add(time.Second).UnixMilli(), 10) {
		t.Fatalf("cursors %q", got)
	}
	// The table form: time, level, source, message.
	stdout.Reset()
	run(t.Context(), []string{"sandbox", "logs", "s1"}, &env{stdin: strings.NewReader(""), stdout: &stdout, stderr: &stderr,
		getenv: func(k string) string { return map[string]string{"SPACE_API_URL": srv.URL, "SPACE_API_KEY": "k"}[k] }})
	if !strings.Contains(stdout.String(), "2026-01-02T03:04:05.000Z INFO  platform sandbox created\n") {
		t.Fatalf("table:\n%s", stdout.String())
	}
}

// TestMetricsFollow drives `sandbox metrics --follow` against a server
// that keeps samples over time (start inclusive, Unix seconds): every
// sample is printed once, in order, and the rows line up with the header.
func TestMetricsFollow(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 0, 0, time.UTC)
	var (
		mu     sync.Mutex
		n      int
		starts []string
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		n++
		k := n
		starts = append(starts, r.URL.Query().Get("start"))
		mu.Unlock()
		start, _ := strconv.ParseInt(r.URL.Query().Get("start"), 10, 64)
		out := []map[string]any{}
		for i := 0; i <= k; i++ { // one more sample per request
			ts := t0.Add(time.Duration(i) * 5 * time.Second)
			if ts.Unix() < start {
				continue
			}
			out = append(out, map[string]any{"timestamp": ts, "timestampUnix": ts.Unix(), "cpuCount": 2,
				"cpuUsedPct": 12.5 * float64(i), "memUsed": 5 << 20, "memTotal": 512 << 20, "diskUsed": 1 << 30, "diskTotal": 4 << 30})
		}
		_ = json.NewEncoder(w).Encode(out)
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(t.Context(), pollEvery+pollEvery/2)
	defer cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, []string{"sandbox", "metrics", "s1", "-f"}, &env{stdin: strings.NewReader(""), stdout: &stdout, stderr: &stderr,
		getenv: func(k string) string { return map[string]string{"SPACE_API_URL": srv.URL, "SPACE_API_KEY": "k"}[k] }})
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	lines := strings.Split(strings.TrimRight(stdout.String(), "\n"), "\n")
	if len(lines) != 4 || !strings.HasPrefix(lines[0], "TIME") {
		t.Fatalf("want a header and 3 samples:\n%s", stdout.String())
	}
	col := strings.Index(lines[0], "MEMORY")
	for i, l := range lines[1:] {
		want := t0.Add(time.Duration(i) * 5 * time.Second).Format(time.RFC3339)
		if !strings.HasPrefix(l, want) || strings.Index(l, "5.0 MiB") != col {
			t.Errorf("row %d %q: want time %s and MEMORY at column %d", i, l, want, col)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if starts[0] != "" || starts[1] != strconv.FormatInt(t0.Add(5*time.Second).Unix(), 10) {
		t.Errorf("start parameters %q", starts)
	}
}

// A log line is the sandbox's text (its agent's, or a failure reason
// quoting it): `sandbox logs` prints its control characters escaped, so
// an escape sequence cannot drive the terminal (OSC 52 sets the
// clipboard, CSI rewrites the screen).
func TestLogsEscapeControlCharacters(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewEncoder(w).Encode(map[string]any{"logs": []map[string]any{{"timestamp": t0, "level": "info",
			"message": "a\x1b]52;c;ZWNobyBwd25lZA==\x07b\x1b[2J", "fields": map[string]string{"source": "agent", "k": "\u009b1m"}}}})
	}))
	defer srv.Close()
	var stdout, stderr bytes.Buffer
	code := run(t.Context(), []string{"sandbox", "logs", "s1"}, &env{stdin: strings.NewReader(""), stdout: &stdout, stderr: &stderr,
		getenv: func(k string) string { return map[string]string{"SPACE_API_URL": srv.URL, "SPACE_API_KEY": "k"}[k] }})
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	out := strings.TrimSuffix(stdout.String(), "\n")
	if strings.IndexFunc(out, unicode.IsControl) >= 0 {
		t.Fatalf("printed control characters: %q", out)
	}
	if !strings.Contains(out, `a\u001b]52;c;ZWNobyBwd25lZA==\u0007b\u001b[2J k=\u009b1m`) {
		t.Fatalf("printed %q", out)
	}
}
