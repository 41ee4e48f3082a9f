package events

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/store"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func openStore(t *testing.T) *store.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	st, err := store.Open(ctx, store.Config{DataDir: t.TempDir(), Logger: quiet()})
	if err != nil {
		t.Fatalf("open store: %v", err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return st
}

func record(id string) store.SandboxRecord {
	now := time.Now().UTC()
	return store.SandboxRecord{ID: id, TeamID: "team-a", TemplateID: "base", State: store.StateCreating, Generation: 1,
		Route:     identity.Route{SandboxID: id, Generation: 1, ExecutionID: "e1", WorkerID: "w1", Substrate: identity.SubstrateNS, ActivationID: "a1"},
		CreatedAt: now, EndAt: now.Add(time.Minute), CPUCount: 2, MemoryMB: 512, Metadata: map[string]string{"k": "v"}}
}

// lifecycle walks rec through create, pause, resume, timeout update,
// snapshot and kill as the control plane commits them.
func lifecycle(t *testing.T, st *store.Store, id string) {
	t.Helper()
	ctx := context.Background()
	if _, err := st.CreateSandbox(ctx, record(id)); err != nil {
		t.Fatal(err)
	}
	steps := []func(r *store.SandboxRecord){
		func(r *store.SandboxRecord) { r.State, r.StartedAt = store.StateRunning, time.Now().UTC() },
		func(r *store.SandboxRecord) {
			r.State, r.Op = store.StatePausing, &store.LifecycleOp{ID: "o1", Kind: "pause", From: store.StateRunning}
		},
		func(r *store.SandboxRecord) { r.State, r.Op = store.StatePaused, nil },
		func(r *store.SandboxRecord) {
			r.State, r.Op = store.StateResuming, &store.LifecycleOp{ID: "o2", Kind: "resume", From: store.StatePaused}
			r.Generation = 2
		},
		func(r *store.SandboxRecord) {
			r.State, r.Op = store.StateRunning, nil
			r.Route.Generation, r.Route.ExecutionID = 2, "e2"
		},
		func(r *store.SandboxRecord) { r.EndAt = r.EndAt.Add(time.Hour) },
		func(r *store.SandboxRecord) { r.Metadata = map[string]string{"k": "v"} }, // no event
		func(r *store.SandboxRecord) {
			r.State, r.Op = store.StateSnapshotting, &store.LifecycleOp{ID: "o3", Kind: "snapshot", From: store.StateRunning}
		},
		func(r *store.SandboxRecord) { r.State, r.Op = store.StateRunning, nil },
		func(r *store.SandboxRecord) {
			r.State, r.Reason, r.EndedAt = store.StateKilled, "killed by test", time.Now().UTC()
		},
	}
	for _, fn := range steps {
		if _, _, err := st.MutateSandbox(ctx, id, func(r *store.SandboxRecord) error { fn(r); return nil }); err != nil {
			t.Fatal(err)
		}
	}
}

var wantLifecycle = []string{e2bapi.EventCreated, e2bapi.EventPaused, e2bapi.EventResumed, e2bapi.EventUpdated,
	e2bapi.EventCheckpointed, e2bapi.EventKilled}

func TestDerive(t *testing.T) {
	r := record("sbxderive0001")
	var o observed
	var got []string
	apply := func(fn func(*store.SandboxRecord)) {
		fn(&r)
		var ds []derived
		o, ds = derive(o, r)
		for _, d := range ds {
			got = append(got, d.Type)
		}
	}
	apply(func(*store.SandboxRecord) {})
	apply(func(r *store.SandboxRecord) { r.State = store.StateRunning })
	apply(func(r *store.SandboxRecord) { r.State = store.StateRunning }) // replay: nothing
	apply(func(r *store.SandboxRecord) {
		r.State, r.Op = store.StateMigrating, &store.LifecycleOp{Kind: "migrate"}
	})
	apply(func(r *store.SandboxRecord) {
		r.State, r.Op, r.Generation, r.Route.Generation, r.Route.WorkerID = store.StateRunning, nil, 2, 2, "w2"
	})
	apply(func(r *store.SandboxRecord) { r.State = store.StateFailed })
	apply(func(r *store.SandboxRecord) { r.State = store.StateKilled }) // already ended
	want := []string{e2bapi.EventCreated, e2bapi.EventUpdated, e2bapi.EventKilled}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("derived %v, want %v", got, want)
	}
	// A create that fails never was a sandbox: no event.
	o, got = observed{}, nil
	r = record("sbxderive0002")
	apply(func(r *store.SandboxRecord) { r.State = store.StateFailed })
	if len(got) != 0 {
		t.Fatalf("failed create derived %v", got)
	}
}

func TestSignMatchesE2B(t *testing.T) {
	// node: createHash("sha256").update(secret + body).digest("base64").replace(/=+$/, "") (E2B's verification)
	if got, want := Sign("secret", []byte("body")), "YuouM0o8pKJyrkZVR45vYimhIRzExMogPwMGjY/kzew"; got != want {
		t.Fatalf("Sign = %q, want %q", got, want)
	}
}

func TestValidateWebhook(t *testing.T) {
	ok := Webhook{Name: "n", URL: "https://example.com/hook", Events: []string{e2bapi.EventCreated}, Secret: "0123456789"}
	if err := ValidateWebhook(ok, false); err != nil {
		t.Fatalf("valid webhook refused: %v", err)
	}
	bad := map[string]func(w *Webhook){
		"no secret":        func(w *Webhook) { w.Secret = "" },
		"short secret":     func(w *Webhook) { w.Secret = "x" },
		"long secret":      func(w *Webhook) { w.Secret = strings.Repeat("x", 300) },
		"no events":        func(w *Webhook) { w.Events = nil },
		"unknown event":    func(w *Webhook) { w.Events = []string{"sandbox.lifecycle.exploded"} },
		"repeated event":   func(w *Webhook) { w.Events = []string{e2bapi.EventCreated, e2bapi.EventCreated} },
		"long name":        func(w *Webhook) { w.Name = strings.Repeat("n", 300) },
		"bad utf8 name":    func(w *Webhook) { w.Name = "\xff" },
		"empty url":        func(w *Webhook) { w.URL = "" },
		"ftp url":          func(w *Webhook) { w.URL = "ftp://example.com/" },
		"no host":          func(w *Webhook) { w.URL = "http:///x" },
		"credentials":      func(w *Webhook) { w.URL = "https://u:p@example.com/" },
		"loopback":         func(w *Webhook) { w.URL = "http://127.0.0.1:8080/" },
		"loopback v6":      func(w *Webhook) { w.URL = "http://[::1]/" },
		"mapped loopback":  func(w *Webhook) { w.URL = "http://[::ffff:127.0.0.1]/" },
		"private":          func(w *Webhook) { w.URL = "http://10.1.2.3/" },
		"private 192":      func(w *Webhook) { w.URL = "http://192.168.1.1/" },
		"link-local":       func(w *Webhook) { w.URL = "http://169.254.169.254/latest/meta-data" },
		"link-local v6":    func(w *Webhook) { w.URL = "http://[fe80::1]/" },
		"unique local v6":  func(w *Webhook) { w.URL = "http://[fd00::1]/" },
		"cgnat":            func(w *Webhook) { w.URL = "http://100.64.0.1/" },
		"unspecified":      func(w *Webhook) { w.URL = "http://0.0.0.0/" },
		"localhost":        func(w *Webhook) { w.URL = "http://localhost:3000/" },
		"sub.localhost":    func(w *Webhook) { w.URL = "http://a.localhost/" },
		"bad port":         func(w *Webhook) { w.URL = "http://example.com:99999/" },
		"fragment":         func(w *Webhook) { w.URL = "http://example.com/#x" },
		"oversized url":    func(w *Webhook) { w.URL = "https://example.com/" + strings.Repeat("a", MaxURLLen) },
		"control in url":   func(w *Webhook) { w.URL = "http://example.com/\x00" },
		"too many events":  func(w *Webhook) { w.Events = append(append([]string{}, e2bapi.EventTypes...), e2bapi.EventCreated) },
		"multicast":        func(w *Webhook) { w.URL = "http://224.0.0.1/" },
		"nat64 to private": func(w *Webhook) { w.URL = "http://[64:ff9b::a00:1]/" },
	}
	for name, mut := range bad {
		w := ok
		w.Events = append([]string(nil), ok.Events...)
		mut(&w)
		if err := ValidateWebhook(w, false); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: err %v, want invalid", name, err)
		}
	}
	w := ok
	w.URL = "http://127.0.0.1:8080/"
	if err := ValidateWebhook(w, true); err != nil {
		t.Fatalf("private allowed, still refused: %v", err)
	}
	if PublicAddr(netip.MustParseAddr("8.8.8.8")) != true {
		t.Fatal("8.8.8.8 not public")
	}
}

func FuzzParseWebhookURL(f *testing.F) {
	for _, s := range []string{"https://example.com/x", "http://127.0.0.1:1/", "http://[::1]/", "http://u@h/", "x", "http://h:0/", "http://%zz/"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		u, err := ParseWebhookURL(raw, false)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("%q: untyped error %v", raw, err)
			}
			return
		}
		if u.Scheme != "http" && u.Scheme != "https" || u.User != nil || u.Hostname() == "" {
			t.Fatalf("%q accepted as %v", raw, u)
		}
		if ip, err := netip.ParseAddr(u.Hostname()); err == nil && !PublicAddr(ip) {
			t.Fatalf("%q: private address accepted", raw)
		}
	})
}

// receiver is a webhook endpoint: it checks signatures, fails the first
// failFirst requests and processes each delivery id once.
type receiver struct {
	t      *testing.T
	secret string
	srv    *httptest.Server

	mu        sync.Mutex
	failFirst int
	requests  int
	seen      map[string]bool
	processed []e2bapi.SandboxEvent
	badSig    int
	hookIDs   map[string]bool
	// hangOnce: after processing its first event, the receiver answers
	// only after this long (past the dispatcher's attempt timeout), as if
	// its acknowledgement were lost.
	hangOnce time.Duration
	ids      []string
}

func newReceiver(t *testing.T, secret string, failFirst int) *receiver {
	r := &receiver{t: t, secret: secret, failFirst: failFirst, seen: map[string]bool{}, hookIDs: map[string]bool{}}
	r.srv = httptest.NewServer(http.HandlerFunc(r.serve))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *receiver) serve(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.requests++
	if req.Header.Get(e2bapi.HeaderSignature) != Sign(r.secret, body) || req.Header.Get(e2bapi.HeaderSignatureVersion) != "v1" {
		r.badSig++
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	if r.failFirst > 0 {
		r.failFirst--
		w.WriteHeader(http.StatusInternalServerError)
		return
	}
	r.hookIDs[req.Header.Get(e2bapi.HeaderWebhookID)] = true
	id := req.Header.Get(e2bapi.HeaderDeliveryID)
	r.ids = append(r.ids, id)
	if id == "" || r.seen[id] {
		w.WriteHeader(http.StatusOK) // duplicate: acknowledged, not processed again
		return
	}
	var ev e2bapi.SandboxEvent
	if err := json.Unmarshal(body, &ev); err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	r.seen[id] = true
	r.processed = append(r.processed, ev)
	if hang := r.hangOnce; hang > 0 {
		r.hangOnce = 0
		r.mu.Unlock()
		time.Sleep(hang)
		r.mu.Lock()
	}
	w.WriteHeader(http.StatusNoContent)
}

func (r *receiver) types(sbx string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, e := range r.processed {
		if e.SandboxID == sbx {
			out = append(out, e.Type)
		}
	}
	return out
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func startService(t *testing.T, st *store.Store, instance string, mut func(*Config)) *Service {
	t.Helper()
	cfg := Config{Instance: instance, AllowPrivate: true, Logger: quiet(), RetryInitial: 100 * time.Millisecond,
		RetryMax: time.Second, LeaseTTL: 2 * time.Second, PollInterval: 50 * time.Millisecond}
	if mut != nil {
		mut(&cfg)
	}
	s, err := New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	return s
}

func addHook(t *testing.T, st *store.Store, id, url, secret string, events []string) {
	t.Helper()
	if err := st.CreateWebhook(context.Background(), store.WebhookRecord{ID: id, TeamID: "team-a", Name: id, URL: url, Enabled: true,
		Events: events, Secret: secret, CreatedAt: time.Now().UTC()}, 0); err != nil {
		t.Fatal(err)
	}
}

// Every lifecycle event reaches the webhook in order, signed; a 500 is
// retried; the receiver processes each event once; the events API lists
// the same events.
func TestDeliveryInOrderWithRetry(t *testing.T) {
	st := openStore(t)
	rcv := newReceiver(t, "s3cret-value", 1)
	addHook(t, st, "hook1", rcv.srv.URL+"/hook?token=abc", "s3cret-value", e2bapi.EventTypes)
	s := startService(t, st, "cp-a", nil)
	defer s.Close()
	lifecycle(t, st, "sbxorder00001")
	waitFor(t, 20*time.Second, "all deliveries", func() bool { return len(rcv.types("sbxorder00001")) == len(wantLifecycle) })
	if got := rcv.types("sbxorder00001"); strings.Join(got, ",") != strings.Join(wantLifecycle, ",") {
		t.Fatalf("delivered %v, want %v", got, wantLifecycle)
	}
	rcv.mu.Lock()
	if rcv.badSig != 0 || rcv.requests < len(wantLifecycle)+1 || !rcv.hookIDs["hook1"] {
		t.Errorf("bad signatures %d, requests %d (want a retry), hook ids %v", rcv.badSig, rcv.requests, rcv.hookIDs)
	}
	ev := rcv.processed[0]
	rcv.mu.Unlock()
	if ev.Version != e2bapi.EventVersion || ev.SandboxTeamID != "team-a" || ev.SandboxExecutionID != "e1" || ev.SandboxTemplateID != "base" || len(ev.ID) != 36 {
		t.Errorf("created event %+v", ev)
	}
	evs, err := st.ListEvents(context.Background(), store.EventQuery{TeamID: "team-a", SandboxID: "sbxorder00001", Limit: 100, Asc: true})
	if err != nil {
		t.Fatal(err)
	}
	var types []string
	for _, e := range evs {
		types = append(types, e.Event.Type)
	}
	if strings.Join(types, ",") != strings.Join(wantLifecycle, ",") {
		t.Fatalf("listed %v", types)
	}
	var killed e2bapi.EventData
	_ = json.Unmarshal(evs[len(evs)-1].Event.EventData, &killed)
	if killed.Execution == nil || killed.Execution.VCPUCount != 2 || killed.Reason != "killed by test" || killed.SandboxMetadata["k"] != "v" {
		t.Errorf("killed event data %+v", killed)
	}
	waitFor(t, 5*time.Second, "status", func() bool {
		stt, pending, _, err := st.WebhookDeliveries(context.Background(), "hook1")
		return err == nil && pending == 0 && stt.Delivered == int64(len(wantLifecycle))
	})
	// Another team sees none of it.
	if other, _ := st.ListEvents(context.Background(), store.EventQuery{TeamID: "team-b", Limit: 10}); len(other) != 0 {
		t.Fatalf("team-b sees %d events", len(other))
	}
}

// A delivery pending when its dispatcher stops is delivered by the next
// one, with the same delivery id; the receiver processes it once.
func TestRestartResumesPendingDelivery(t *testing.T) {
	st := openStore(t)
	rcv := newReceiver(t, "s3cret-value", 1)
	addHook(t, st, "hook1", rcv.srv.URL, "s3cret-value", []string{e2bapi.EventCreated})
	s := startService(t, st, "cp-a", func(c *Config) { c.RetryInitial = 3 * time.Second })
	ctx := context.Background()
	r := record("sbxrestart001")
	r.State = store.StateRunning
	if _, err := st.CreateSandbox(ctx, r); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the failed first attempt, recorded", func() bool {
		pend, err := st.PendingDeliveries(ctx)
		return err == nil && len(pend) == 1 && pend[0].Attempts == 1
	})
	_ = s.Close() // mid-retry: the delivery waits 3 s for its next attempt
	pend, err := st.PendingDeliveries(ctx)
	if err != nil || len(pend) != 1 || pend[0].Attempts != 1 {
		t.Fatalf("pending after stop: %+v %v", pend, err)
	}
	s2 := startService(t, st, "cp-b", nil)
	defer s2.Close()
	waitFor(t, 15*time.Second, "delivery after restart", func() bool { return len(rcv.types("sbxrestart001")) == 1 })
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	if !rcv.seen[pend[0].ID] {
		t.Fatalf("delivered under another delivery id than %s", pend[0].ID)
	}
}

// With two services (two control planes), each event is recorded once and
// delivered by one of them.
func TestTwoServicesDeliverOnce(t *testing.T) {
	st := openStore(t)
	rcv := newReceiver(t, "s3cret-value", 0)
	addHook(t, st, "hook1", rcv.srv.URL, "s3cret-value", e2bapi.EventTypes)
	a := startService(t, st, "cp-a", nil)
	b := startService(t, st, "cp-b", nil)
	lifecycle(t, st, "sbxtwo0000001")
	waitFor(t, 20*time.Second, "deliveries", func() bool { return len(rcv.types("sbxtwo0000001")) == len(wantLifecycle) })
	_ = a.Close() // the survivor takes over
	lifecycle(t, st, "sbxtwo0000002")
	waitFor(t, 20*time.Second, "deliveries after failover", func() bool { return len(rcv.types("sbxtwo0000002")) == len(wantLifecycle) })
	_ = b.Close()
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	// One delivery id per event, each processed once. (A stop that cuts
	// a post short may cause one redelivery of that id: at least once.)
	if len(rcv.seen) != 2*len(wantLifecycle) || len(rcv.processed) != 2*len(wantLifecycle) || rcv.requests > 2*len(wantLifecycle)+1 {
		t.Fatalf("%d delivery ids, %d processed, %d requests for %d events", len(rcv.seen), len(rcv.processed), rcv.requests, 2*len(wantLifecycle))
	}
	evs, _ := st.ListEvents(context.Background(), store.EventQuery{TeamID: "team-a", Limit: 100})
	if len(evs) != 2*len(wantLifecycle) {
		t.Fatalf("%d events recorded, want %d", len(evs), 2*len(wantLifecycle))
	}
}

// A webhook whose URL reaches a private address at delivery time (stored
// before the check, or a name resolving there) is refused at the dial and
// failed after its attempts; the failure is visible.
func TestDeliveryRefusesPrivateAtDial(t *testing.T) {
	st := openStore(t)
	rcv := newReceiver(t, "s3cret-value", 0)
	// A name (not an address) that resolves to a private address: the
	// machine's own name, when it does (else a name that does not resolve).
	name, rebound := "localtest.invalid", false
	if h, err := os.Hostname(); err == nil {
		if addrs, err := net.LookupHost(h); err == nil && len(addrs) > 0 {
			if ip, err := netip.ParseAddr(addrs[0]); err == nil && !PublicAddr(ip) {
				name, rebound = h, true
			}
		}
	}
	addHook(t, st, "hook1", strings.Replace(rcv.srv.URL, "127.0.0.1", name, 1), "s3cret-value", []string{e2bapi.EventCreated})
	addHook(t, st, "hook2", rcv.srv.URL, "s3cret-value", []string{e2bapi.EventCreated})
	s := startService(t, st, "cp-a", func(c *Config) { c.AllowPrivate = false; c.MaxAttempts = 2; c.RetryInitial = 50 * time.Millisecond })
	defer s.Close()
	r := record("sbxssrf000001")
	r.State = store.StateRunning
	if _, err := st.CreateSandbox(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	for _, h := range []string{"hook1", "hook2"} {
		waitFor(t, 10*time.Second, h+" failed", func() bool {
			stt, pending, failed, err := st.WebhookDeliveries(context.Background(), h)
			return err == nil && pending == 0 && stt.Failed == 1 && len(failed) == 1 && failed[0].Attempts == 2
		})
	}
	for _, h := range []string{"hook1", "hook2"} {
		_, _, failed, _ := st.WebhookDeliveries(context.Background(), h)
		if (h == "hook2" || rebound) && !strings.Contains(failed[0].LastError, "non-public") {
			t.Errorf("%s (%s) error %q", h, name, failed[0].LastError)
		}
	}
	t.Logf("name resolving to a private address: %s (%t)", name, rebound)
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	if rcv.requests != 0 {
		t.Fatalf("receiver reached %d times", rcv.requests)
	}
}

// Events past the retention or the per-team bound are pruned.
func TestPrune(t *testing.T) {
	st := openStore(t)
	now := time.Now()
	clock := func() time.Time { return now }
	s := startService(t, st, "cp-a", func(c *Config) { c.Clock = clock; c.MaxPerTeam = 3; c.PruneInterval = 100 * time.Millisecond })
	defer s.Close()
	for i, id := range []string{"sbxprune00001", "sbxprune00002", "sbxprune00003"} {
		r := record(id)
		r.State = store.StateRunning
		if _, err := st.CreateSandbox(context.Background(), r); err != nil {
			t.Fatal(err)
		}
		_ = i
	}
	lifecycle(t, st, "sbxprune00004")
	waitFor(t, 10*time.Second, "pruned to 3", func() bool {
		evs, err := st.ListEvents(context.Background(), store.EventQuery{TeamID: "team-a", Limit: 100})
		return err == nil && len(evs) == 3 && evs[0].Event.Type == e2bapi.EventKilled
	})
	evs, _ := st.ListEvents(context.Background(), store.EventQuery{TeamID: "team-a", SandboxID: "sbxprune00001", Limit: 100})
	if len(evs) != 0 {
		t.Fatalf("sandbox index kept %d pruned events", len(evs))
	}
}

// Changes committed while no recorder runs (every control plane down, or
// between a leader's death and its successor) are recorded one by one
// when a recorder starts again: the history after the cursor is the
// outbox, so intermediate transitions are not lost.
func TestRecorderCatchesUpAfterDowntime(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	s := startService(t, st, "cp-a", nil)
	r := record("sbxdown000001")
	r.State = store.StateRunning
	if _, err := st.CreateSandbox(ctx, r); err != nil {
		t.Fatal(err)
	}
	count := func() int {
		evs, _ := st.ListEvents(ctx, store.EventQuery{TeamID: "team-a", SandboxID: "sbxdown000001", Limit: 100})
		return len(evs)
	}
	waitFor(t, 10*time.Second, "created, and the cursor past it", func() bool {
		state, err := st.LoadEventState(ctx)
		return count() == 1 && err == nil && state.Cursor > 0
	})
	_ = s.Close()
	for _, fn := range []func(r *store.SandboxRecord){
		func(r *store.SandboxRecord) {
			r.State, r.Op = store.StatePausing, &store.LifecycleOp{ID: "o", Kind: "pause"}
		},
		func(r *store.SandboxRecord) { r.State, r.Op = store.StatePaused, nil },
		func(r *store.SandboxRecord) {
			r.State, r.Op = store.StateResuming, &store.LifecycleOp{ID: "o", Kind: "resume"}
		},
		func(r *store.SandboxRecord) { r.State, r.Op = store.StateRunning, nil },
		func(r *store.SandboxRecord) { r.State = store.StateKilled },
	} {
		if _, _, err := st.MutateSandbox(ctx, "sbxdown000001", func(r *store.SandboxRecord) error { fn(r); return nil }); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.DeleteSandbox(ctx, "sbxdown000001", 0); err != nil { // purged, too
		t.Fatal(err)
	}
	s2 := startService(t, st, "cp-b", nil)
	defer s2.Close()
	waitFor(t, 10*time.Second, "the missed events", func() bool { return count() == 4 })
	evs, _ := st.ListEvents(ctx, store.EventQuery{TeamID: "team-a", SandboxID: "sbxdown000001", Limit: 100, Asc: true})
	var types []string
	for _, e := range evs {
		types = append(types, e.Event.Type)
	}
	if want := []string{e2bapi.EventCreated, e2bapi.EventPaused, e2bapi.EventResumed, e2bapi.EventKilled}; strings.Join(types, ",") != strings.Join(want, ",") {
		t.Fatalf("recorded %v, want %v", types, want)
	}
	waitFor(t, 5*time.Second, "digest forgotten", func() bool {
		state, err := st.LoadEventState(ctx)
		return err == nil && len(state.Observed) == 0
	})
}

// A delivery whose acknowledgement is lost (the receiver answers after the
// attempt timed out) is posted again under the same delivery id; the
// receiver processes the event once.
func TestLostAckRedeliveredSameID(t *testing.T) {
	st := openStore(t)
	rcv := newReceiver(t, "s3cret-value", 0)
	rcv.hangOnce = 1500 * time.Millisecond
	addHook(t, st, "hook1", rcv.srv.URL, "s3cret-value", []string{e2bapi.EventCreated})
	s := startService(t, st, "cp-a", func(c *Config) { c.AttemptTimeout = 300 * time.Millisecond })
	defer s.Close()
	r := record("sbxlostack001")
	r.State = store.StateRunning
	if _, err := st.CreateSandbox(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 15*time.Second, "the redelivery", func() bool {
		rcv.mu.Lock()
		defer rcv.mu.Unlock()
		return len(rcv.ids) >= 2
	})
	waitFor(t, 10*time.Second, "delivered", func() bool {
		stt, pending, _, err := st.WebhookDeliveries(context.Background(), "hook1")
		return err == nil && pending == 0 && stt.Delivered == 1
	})
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	if rcv.ids[0] != rcv.ids[1] || len(rcv.processed) != 1 {
		t.Fatalf("delivery ids %v, processed %d", rcv.ids, len(rcv.processed))
	}
}

// A resync (no cursor yet, or the history after it compacted away) finds
// a sandbox it saw created purged: it records the end it did not see.
func TestResyncRecordsVanishedSandboxEnd(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	s := startService(t, st, "cp-a", nil)
	r := record("sbxvanish0001")
	r.State = store.StateRunning
	if _, err := st.CreateSandbox(ctx, r); err != nil {
		t.Fatal(err)
	}
	count := func() []store.EventRecord {
		evs, _ := st.ListEvents(ctx, store.EventQuery{TeamID: "team-a", SandboxID: "sbxvanish0001", Limit: 100, Asc: true})
		return evs
	}
	waitFor(t, 10*time.Second, "created", func() bool { return len(count()) == 1 })
	_ = s.Close()
	if err := st.DeleteSandbox(ctx, "sbxvanish0001", 0); err != nil {
		t.Fatal(err)
	}
	svc, err := New(Config{Instance: "cp-b", Logger: quiet()}, st)
	if err != nil {
		t.Fatal(err)
	}
	defer svc.Close()
	l, err := st.CampaignEvents(ctx, "cp-b", 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	state, err := st.LoadEventState(ctx)
	if err != nil {
		t.Fatal(err)
	}
	obs := map[string]observed{}
	for id, b := range state.Observed {
		obs[id] = decodeObserved(b)
	}
	if _, err := svc.resync(ctx, l, obs); err != nil {
		t.Fatal(err)
	}
	evs := count()
	if len(evs) != 2 || evs[1].Event.Type != e2bapi.EventKilled || evs[1].Event.SandboxExecutionID != "e1" || evs[1].Event.SandboxTemplateID != "base" {
		t.Fatalf("events %+v", evs)
	}
	if len(obs) != 0 {
		t.Fatalf("digests left: %v", obs)
	}
}

// A tenant's webhook whose receiver never acknowledges (always 500, or a
// tarpit) holds each delivery for minutes of retries. Its deliveries must
// not pile up in etcd without bound while the tenant keeps its sandboxes
// churning: every event past the cap is recorded, but not queued for it.
func TestPendingDeliveriesBoundedPerWebhook(t *testing.T) {
	st := openStore(t)
	rcv := newReceiver(t, "s3cret-value", 1<<30) // never acknowledges
	addHook(t, st, "hookdown", rcv.srv.URL, "s3cret-value", e2bapi.EventTypes)
	s := startService(t, st, "cp-a", func(c *Config) {
		c.MaxPendingPerWebhook = 5
		c.MaxAttempts = 1000
		c.RetryInitial, c.RetryMax = time.Hour, time.Hour
	})
	defer s.Close()
	for i := range 4 {
		lifecycle(t, st, fmt.Sprintf("sbxpileup%04d", i))
	}
	want := 4 * len(wantLifecycle)
	waitFor(t, 20*time.Second, "every event recorded", func() bool {
		evs, err := st.ListEvents(context.Background(), store.EventQuery{TeamID: "team-a", Limit: 100})
		return err == nil && len(evs) == want
	})
	_, pending, _, err := st.WebhookDeliveries(context.Background(), "hookdown")
	if err != nil {
		t.Fatal(err)
	}
	if pending > 5 {
		t.Fatalf("%d deliveries pending for a webhook that never answers (cap 5, %d events)", pending, want)
	}
}

// A tenant's webhook naming a host that resolves to an internal address
// is refused at the dial, and its lastError (which the tenant reads) does
// not tell the address the name resolved to: the webhook API is no
// resolver of the platform's internal names.
func TestDialRefusalHidesResolvedAddress(t *testing.T) {
	st := openStore(t)
	rcv := newReceiver(t, "s3cret-value", 0)
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(rcv.srv.URL, "http://"))
	// The machine's own name stands in for an internal name when it
	// resolves to a private address; else a name that does not resolve.
	name, rebound := "localtest.invalid", false
	if h, err := os.Hostname(); err == nil {
		if addrs, err := net.LookupHost(h); err == nil && len(addrs) > 0 {
			if ip, err := netip.ParseAddr(addrs[0]); err == nil && !PublicAddr(ip) {
				name, rebound = h, true
			}
		}
	}
	t.Logf("name resolving to a private address: %s (%t)", name, rebound)
	addHook(t, st, "hook1", "http://"+name+":"+port+"/", "s3cret-value", []string{e2bapi.EventCreated})
	s := startService(t, st, "cp-a", func(c *Config) { c.AllowPrivate = false; c.MaxAttempts = 1 })
	defer s.Close()
	r := record("sbxssrf000002")
	r.State = store.StateRunning
	if _, err := st.CreateSandbox(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	var failed []store.DeliveryRecord
	waitFor(t, 10*time.Second, "hook1 failed", func() bool {
		var err error
		_, _, failed, err = st.WebhookDeliveries(context.Background(), "hook1")
		return err == nil && len(failed) == 1
	})
	msg := failed[0].LastError
	addrs, _ := net.LookupHost(name)
	for _, a := range append(addrs, port) {
		if strings.Contains(msg, a) {
			t.Fatalf("lastError tells the resolved address %s: %q", a, msg)
		}
	}
	if want := map[bool]string{true: "non-public", false: "could not be resolved"}[rebound]; !strings.Contains(msg, want) {
		t.Fatalf("lastError %q, want %q", msg, want)
	}
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	if rcv.requests != 0 {
		t.Fatalf("receiver reached %d times", rcv.requests)
	}
}

// IPv6 forms that carry an IPv4 address reach that address on a host with
// the matching translator or tunnel (local-use NAT64, 6to4, the deprecated
// IPv4-compatible form): they are not public whatever the IPv4 inside.
// "localhost." (the absolute name) is localhost too.
func TestPublicAddrRefusesEmbeddedIPv4(t *testing.T) {
	for _, a := range []string{"64:ff9b:1::a00:1", "64:ff9b:1:ffff::7f00:1", "2002:7f00:1::1", "2002:a9fe:a9fe::", "::7f00:1", "::a00:1"} {
		if PublicAddr(netip.MustParseAddr(a)) {
			t.Errorf("%s public", a)
		}
	}
	for _, u := range []string{"http://[64:ff9b:1::a00:1]/", "http://[2002:a9fe:a9fe::]/", "http://[::a9fe:a9fe]/", "http://localhost./", "http://a.localhost./"} {
		if _, err := ParseWebhookURL(u, false); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: err %v, want invalid", u, err)
		}
	}
	if !PublicAddr(netip.MustParseAddr("2606:4700:4700::1111")) {
		t.Error("2606:4700:4700::1111 not public")
	}
}

// A tenant whose receivers hang on every attempt (until the attempt
// timeout) must not hold every delivery slot: another team's delivery
// goes out at once, not after the hung attempts time out.
func TestHungTeamDoesNotHoldEveryDeliverySlot(t *testing.T) {
	st := openStore(t)
	var hung atomic.Int32
	tarpit := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hung.Add(1)
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	}))
	t.Cleanup(tarpit.Close)
	defer tarpit.CloseClientConnections()
	good := newReceiver(t, "s3cret-value", 0)
	for i := range 8 {
		if err := st.CreateWebhook(context.Background(), store.WebhookRecord{ID: fmt.Sprintf("hook-a%d", i), TeamID: "team-evil", Name: "h",
			URL: tarpit.URL, Enabled: true, Events: e2bapi.EventTypes, Secret: "s3cret-value", CreatedAt: time.Now().UTC()}, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.CreateWebhook(context.Background(), store.WebhookRecord{ID: "hook-z", TeamID: "team-good", Name: "h",
		URL: good.srv.URL, Enabled: true, Events: e2bapi.EventTypes, Secret: "s3cret-value", CreatedAt: time.Now().UTC()}, 0); err != nil {
		t.Fatal(err)
	}
	const attempt = 4 * time.Second
	s := startService(t, st, "cp-a", func(c *Config) { c.AttemptTimeout = attempt })
	defer s.Close()
	evil := record("sbxevil000001")
	evil.TeamID, evil.State = "team-evil", store.StateRunning
	if _, err := st.CreateSandbox(context.Background(), evil); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the tarpit reached", func() bool { return hung.Load() >= 2 })
	time.Sleep(200 * time.Millisecond) // every slot the evil team may take, taken
	start := time.Now()
	ok := record("sbxgood000001")
	ok.TeamID, ok.State = "team-good", store.StateRunning
	if _, err := st.CreateSandbox(context.Background(), ok); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 2*attempt, "the good team's delivery", func() bool { return len(good.types("sbxgood000001")) == 1 })
	if took := time.Since(start); took > attempt/2 {
		t.Fatalf("the good team's delivery took %v behind %d hung attempts (attempt timeout %v)", took, hung.Load(), attempt)
	}
}
