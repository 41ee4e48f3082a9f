package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/crashpoint"
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
		lines, err := sandboxLogs(ctx, tp, sb.ID, "limit=1000")
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
	if lines, err := sandboxLogs(ctx, tp, sb.ID, "limit=20"); err == nil {
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

// The control plane dies (SIGKILL) right after committing a kill, before
// anything else ran: after the restart the killed event is recorded and
// delivered, and no event is recorded or processed twice.
func TestEventsSurviveControlPlaneCrash(t *testing.T) {
	testenv.RequirePlatform(t)
	const secret = "crash-webhook-secret"
	var (
		mu    sync.Mutex
		seen  = map[string]bool{}
		types []string
		reqs  int
	)
	rcv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		reqs++
		if r.Header.Get(e2bapi.HeaderSignature) != events.Sign(secret, body) {
			w.WriteHeader(http.StatusUnauthorized)
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
	got := func(id string) []string {
		mu.Lock()
		defer mu.Unlock()
		var out []string
		for _, s := range types {
			if sid, typ, _ := strings.Cut(s, " "); sid == id {
				out = append(out, typ)
			}
		}
		return out
	}
	waitN := func(id string, n int) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for len(got(id)) < n && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
	}

	opts := testenv.PlatformOptions{Dir: t.TempDir(), APIKey: apiKey, LogLevel: "info", Args: []string{"--webhook-allow-private"},
		Env: append(os.Environ(), crashpoint.EnvVar+"="+crashpoint.KillMarked+"@1")}
	p1, err := testenv.LaunchPlatform(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer p1.Kill()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c1, err := sdk.New(sdk.Config{APIURL: p1.APIURL, SandboxURL: p1.SandboxURL, APIKey: apiKey})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c1.CreateWebhook(ctx, e2bapi.NewWebhook{Name: "crash", URL: rcv.URL, Events: e2bapi.EventTypes, SignatureSecret: secret}); err != nil {
		t.Fatal(err)
	}
	sb, err := c1.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 120 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	waitN(sb.ID, 1)
	killErr := c1.KillSandbox(ctx, sb.ID)
	state, err := p1.WaitExit(60 * time.Second)
	if err != nil {
		t.Fatalf("the crash point was not hit (kill: %v): %v\n%s", killErr, err, p1.Log())
	}
	if ws, _ := state.Sys().(syscall.WaitStatus); !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("space up ended with %v, not the crash point", state)
	}
	before := got(sb.ID)

	opts.Env = os.Environ()
	p2, err := testenv.LaunchPlatform(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if t.Failed() {
			t.Logf("space up log after the restart:\n%s", p2.Log())
		}
		if err := p2.Stop(); err != nil {
			t.Error(err)
		}
	}()
	c2, err := sdk.New(sdk.Config{APIURL: p2.APIURL, SandboxURL: p2.SandboxURL, APIKey: apiKey})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{e2bapi.EventCreated, e2bapi.EventKilled}
	waitN(sb.ID, len(want))
	if strings.Join(got(sb.ID), ",") != strings.Join(want, ",") {
		t.Fatalf("webhooks %v (before the crash %v), want %v", got(sb.ID), before, want)
	}
	evs, err := c2.SandboxEvents(ctx, sb.ID, sdk.EventsOptions{Asc: true, Limit: 100})
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, e := range evs {
		listed = append(listed, e.Type)
	}
	if strings.Join(listed, ",") != strings.Join(want, ",") {
		t.Fatalf("events API %v, want %v", listed, want)
	}
	mu.Lock()
	t.Logf("before the crash the receiver had %v; %d requests in all", before, reqs)
	mu.Unlock()
}

// sandboxLogs reads GET /v2/sandboxes/{id}/logs?query as any client would.
func sandboxLogs(ctx context.Context, tp *testenv.Platform, id, query string) ([]e2bapi.SandboxLogEntry, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, tp.APIURL+"/v2/sandboxes/"+id+"/logs?"+query, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("X-API-Key", apiKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return nil, fmt.Errorf("logs: %d %s", resp.StatusCode, b)
	}
	var out e2bapi.SandboxLogsV2Response
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, err
	}
	return out.Logs, nil
}
