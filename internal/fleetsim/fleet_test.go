package fleetsim

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/controlplane"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/store"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func openStore(t *testing.T) *store.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st, err := store.Open(ctx, store.Config{DataDir: t.TempDir(), Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// startFleet runs a fleet until the test ends and waits for it to register.
func startFleet(t *testing.T, st *store.Store, cfg Config) *Fleet {
	t.Helper()
	cfg.Logger = quiet()
	f, err := New(cfg, Deps{Store: st})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("fleet run: %v", err)
		}
		f.Close()
	})
	wctx, wcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer wcancel()
	if err := f.WaitReady(wctx); err != nil {
		t.Fatal(err)
	}
	return f
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []Config{{Workers: 10001}, {LeaseTTL: time.Millisecond}, {InstallDelay: -1}, {Substrates: []string{"vmware"}}} {
		if err := c.Validate(); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%+v: %v, want invalid", c, err)
		}
	}
	if err := (Config{}).Validate(); err != nil {
		t.Fatal(err)
	}
	if _, err := New(Config{}, Deps{}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("no store: %v", err)
	}
}

// The control calls go through node-api's checks: a capability signed by
// a key outside the bundle, for another worker, or for another route is
// refused (403) and nothing is installed; a valid one installs.
func TestControlCallsVerified(t *testing.T) {
	st := openStore(t)
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	if err := st.PutBundle(context.Background(), capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: pub}}}); err != nil {
		t.Fatal(err)
	}
	signer, _ := capability.NewSigner("k1", priv)
	_, otherPriv, _ := ed25519.GenerateKey(rand.Reader)
	forger, _ := capability.NewSigner("k1", otherPriv)
	f := startFleet(t, st, Config{Workers: 2, LoadInterval: 50 * time.Millisecond})
	w := f.Worker(f.IDs()[0])
	route := identity.Route{SandboxID: "abcdefghij0123456789", Generation: 1, ExecutionID: "e1", WorkerID: w.ID(),
		Substrate: identity.SubstrateNS, ActivationID: "a1"}
	tok := func(s *capability.Signer, r identity.Route, p capability.Purpose) string {
		tk, _, err := s.Issue(capability.Claims{Route: r, Purpose: p, Caller: "test"})
		if err != nil {
			t.Fatal(err)
		}
		return tk
	}
	other := route
	other.WorkerID = f.IDs()[1]
	otherExec := route
	otherExec.ExecutionID = "e2"
	install := spacev1.InstallRequest{Route: route, Template: "base"}
	for name, c := range map[string]struct {
		tok  string
		body any
		path string
		want int
	}{
		"forged":        {tok(forger, route, capability.PurposeControl), install, spacev1.NodePathInstall, 403},
		"other worker":  {tok(signer, other, capability.PurposeControl), install, spacev1.NodePathInstall, 403},
		"other route":   {tok(signer, otherExec, capability.PurposeControl), install, spacev1.NodePathInstall, 403},
		"files purpose": {tok(signer, route, capability.PurposeFiles), install, spacev1.NodePathInstall, 403},
		"none":          {"", install, spacev1.NodePathInstall, 403},
		"unknown field": {tok(signer, route, capability.PurposeControl), map[string]any{"route": route, "bogus": 1}, spacev1.NodePathInstall, 400},
		"not installed": {tok(signer, route, capability.PurposeControl), spacev1.TeardownRequest{Route: route}, spacev1.NodePathTeardown, 404},
	} {
		if got := post(t, w.URL()+c.path, c.tok, c.body); got != c.want {
			t.Errorf("%s: %d, want %d", name, got, c.want)
		}
	}
	if s := w.Stats(); s.Installs != 0 || s.Denied != 5 {
		t.Fatalf("after refusals: %+v", s)
	}
	good := tok(signer, route, capability.PurposeControl)
	if got := post(t, w.URL()+spacev1.NodePathInstall, good, install); got != 200 {
		t.Fatalf("install: %d", got)
	}
	if got := post(t, w.URL()+spacev1.NodePathInstall, good, install); got != 200 {
		t.Fatalf("install retry: %d", got)
	}
	// Load is reported in the registration.
	deadline := time.Now().Add(10 * time.Second)
	for {
		e, err := st.GetWorker(context.Background(), w.ID())
		if err == nil && e.Load == 1 && e.Capacity == DefaultCapacity {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("load not reported: %+v %v", e, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := post(t, w.URL()+spacev1.NodePathTeardown, good, spacev1.TeardownRequest{Route: route}); got != 204 {
		t.Fatalf("teardown: %d", got)
	}
	if s := w.Stats(); s.Installs != 1 || s.Teardowns != 1 || s.Active != 0 {
		t.Fatalf("stats: %+v", s)
	}
}

func post(t *testing.T, url, tok string, body any) int {
	t.Helper()
	data, _ := json.Marshal(body)
	req, _ := http.NewRequest("POST", url, bytes.NewReader(data))
	if tok != "" {
		req.Header.Set(spacev1.HeaderCapability, tok)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// A control plane on embedded etcd creates and kills sandboxes on the
// simulated fleet through the REST API; creates spread over the workers;
// a worker removed from the fleet gets no more placements.
func TestControlPlaneOnFleet(t *testing.T) {
	st := openStore(t)
	cp, err := controlplane.New(controlplane.Config{DataDir: t.TempDir()}, controlplane.Deps{Store: st, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cp.Close() })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- cp.Serve(ctx, ln) }()
	t.Cleanup(func() { cancel(); <-served })
	api := "http://" + ln.Addr().String()
	key, _ := cp.BootstrapAPIKey()

	f := startFleet(t, st, Config{Workers: 5, LoadInterval: -1})
	create := func() string {
		t.Helper()
		code, body := call(t, "POST", api+"/sandboxes", key, map[string]any{"templateID": "base"})
		if code != 201 {
			t.Fatalf("create: %d %s", code, body)
		}
		var sb e2bapi.Sandbox
		if err := json.Unmarshal(body, &sb); err != nil || sb.SandboxID == "" || sb.EnvdVersion != DefaultEnvdVersion {
			t.Fatalf("create answer %s: %v", body, err)
		}
		return sb.SandboxID
	}
	var ids []string
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 10 {
				id := create()
				mu.Lock()
				ids = append(ids, id)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	used := 0
	total := int64(0)
	for _, s := range f.Stats() {
		if s.Installs > 0 {
			used++
		}
		total += s.Installs
		if s.Denied != 0 {
			t.Errorf("worker %s denied %d control calls", s.ID, s.Denied)
		}
	}
	if total != 40 || used < 4 {
		t.Fatalf("40 creates: %d installs on %d of 5 workers: %+v", total, used, f.Stats())
	}
	for _, id := range ids {
		if code, body := call(t, "DELETE", api+"/sandboxes/"+id, key, nil); code != 204 {
			t.Fatalf("kill %s: %d %s", id, code, body)
		}
	}
	for _, s := range f.Stats() {
		if s.Active != 0 || s.Teardowns != s.Installs {
			t.Fatalf("after kills: %+v", s)
		}
	}

	gone := f.IDs()[0]
	if err := f.Remove(context.Background(), gone); err != nil {
		t.Fatal(err)
	}
	if _, err := st.GetWorker(context.Background(), gone); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("removed worker still registered: %v", err)
	}
	before := f.Worker(gone).Stats().Installs
	for range 20 {
		create()
	}
	if after := f.Worker(gone).Stats().Installs; after != before {
		t.Fatalf("removed worker got %d placements", after-before)
	}
	if err := f.Remove(context.Background(), "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("remove unknown: %v", err)
	}
}

func call(t *testing.T, method, url, key string, body any) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		data, _ := json.Marshal(body)
		rd = bytes.NewReader(data)
	}
	req, _ := http.NewRequest(method, url, rd)
	req.Header.Set("X-API-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(fmt.Errorf("%s %s: %w", method, url, err))
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}
