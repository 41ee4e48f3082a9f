package e2e

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/events"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// A real `space up` (--webhook-allow-private): a sandbox created, paused,
// resumed and killed reaches a signed webhook receiver in order, each
// event processed once although the first delivery is answered 500; its
// logs hold the platform's lines and the agent's.
func TestEventsWebhooksLogsPlatform(t *testing.T) {
	testenv.RequirePlatform(t)
	const secret = "platform-webhook-secret"
	var (
		mu    sync.Mutex
		fail  = 1
		seen  = map[string]bool{}
		types []string
		bad   int
	)
	rcv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		if r.Header.Get(e2bapi.HeaderSignature) != events.Sign(secret, body) {
			bad++
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		if fail > 0 {
			fail--
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		if id := r.Header.Get(e2bapi.HeaderDeliveryID); !seen[id] {
			seen[id] = true
			var ev e2bapi.SandboxEvent
			_ = json.Unmarshal(body, &ev)
			types = append(types, ev.SandboxID+" "+ev.Type)
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer rcv.Close()

	tp := testenv.StartPlatform(t, testenv.PlatformOptions{APIKey: apiKey, LogLevel: "debug", Args: []string{"--webhook-allow-private"}})
	c, err := sdk.New(sdk.Config{APIURL: tp.APIURL, SandboxURL: tp.SandboxURL, APIKey: apiKey})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	hook, err := c.CreateWebhook(ctx, e2bapi.NewWebhook{Name: "platform", URL: rcv.URL + "/hook", Events: e2bapi.EventTypes, SignatureSecret: secret})
	if err != nil {
		t.Fatal(err)
	}
	sb, err := c.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 120 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if code, err := sb.Run(ctx, "echo hello", sdk.RunOptions{}); err != nil || code != 0 {
		t.Fatalf("run: %d %v", code, err)
	}
	api := func(method, path string, body string) {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, method, tp.APIURL+path, strings.NewReader(body))
		req.Header.Set("X-API-Key", apiKey)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode/100 != 2 {
			t.Fatalf("%s %s: %d %s", method, path, resp.StatusCode, b)
		}
	}
	api("POST", "/sandboxes/"+sb.ID+"/pause", "")
	api("POST", "/sandboxes/"+sb.ID+"/connect", `{"timeout":120}`)
	// Agent lines are read from the live execution: before the kill.
	var agent, platform int
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		lines, err := c.SandboxLogs(ctx, sb.ID, sdk.LogsOptions{Limit: 1000})
		if err != nil {
			t.Fatal(err)
		}
		agent, platform = 0, 0
		for _, l := range lines {
			switch l.Fields["source"] {
			case e2bapi.LogSourceAgent:
				agent++
			case e2bapi.LogSourcePlatform:
				platform++
			}
		}
		if agent > 0 && platform >= 3 {
			break
		}
		time.Sleep(300 * time.Millisecond)
	}
	t.Logf("log lines: %d platform, %d agent", platform, agent)
	if lines, err := c.SandboxLogs(ctx, sb.ID, sdk.LogsOptions{Limit: 20}); err == nil {
		for _, l := range lines {
			t.Logf("  %s %-5s %-8s %s", l.Timestamp.Format(time.RFC3339Nano), l.Level, l.Fields["source"], l.Message)
		}
	}
	if agent == 0 || platform < 3 {
		t.Fatalf("logs: %d platform lines (want created, paused, resumed), %d agent lines", platform, agent)
	}
	if err := c.KillSandbox(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	want := []string{e2bapi.EventCreated, e2bapi.EventPaused, e2bapi.EventResumed, e2bapi.EventKilled}
	got := func() []string {
		mu.Lock()
		defer mu.Unlock()
		var out []string
		for _, s := range types {
			if id, typ, _ := strings.Cut(s, " "); id == sb.ID {
				out = append(out, typ)
			}
		}
		return out
	}
	deadline = time.Now().Add(30 * time.Second)
	for len(got()) < len(want) && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if strings.Join(got(), ",") != strings.Join(want, ",") {
		t.Fatalf("webhooks %v, want %v", got(), want)
	}
	mu.Lock()
	if bad != 0 {
		t.Errorf("%d deliveries with a bad signature", bad)
	}
	mu.Unlock()
	evs, err := c.SandboxEvents(ctx, sb.ID, sdk.EventsOptions{Asc: true, Limit: 100})
	if err != nil || len(evs) != len(want) {
		t.Fatalf("events API: %d events, %v", len(evs), err)
	}
	h, err := c.GetWebhook(ctx, hook.ID)
	if err != nil || h.Deliveries.Delivered < int64(len(want)) {
		t.Fatalf("webhook state %+v %v", h.Deliveries, err)
	}
}
