package worker

// Lease fencing on real sandboxes: a worker whose lease renewals stop
// being answered serves nothing (each refusal path), cuts its streams,
// keeps its sandboxes running, and serves again only after retiring what
// the control plane replaced meanwhile.

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/envd/process/processpbconnect"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/gateway"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/sbxmanager"
	"github.com/spacesbx/space/internal/substrate"
)

func TestLeaseRenewalDeadline(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	l := LeaseRenewal{Sent: t0, TTL: 10 * time.Second}
	if got := l.Deadline(2500 * time.Millisecond); !got.Equal(t0.Add(7500 * time.Millisecond)) {
		t.Fatalf("deadline %s", got)
	}
	if got := l.Deadline(0); !got.Equal(t0.Add(10 * time.Second)) {
		t.Fatalf("deadline without margin %s", got)
	}
	c := Config{ID: "w", StateDir: "/x", LeaseTTL: 8 * time.Second}.withDefaults()
	if c.FenceMargin != 2*time.Second {
		t.Fatalf("default margin %s, want a quarter of the ttl", c.FenceMargin)
	}
	if err := (Config{ID: "w", StateDir: "/x", LeaseTTL: 8 * time.Second, FenceMargin: 4 * time.Second}).Validate(); err == nil {
		t.Fatal("a margin of half the ttl (renewals every third) was accepted")
	}
}

// leasedRegistrar answers renewals while the test lets it.
type leasedRegistrar struct {
	mu      sync.Mutex
	onRenew func(LeaseRenewal)
	ttl     time.Duration
	lease   int64
}

func (r *leasedRegistrar) RegisterWorker(context.Context, spacev1.Worker, time.Duration) (io.Closer, error) {
	return nil, errors.New("the fencing test registers with renewals")
}

func (r *leasedRegistrar) RegisterWorkerLeased(_ context.Context, _ spacev1.Worker, ttl time.Duration, onRenew func(LeaseRenewal)) (io.Closer, error) {
	r.mu.Lock()
	r.onRenew, r.ttl, r.lease = onRenew, ttl, 1
	r.mu.Unlock()
	r.renew(true)
	return closer(func() error { return nil }), nil
}

// renew answers one renewal sent now (fresh: under a new lease).
func (r *leasedRegistrar) renew(fresh bool) {
	r.mu.Lock()
	if fresh {
		r.lease++
	}
	fn, l := r.onRenew, LeaseRenewal{Lease: r.lease, Sent: time.Now(), TTL: r.ttl, Fresh: fresh}
	r.mu.Unlock()
	if fn != nil {
		fn(l)
	}
}

func (r *leasedRegistrar) registered() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.onRenew != nil
}

// keepAlive renews every 200 ms until the returned stop is called (the
// partition).
func (r *leasedRegistrar) keepAlive() (stop func()) {
	done, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		for {
			select {
			case <-done:
				return
			case <-time.After(200 * time.Millisecond):
				r.renew(false)
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); <-exited }) }
}

// storeView is the control plane's records as the worker reads them: a
// watch that never says anything (the partition) and a listing the test
// sets, can hold (gate) and can fail.
type storeView struct {
	mu      sync.Mutex
	evs     []SandboxEvent
	gate    chan struct{} // non-nil: ListSandboxes waits for it
	fail    int           // this many listings fail
	entered chan struct{}
}

func (v *storeView) WatchSandboxes(ctx context.Context, _ func(SandboxEvent)) error {
	<-ctx.Done()
	return ctx.Err()
}

func (v *storeView) ListSandboxes(ctx context.Context) ([]SandboxEvent, error) {
	v.mu.Lock()
	gate, evs := v.gate, append([]SandboxEvent(nil), v.evs...)
	failing := v.fail > 0
	if failing {
		v.fail--
	}
	v.mu.Unlock()
	select {
	case v.entered <- struct{}{}:
	default:
	}
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if failing {
		return nil, errors.New("etcd: no leader")
	}
	return evs, nil
}

func (v *storeView) set(gate chan struct{}, fail int, evs ...SandboxEvent) {
	v.mu.Lock()
	v.gate, v.fail, v.evs = gate, fail, evs
	v.mu.Unlock()
}

func (e *nsEnv) fencedWorker(id string, reg *leasedRegistrar, view *storeView) *runningWorker {
	t := e.t
	t.Helper()
	w, err := New(Config{ID: id, StateDir: filepath.Join(e.dir, id), Logger: slog.New(slog.DiscardHandler), LeaseTTL: 2 * time.Second,
		Manager: sbxmanager.Config{SpacedHostPath: filepath.Join(nsBin, "spaced-host"), AgentPath: filepath.Join(nsBin, "spaced-guest"),
			NetgtwPath: "/nonexistent", StartTimeout: 60 * time.Second}},
		Deps{Substrates: []substrate.Substrate{e.sub}, Registrar: reg, Bundles: staticBundle{capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: e.pub}}}},
			Sandboxes: view, Snapshots: e.snaps})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	rw := &runningWorker{Worker: w, stop: func() { once.Do(func() { cancel(); <-done }) }}
	t.Cleanup(rw.stop)
	waitFor(t, "registration", reg.registered)
	return rw
}

func fenced(w *runningWorker) bool { f, _ := w.Manager().Fenced(); return f }

// servicePort sends a service-port request with a capability for r.
func (e *nsEnv) servicePort(w *runningWorker, r identity.Route) (int, string) {
	e.t.Helper()
	tok, _, err := e.signer.Issue(capability.Claims{Route: r, Purpose: capability.PurposeServicePort, Port: 8080, Protocol: "http"})
	if err != nil {
		e.t.Fatal(err)
	}
	req, _ := http.NewRequest("GET", w.URL()+"/", nil)
	req.Header.Set(spacev1.HeaderCapability, tok)
	req.Header.Set(gateway.HeaderSandboxPort, "8080")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(raw)
}

// refusedFenced checks a data-plane answer is the fence's RefreshRoute.
func refusedFenced(t *testing.T, what string, status int, body string) {
	t.Helper()
	if status != http.StatusMisdirectedRequest || !strings.Contains(body, sbxmanager.ReasonWorkerFenced) || !strings.Contains(body, spacev1.OutcomeRefreshRoute) {
		t.Fatalf("%s while fenced: %d %s", what, status, body)
	}
}

func TestFencedWorkerServesNothingAndRetiresBeforeServing(t *testing.T) {
	e := newNSEnv(t)
	reg := &leasedRegistrar{}
	view := &storeView{entered: make(chan struct{}, 1)}
	r1, keep := nsRoute(1, "wa"), nsRoute(1, "wa")
	keep.SandboxID = "sbxkeep"
	view.set(nil, 0, SandboxEvent{SandboxID: r1.SandboxID, Route: r1}, SandboxEvent{SandboxID: keep.SandboxID, Route: keep})
	a := e.fencedWorker("wa", reg, view)
	stop := reg.keepAlive()
	var ir spacev1.InstallResponse
	for _, r := range []identity.Route{r1, keep} {
		if s := e.control(a, spacev1.NodePathInstall, r, spacev1.InstallRequest{Route: r, Template: "base"}, &ir); s != 200 {
			t.Fatalf("install %s: %d", r.SandboxID, s)
		}
	}
	if s, body := e.files(a, "POST", r1, "/root/note", "1"); s != 200 {
		t.Fatalf("upload: %d %s", s, body)
	}
	// A process that keeps writing, its output stream open.
	proc := processpbconnect.NewProcessClient(e.client(r1, capability.PurposeProcess), a.URL(), connect.WithProtoJSON())
	sctx, scancel := context.WithCancel(context.Background())
	defer scancel()
	stream, err := proc.Start(sctx, connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{
		Cmd: "/bin/sh", Args: []string{"-c", "while :; do echo tick >> /tmp/ticks; echo tick; sleep 0.02; done"}}}))
	if err != nil {
		t.Fatal(err)
	}
	if !stream.Receive() {
		t.Fatalf("process stream: %v", stream.Err())
	}
	streamEnd := make(chan error, 1)
	go func() {
		for stream.Receive() {
		}
		streamEnd <- stream.Err()
	}()
	upper, _ := a.Manager().WritableLayer(r1.SandboxID)
	ticks := func() int64 {
		fi, err := os.Stat(filepath.Join(upper, "tmp", "ticks"))
		if err != nil {
			return 0
		}
		return fi.Size()
	}
	waitFor(t, "ticks", func() bool { return ticks() > 0 })

	// The partition: renewals stop being answered. Fenced before the
	// lease's TTL (2 s) has passed since the last answered renewal.
	stop()
	stoppedAt := time.Now()
	waitFor(t, "fence", func() bool { return fenced(a) })
	if d := time.Since(stoppedAt); d >= 2*time.Second {
		t.Fatalf("fenced %s after the last renewal, not before the lease could expire", d)
	}
	select {
	case err := <-streamEnd:
		if connect.CodeOf(err) != connect.CodeUnavailable {
			t.Fatalf("stream cut by the fence ended with %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the process stream stayed open on a fenced worker")
	}
	// Every refusal path.
	s, body := e.files(a, "GET", r1, "/root/note", "")
	refusedFenced(t, "files", s, body)
	s, body = e.servicePort(a, r1)
	refusedFenced(t, "service port", s, body)
	st2, err := proc.Start(context.Background(), connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "/bin/true"}}))
	if err == nil {
		for st2.Receive() {
		}
		err = st2.Err()
	}
	if err == nil || !strings.Contains(err.Error(), "421") && !strings.Contains(err.Error(), "fenced") {
		t.Fatalf("process start while fenced: %v", err)
	}
	other := nsRoute(1, "wa")
	other.SandboxID = "sbxnew"
	for _, c := range []struct {
		path string
		body any
		r    identity.Route
	}{
		{spacev1.NodePathInstall, spacev1.InstallRequest{Route: other, Template: "base"}, other},
		{spacev1.NodePathPause, spacev1.LifecycleRequest{Route: r1}, r1},
		{spacev1.NodePathResume, spacev1.LifecycleRequest{Route: r1}, r1},
		{spacev1.NodePathSnapshot, spacev1.SnapshotRequest{Route: r1, SnapshotID: "fenced-1"}, r1},
		{spacev1.NodePathTeardown, spacev1.TeardownRequest{Route: r1}, r1},
		{spacev1.NodePathMetrics, spacev1.LifecycleRequest{Route: r1}, r1},
		{spacev1.NodePathNetwork, spacev1.NetworkRequest{Route: r1}, r1},
		{spacev1.NodePathMetricsRange, spacev1.LifecycleRequest{Route: r1}, r1},
		{spacev1.NodePathAgentLog, spacev1.LifecycleRequest{Route: r1}, r1},
	} {
		if s := e.control(a, c.path, c.r, c.body, nil); s != http.StatusServiceUnavailable {
			t.Fatalf("%s while fenced: %d, want 503", c.path, s)
		}
	}
	// The sandboxes keep running.
	n0 := ticks()
	waitFor(t, "ticks while fenced", func() bool { return ticks() > n0 })

	// Meanwhile the control plane recovered sbxmig elsewhere as
	// generation 2. The worker reaches the store again, but its read of
	// the records is held: it stays fenced, for the old execution and
	// for everything else.
	r2 := nsRoute(2, "wb")
	gate := make(chan struct{})
	view.set(gate, 0, SandboxEvent{SandboxID: r1.SandboxID, Route: r2}, SandboxEvent{SandboxID: keep.SandboxID, Route: keep})
	reg.renew(true)
	stop = reg.keepAlive()
	defer stop()
	<-view.entered
	for _, r := range []identity.Route{r1, r2, keep} {
		s, body := e.files(a, "GET", r, "/root/note", "")
		refusedFenced(t, "files of "+r.String()+" before the view is applied", s, body)
	}
	if !fenced(a) {
		t.Fatal("unfenced before the records were read")
	}
	close(gate)
	waitFor(t, "unfence", func() bool { return !fenced(a) })
	if rec, _ := a.Manager().Installed(r1.SandboxID); !rec.Retired {
		t.Fatalf("served again with the replaced execution not retired: %+v", rec)
	}
	// The old generation is never served again; the new one is not here;
	// the sandbox the control plane still routes here is served.
	if s, body := e.files(a, "GET", r1, "/root/note", ""); s != http.StatusMisdirectedRequest || !strings.Contains(body, "retired") {
		t.Fatalf("replaced execution after the return: %d %s", s, body)
	}
	if s, body := e.files(a, "GET", r2, "/root/note", ""); s != http.StatusMisdirectedRequest {
		t.Fatalf("capability of the new execution at the old worker: %d %s", s, body)
	}
	if s, _ := e.files(a, "GET", keep, "/etc/hostname", ""); s != 200 {
		t.Fatalf("a sandbox still routed here after the return: %d", s)
	}

	// A second partition; this time the records cannot be read at first:
	// the worker stays fenced until they can. Retire still runs.
	stop()
	waitFor(t, "second fence", func() bool { return fenced(a) })
	view.set(nil, 2, SandboxEvent{SandboxID: keep.SandboxID, Route: keep})
	reg.renew(false)
	stop = reg.keepAlive()
	<-view.entered
	<-view.entered // the first retry: still failing
	if !fenced(a) {
		t.Fatal("unfenced without the control plane's view")
	}
	waitFor(t, "unfence after the listing succeeds", func() bool { return !fenced(a) })
	stop()
	waitFor(t, "third fence", func() bool { return fenced(a) })
	if s := e.control(a, spacev1.NodePathRetire, keep, spacev1.LifecycleRequest{Route: keep}, nil); s != http.StatusNoContent {
		t.Fatalf("retire while fenced: %d", s)
	}
}
