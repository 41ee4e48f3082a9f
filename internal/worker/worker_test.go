package worker

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"io"
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/sbxmanager"
	"github.com/spacesbx/space/internal/substrate"
)

type nopSubstrate struct{}

func (nopSubstrate) Name() string { return "ns" }
func (nopSubstrate) Capabilities() substrate.Capabilities {
	return substrate.Capabilities{}
}
func (nopSubstrate) Start(context.Context, substrate.Spec) (substrate.Instance, error) {
	return nil, errors.New("no sandboxes in this test")
}

type fakeRegistrar struct {
	mu  sync.Mutex
	reg []spacev1.Worker
}

type closer func() error

func (c closer) Close() error { return c() }

func (f *fakeRegistrar) RegisterWorker(_ context.Context, w spacev1.Worker, _ time.Duration) (io.Closer, error) {
	f.mu.Lock()
	f.reg = append(f.reg, w)
	f.mu.Unlock()
	return closer(func() error { return nil }), nil
}

func (f *fakeRegistrar) count() int { f.mu.Lock(); defer f.mu.Unlock(); return len(f.reg) }

// bundleFeed delivers bundles sent on ch.
type bundleFeed struct{ ch chan capability.Bundle }

func (b bundleFeed) WatchBundle(ctx context.Context, fn func(capability.Bundle)) error {
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case x := <-b.ch:
			fn(x)
		}
	}
}

func newWorker(t *testing.T, dir string, feed bundleFeed, reg *fakeRegistrar) *Worker {
	t.Helper()
	w, err := New(Config{ID: "w1", StateDir: dir, BundleWait: 5 * time.Second,
		Manager: sbxmanager.Config{SpacedHostPath: "/x", AgentPath: "/x"}},
		Deps{Substrates: []substrate.Substrate{nopSubstrate{}}, Registrar: reg, Bundles: feed})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestFailClosedUntilBundleThenRegisters(t *testing.T) {
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	signer, _ := capability.NewSigner("k1", priv)
	route := identity.Route{SandboxID: "sbx1", Generation: 1, ExecutionID: "e1", WorkerID: "w1", Substrate: "ns", ActivationID: "a1"}
	tok, _, _ := signer.Issue(capability.Claims{Route: route, Purpose: capability.PurposeFiles})
	dir := t.TempDir()
	feed := bundleFeed{ch: make(chan capability.Bundle)}
	reg := &fakeRegistrar{}
	w := newWorker(t, dir, feed, reg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()

	get := func() int {
		req, _ := http.NewRequest("GET", w.URL()+"/files", nil)
		req.Header.Set(spacev1.HeaderCapability, tok)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	// No bundle yet: even a genuine token is denied, and the worker is not
	// registered for placement.
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := http.Get(w.URL() + spacev1.NodePathHealth)
		if err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("node-api not serving")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if s := get(); s != http.StatusForbidden {
		t.Fatalf("before bundle: %d", s)
	}
	if reg.count() != 0 {
		t.Fatal("registered before holding a key bundle")
	}
	feed.ch <- capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: pub}}}
	for reg.count() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if reg.count() != 1 {
		t.Fatal("not registered after the bundle arrived")
	}
	// Verified now; no record for the sandbox: RefreshRoute.
	if s := get(); s != http.StatusMisdirectedRequest {
		t.Fatalf("after bundle: %d", s)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	// The bundle was cached on disk: a restarted worker verifies at once.
	b, err := readBundle(filepath.Join(dir, "bundle.json"))
	if err != nil || b.Revision != 1 {
		t.Fatalf("cached bundle: %+v %v", b, err)
	}
	w2 := newWorker(t, dir, bundleFeed{ch: make(chan capability.Bundle)}, &fakeRegistrar{})
	if _, err := w2.Verifier().Verify(tok, capability.PurposeFiles); err != nil {
		t.Fatalf("restarted worker with cached bundle: %v", err)
	}
	w2.mgr.Close()
	w2.api.Close()
}
