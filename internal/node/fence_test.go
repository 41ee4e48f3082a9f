package node

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/sbxmanager"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/internal/worker"
)

type noSandboxes struct{}

func (noSandboxes) Name() string                         { return identity.SubstrateNS }
func (noSandboxes) Capabilities() substrate.Capabilities { return substrate.Capabilities{} }
func (noSandboxes) Start(context.Context, substrate.Spec) (substrate.Instance, error) {
	return nil, errors.New("no sandboxes in this test")
}

// A worker joined to a real etcd through a proxy the test cuts: the
// worker fences itself while etcd still holds its registration (before
// the lease can expire, so before the control plane may act), serves
// nothing while fenced, and once healed registers under a new lease and
// serves again.
func TestWorkerFencesWhenCutFromEtcd(t *testing.T) {
	ctx := context.Background()
	srv, err := store.Open(ctx, store.Config{DataDir: t.TempDir(), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	proxy := testenv.NewCutProxy(t, strings.TrimPrefix(srv.Endpoints()[0], "http://"))
	cli, err := store.Open(ctx, store.Config{Endpoints: []string{"http://" + proxy.Addr()}, DialTimeout: 2 * time.Second, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	if err := srv.PutBundle(ctx, capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: pub}}}); err != nil {
		t.Fatal(err)
	}
	signer, _ := capability.NewSigner("k1", priv)
	w, err := worker.New(worker.Config{ID: "w1", StateDir: filepath.Join(t.TempDir(), "w1"), LeaseTTL: 2 * time.Second,
		Logger: slog.New(slog.DiscardHandler), Manager: sbxmanager.Config{SpacedHostPath: "/x", AgentPath: "/x"}},
		worker.Deps{Substrates: []substrate.Substrate{noSandboxes{}}, Registrar: Registrar(cli), Bundles: cli, Sandboxes: SandboxWatch(cli)})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(rctx) }()
	t.Cleanup(func() { cancel(); <-done })
	waitUntil(t, "registration", func() bool { _, err := srv.GetWorker(ctx, "w1"); return err == nil })

	route := identity.Route{SandboxID: "sbx1", Generation: 1, ExecutionID: "e1", WorkerID: "w1", Substrate: identity.SubstrateNS, ActivationID: "a1"}
	tok, _, _ := signer.Issue(capability.Claims{Route: route, Purpose: capability.PurposeFiles})
	get := func() (int, string) {
		req, _ := http.NewRequest("GET", w.URL()+"/files?path=/etc/hostname", nil)
		req.Header.Set(spacev1.HeaderCapability, tok)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if _, body := get(); strings.Contains(body, sbxmanager.ReasonWorkerFenced) {
		t.Fatalf("fenced while connected: %s", body)
	}

	proxy.Cut()
	waitUntil(t, "fence", func() bool { f, _ := w.Manager().Fenced(); return f })
	if _, err := srv.GetWorker(ctx, "w1"); err != nil {
		t.Fatalf("etcd dropped the registration before the worker fenced itself: %v", err)
	}
	if s, body := get(); s != http.StatusMisdirectedRequest || !strings.Contains(body, sbxmanager.ReasonWorkerFenced) {
		t.Fatalf("request while fenced: %d %s", s, body)
	}
	waitUntil(t, "lease expiry", func() bool { _, err := srv.GetWorker(ctx, "w1"); return errors.Is(err, errdefs.ErrNotFound) })
	if f, _ := w.Manager().Fenced(); !f {
		t.Fatal("unfenced while cut off")
	}

	proxy.Heal()
	waitUntil(t, "unfence", func() bool { f, _ := w.Manager().Fenced(); return !f })
	if _, err := srv.GetWorker(ctx, "w1"); err != nil {
		t.Fatalf("served again without a registration: %v", err)
	}
	if _, body := get(); strings.Contains(body, sbxmanager.ReasonWorkerFenced) {
		t.Fatalf("still refused as fenced: %s", body)
	}
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
