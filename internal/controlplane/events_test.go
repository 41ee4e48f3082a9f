package controlplane

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/events"
	"github.com/spacesbx/space/internal/store"
)

// hookReceiver is a webhook endpoint that verifies signatures, answers
// 500 to its first request and processes each delivery id once.
type hookReceiver struct {
	secret string
	srv    *httptest.Server
	mu     sync.Mutex
	fail   int
	reqs   int
	badSig int
	seen   map[string]bool
	evs    []e2bapi.SandboxEvent
}

func newHookReceiver(t *testing.T, secret string) *hookReceiver {
	h := &hookReceiver{secret: secret, fail: 1, seen: map[string]bool{}}
	h.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		h.mu.Lock()
		defer h.mu.Unlock()
		h.reqs++
		if r.Header.Get("e2b-signature") != events.Sign(h.secret, body) {
			h.badSig++
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		if h.fail > 0 {
			h.fail--
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		if id := r.Header.Get("e2b-delivery-id"); !h.seen[id] {
			h.seen[id] = true
			var ev e2bapi.SandboxEvent
			_ = json.Unmarshal(body, &ev)
			h.evs = append(h.evs, ev)
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(h.srv.Close)
	return h
}

func (h *hookReceiver) types(sbx string) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for _, e := range h.evs {
		if e.SandboxID == sbx {
			out = append(out, e.Type)
		}
	}
	return out
}

func TestEventsWebhooksAndLogsAPI(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, func(c *Config) {
		c.WebhookAllowPrivate = true
		c.Events = events.Config{RetryInitial: 50 * time.Millisecond, PollInterval: 50 * time.Millisecond, LeaseTTL: 2 * time.Second}
	})
	lg := &callLog{}
	n1 := newFakeNode(t, "w1", st)
	attachLife(n1, lg)
	e.register(n1, 10)
	other := "e2b_" + strings.Repeat("b", 40)
	if err := st.PutAPIKey(context.Background(), store.HashAPIKey(other), store.APIKeyRecord{TeamID: "other", KeyID: "k9", Role: store.RoleAdmin}); err != nil {
		t.Fatal(err)
	}
	otherAPI := func(method, path string, body any) resp {
		return e.do(method, path, map[string]string{"X-API-Key": other}, body)
	}
	rcv := newHookReceiver(t, "webhook-secret-1")

	// Bad registrations: 400.
	good := map[string]any{"name": "h", "url": rcv.srv.URL + "/hook", "enabled": true, "events": e2bapi.EventTypes, "signatureSecret": "webhook-secret-1"}
	for name, mut := range map[string]func(m map[string]any){
		"unknown event":  func(m map[string]any) { m["events"] = []string{"sandbox.lifecycle.exploded"} },
		"no events":      func(m map[string]any) { m["events"] = []string{} },
		"bad url":        func(m map[string]any) { m["url"] = "gopher://x" },
		"oversized url":  func(m map[string]any) { m["url"] = "https://example.com/" + strings.Repeat("a", 3000) },
		"oversized name": func(m map[string]any) { m["name"] = strings.Repeat("n", 1000) },
		"no secret":      func(m map[string]any) { delete(m, "signatureSecret") },
		"unknown field":  func(m map[string]any) { m["colour"] = "red" },
		"events type":    func(m map[string]any) { m["events"] = "sandbox.lifecycle.created" },
	} {
		m := map[string]any{}
		for k, v := range good {
			m[k] = v
		}
		mut(m)
		if r := e.api("POST", "/events/webhooks", m); r.Code != 400 {
			t.Errorf("%s: %d %s", name, r.Code, r.Body)
		}
	}
	expectError(t, e.api("POST", "/events/webhooks", "{"), 400)

	r := e.api("POST", "/events/webhooks", good)
	if r.Code != 201 {
		t.Fatalf("register: %d %s", r.Code, r.Body)
	}
	if strings.Contains(string(r.Body), "webhook-secret-1") || strings.Contains(strings.ToLower(string(r.Body)), "secret") {
		t.Fatalf("secret returned: %s", r.Body)
	}
	var hook e2bapi.Webhook
	r.decode(t, &hook)
	if hook.ID == "" || hook.TeamID != "default" || !hook.Enabled || len(hook.Events) != len(e2bapi.EventTypes) {
		t.Fatalf("webhook %+v", hook)
	}

	// A lifecycle: create, pause, resume (connect), timeout, kill.
	sb := createV2(t, e, map[string]any{"templateID": "base", "timeout": 60, "metadata": map[string]string{"who": "test"}})
	id := sb.SandboxID
	for _, step := range []struct{ method, path string }{
		{"POST", "/sandboxes/" + id + "/pause"},
		{"POST", "/sandboxes/" + id + "/connect"},
	} {
		body := any(nil)
		if strings.HasSuffix(step.path, "connect") {
			body = map[string]any{"timeout": 60}
		}
		if r := e.api(step.method, step.path, body); r.Code/100 != 2 {
			t.Fatalf("%s %s: %d %s", step.method, step.path, r.Code, r.Body)
		}
	}
	e.clock.Advance(time.Second)
	if r := e.api("POST", "/sandboxes/"+id+"/timeout", map[string]any{"timeout": 600}); r.Code != 204 {
		t.Fatalf("timeout: %d %s", r.Code, r.Body)
	}
	if r := e.api("DELETE", "/sandboxes/"+id, nil); r.Code != 204 {
		t.Fatalf("kill: %d %s", r.Code, r.Body)
	}
	want := []string{e2bapi.EventCreated, e2bapi.EventPaused, e2bapi.EventResumed, e2bapi.EventUpdated, e2bapi.EventKilled}
	waitFor(t, func() bool { return len(rcv.types(id)) >= len(want) })
	if got := rcv.types(id); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("webhooks %v, want %v", got, want)
	}
	rcv.mu.Lock()
	if rcv.badSig != 0 || rcv.reqs != len(want)+1 {
		t.Errorf("bad signatures %d, requests %d (want %d: one retry)", rcv.badSig, rcv.reqs, len(want)+1)
	}
	rcv.mu.Unlock()

	// The events API.
	var evs []e2bapi.SandboxEvent
	e.api("GET", "/events/sandboxes/"+id+"?orderAsc=true&limit=100", nil).decode(t, &evs)
	if len(evs) != len(want) || evs[0].Type != e2bapi.EventCreated || evs[0].SandboxID != id || evs[0].SandboxTeamID != "default" || evs[0].Version != "v2" {
		t.Fatalf("sandbox events %+v", evs)
	}
	var data e2bapi.EventData
	_ = json.Unmarshal(evs[0].EventData, &data)
	if data.SandboxMetadata["who"] != "test" {
		t.Errorf("created event data %s", evs[0].EventData)
	}
	e.api("GET", "/events/sandboxes?limit=2", nil).decode(t, &evs)
	if len(evs) != 2 || evs[0].Type != e2bapi.EventKilled || evs[1].Type != e2bapi.EventUpdated {
		t.Fatalf("team events newest first: %+v", evs)
	}
	e.api("GET", "/events/sandboxes?limit=2&offset=1&orderAsc=true", nil).decode(t, &evs)
	if len(evs) != 2 || evs[0].Type != e2bapi.EventPaused {
		t.Fatalf("offset: %+v", evs)
	}
	e.api("GET", "/events/sandboxes/"+id+"?types=sandbox.lifecycle.paused&types=sandbox.lifecycle.killed", nil).decode(t, &evs)
	if len(evs) != 2 || evs[0].Type != e2bapi.EventKilled || evs[1].Type != e2bapi.EventPaused {
		t.Fatalf("types filter: %+v", evs)
	}
	for _, q := range []string{"limit=0", "limit=101", "offset=-1", "orderAsc=maybe", "limit=x", "types=sandbox.lifecycle.nope"} {
		expectError(t, e.api("GET", "/events/sandboxes?"+q, nil), 400)
	}

	// Logs: the platform's lines.
	var lv2 e2bapi.SandboxLogsV2Response
	e.api("GET", "/v2/sandboxes/"+id+"/logs", nil).decode(t, &lv2)
	if len(lv2.Logs) != len(want) || lv2.Logs[0].Fields["source"] != "platform" || !strings.Contains(lv2.Logs[0].Message, "created") {
		t.Fatalf("logs %+v", lv2)
	}
	e.api("GET", "/v2/sandboxes/"+id+"/logs?direction=backward&limit=1", nil).decode(t, &lv2)
	if len(lv2.Logs) != 1 || !strings.Contains(lv2.Logs[0].Message, "killed") {
		t.Fatalf("backward logs %+v", lv2)
	}
	e.api("GET", "/v2/sandboxes/"+id+"/logs?search=paused", nil).decode(t, &lv2)
	if len(lv2.Logs) != 1 {
		t.Fatalf("search logs %+v", lv2)
	}
	e.api("GET", "/v2/sandboxes/"+id+"/logs?level=error", nil).decode(t, &lv2)
	if len(lv2.Logs) != 0 {
		t.Fatalf("level logs %+v", lv2)
	}
	var lv1 e2bapi.SandboxLogs
	e.api("GET", "/sandboxes/"+id+"/logs?limit=2", nil).decode(t, &lv1)
	if len(lv1.Logs) != 2 || len(lv1.LogEntries) != 2 || lv1.Logs[0].Line == "" {
		t.Fatalf("v1 logs %+v", lv1)
	}
	for _, q := range []string{"direction=up", "level=loud", "cursor=-1", "limit=100000", "search=" + strings.Repeat("s", 300)} {
		expectError(t, e.api("GET", "/v2/sandboxes/"+id+"/logs?"+q, nil), 400)
	}
	expectError(t, e.api("GET", "/v2/sandboxes/nosuchsandbox1/logs", nil), 404)

	// Another team sees nothing of it: 404, or an empty team list.
	expectError(t, otherAPI("GET", "/v2/sandboxes/"+id+"/logs", nil), 404)
	expectError(t, otherAPI("GET", "/sandboxes/"+id+"/logs", nil), 404)
	expectError(t, otherAPI("GET", "/events/sandboxes/"+id, nil), 404)
	expectError(t, e.api("GET", "/events/sandboxes/nosuchsandbox1", nil), 404)
	otherAPI("GET", "/events/sandboxes", nil).decode(t, &evs)
	if len(evs) != 0 {
		t.Fatalf("other team sees %d team events", len(evs))
	}
	expectError(t, otherAPI("GET", "/events/webhooks/"+hook.ID, nil), 404)
	expectError(t, otherAPI("PATCH", "/events/webhooks/"+hook.ID, map[string]any{"enabled": false}), 404)
	expectError(t, otherAPI("DELETE", "/events/webhooks/"+hook.ID, nil), 404)
	var hooks []e2bapi.Webhook
	otherAPI("GET", "/events/webhooks", nil).decode(t, &hooks)
	if len(hooks) != 0 {
		t.Fatalf("other team lists %d webhooks", len(hooks))
	}

	// The delivery state is visible; the secret is not.
	waitFor(t, func() bool {
		var h e2bapi.Webhook
		e.api("GET", "/events/webhooks/"+hook.ID, nil).decode(t, &h)
		return h.Deliveries.Delivered == int64(len(want)) && h.Deliveries.Pending == 0
	})
	r = e.api("GET", "/events/webhooks", nil)
	if strings.Contains(string(r.Body), "webhook-secret-1") {
		t.Fatal("secret listed")
	}
	r.decode(t, &hooks)
	if len(hooks) != 1 || hooks[0].Deliveries.LastStatus != 200 {
		t.Fatalf("list %+v", hooks)
	}

	// PATCH: checked like a registration.
	expectError(t, e.api("PATCH", "/events/webhooks/"+hook.ID, map[string]any{"events": []string{"nope"}}), 400)
	expectError(t, e.api("PATCH", "/events/webhooks/"+hook.ID, map[string]any{"url": "http://"}), 400)
	r = e.api("PATCH", "/events/webhooks/"+hook.ID, map[string]any{"enabled": false, "name": "renamed"})
	var upd e2bapi.Webhook
	r.decode(t, &upd)
	if r.Code != 200 || upd.Enabled || upd.Name != "renamed" || upd.URL != hook.URL {
		t.Fatalf("patch: %d %+v", r.Code, upd)
	}
	if r := e.api("DELETE", "/events/webhooks/"+hook.ID, nil); r.Code != 204 {
		t.Fatalf("delete: %d", r.Code)
	}
	expectError(t, e.api("GET", "/events/webhooks/"+hook.ID, nil), 404)
	expectError(t, e.api("DELETE", "/events/webhooks/"+hook.ID, nil), 404)
}

// Without WebhookAllowPrivate, loopback, private and link-local URLs are
// refused at registration and at update.
func TestWebhookSSRFRefused(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	for _, u := range []string{"http://127.0.0.1:9/", "http://localhost/", "http://10.0.0.1/", "http://169.254.169.254/", "http://[::1]/", "http://[fe80::1]/"} {
		r := e.api("POST", "/events/webhooks", map[string]any{"url": u, "events": []string{e2bapi.EventCreated}, "signatureSecret": "0123456789"})
		if r.Code != 400 {
			t.Errorf("%s: %d %s", u, r.Code, r.Body)
		}
	}
	r := e.api("POST", "/events/webhooks", map[string]any{"url": "https://hooks.example.com/x", "events": []string{e2bapi.EventCreated}, "signatureSecret": "0123456789"})
	if r.Code != 201 {
		t.Fatalf("public url: %d %s", r.Code, r.Body)
	}
	var h e2bapi.Webhook
	r.decode(t, &h)
	expectError(t, e.api("PATCH", "/events/webhooks/"+h.ID, map[string]any{"url": "http://192.168.0.1/"}), 400)
}

// A create that fails is no lifecycle event, but its logs say it failed.
func TestLogsOfFailedCreate(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	n1 := newFakeNode(t, "w1", st)
	e.register(n1, 10)
	n1.setFail(500)
	if r := e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base"}); r.Code < 500 {
		t.Fatalf("create on a failing node: %d %s", r.Code, r.Body)
	}
	all, err := st.ListSandboxes(context.Background())
	if err != nil || len(all) != 1 || all[0].Record.State != store.StateFailed {
		t.Fatalf("records %+v %v", all, err)
	}
	var lv2 e2bapi.SandboxLogsV2Response
	e.api("GET", "/v2/sandboxes/"+all[0].Record.ID+"/logs?level=error", nil).decode(t, &lv2)
	if len(lv2.Logs) != 1 || !strings.Contains(lv2.Logs[0].Message, "sandbox failed: install failed") || lv2.Logs[0].Fields["source"] != "platform" {
		t.Fatalf("logs %+v", lv2)
	}
	var evs []e2bapi.SandboxEvent
	e.api("GET", "/events/sandboxes/"+all[0].Record.ID, nil).decode(t, &evs)
	if len(evs) != 0 {
		t.Fatalf("events of a failed create: %+v", evs)
	}
	// The record purged and no event: unknown.
	if err := st.DeleteSandbox(context.Background(), all[0].Record.ID, 0); err != nil {
		t.Fatal(err)
	}
	expectError(t, e.api("GET", "/events/sandboxes/"+all[0].Record.ID, nil), 404)
}

func FuzzParseEventAndLogQueries(f *testing.F) {
	for _, q := range []string{"offset=1&limit=5&orderAsc=true", "types=sandbox.lifecycle.created&types=x", "limit=-1",
		"cursor=123&direction=backward&level=warn&search=a", "start=9999999999999999999", "limit=1e3", "direction=%zz"} {
		f.Add(q)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		q, err := url.ParseQuery(raw)
		if err != nil {
			return
		}
		if eq, err := eventQuery(q, "team", ""); err != nil {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("%q: untyped error %v", raw, err)
			}
		} else if eq.Limit < 1 || eq.Limit > maxEventLimit || eq.Offset < 0 || eq.Offset > maxEventOffset {
			t.Fatalf("%q: accepted %+v", raw, eq)
		}
		for _, v2 := range []bool{true, false} {
			lq, err := parseLogQuery(q, v2)
			if err != nil {
				if !errors.Is(err, errdefs.ErrInvalid) {
					t.Fatalf("%q: untyped error %v", raw, err)
				}
				continue
			}
			if lq.Limit < 0 || lq.Limit > maxLogLimit || lq.Cursor < 0 || lq.MinLevel < 0 || len(lq.Search) > maxLogSearch {
				t.Fatalf("%q: accepted %+v", raw, lq)
			}
			_ = selectLogs([]e2bapi.SandboxLogEntry{{Level: "info", Message: "m", Timestamp: time.UnixMilli(5)}}, lq)
		}
	})
}
