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
