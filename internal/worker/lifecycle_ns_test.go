package worker

// Real-sandbox tests of the worker side of pause, snapshot, resume on
// another worker and retirement (ns substrate, spaced-host, spaced-guest,
// node-api), driven over HTTP like the control plane and the edge do.

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/spacesbx/space/api/envd/filesystem"
	"github.com/spacesbx/space/api/envd/filesystem/filesystempbconnect"
	"github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/envd/process/processpbconnect"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/sbxmanager"
	"github.com/spacesbx/space/internal/snapshot"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/substrate/ns"
	"github.com/spacesbx/space/internal/testenv"
)

var nsBin string // spaced-host and spaced-guest, built by TestMain when root

func TestMain(m *testing.M) {
	ns.MaybeInit() // this test binary is also the sandbox init
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	if testenv.IsRoot() {
		dir, err := os.MkdirTemp("", "worker-test-bin")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		for _, b := range []struct{ name, pkg, cgo string }{
			{"spaced-host", "github.com/spacesbx/space/cmd/spaced-host", "1"},
			{"spaced-guest", "github.com/spacesbx/space/cmd/spaced-guest", "0"},
		} {
			cmd := exec.Command("go", "build", "-o", filepath.Join(dir, b.name), b.pkg)
			cmd.Env = append(os.Environ(), "CGO_ENABLED="+b.cgo)
			if out, err := cmd.CombinedOutput(); err != nil {
				fmt.Fprintf(os.Stderr, "build %s: %v\n%s", b.name, err, out)
				return 1
			}
		}
		nsBin = dir
	}
	return m.Run()
}

// staticBundle delivers one bundle and then nothing.
type staticBundle struct{ b capability.Bundle }

func (s staticBundle) WatchBundle(ctx context.Context, fn func(capability.Bundle)) error {
	fn(s.b)
	<-ctx.Done()
	return ctx.Err()
}

// chanWatcher delivers the sandbox events sent on ch.
type chanWatcher struct{ ch chan SandboxEvent }

func (c chanWatcher) WatchSandboxes(ctx context.Context, fn func(SandboxEvent)) error {
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case ev := <-c.ch:
			fn(ev)
		}
	}
}

type nsEnv struct {
	t      *testing.T
	signer *capability.Signer
	pub    ed25519.PublicKey
	sub    *ns.Substrate
	snaps  *snapshot.Local
	dir    string
}

func newNSEnv(t *testing.T) *nsEnv {
	t.Helper()
	testenv.RequireRoot(t, "real namespace sandboxes")
	dir := t.TempDir()
	sub, err := ns.New(ns.Config{StateDir: filepath.Join(dir, "ns"), CgroupParent: "space-worker-test"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Close() })
	snaps, err := snapshot.NewLocal(filepath.Join(dir, "snapshots"))
	if err != nil {
		t.Fatal(err)
	}
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	signer, _ := capability.NewSigner("k1", priv)
	return &nsEnv{t: t, signer: signer, pub: pub, sub: sub, snaps: snaps, dir: dir}
}

type runningWorker struct {
	*Worker
	events chan SandboxEvent
	stop   func()
}

func (e *nsEnv) worker(id string) *runningWorker {
	t := e.t
	t.Helper()
	events := make(chan SandboxEvent, 16)
	w, err := New(Config{ID: id, StateDir: filepath.Join(e.dir, id), Logger: slog.New(slog.DiscardHandler),
		Manager: sbxmanager.Config{SpacedHostPath: filepath.Join(nsBin, "spaced-host"), AgentPath: filepath.Join(nsBin, "spaced-guest"),
			NetgtwPath: "/nonexistent", StartTimeout: 60 * time.Second}},
		Deps{Substrates: []substrate.Substrate{e.sub}, Registrar: &fakeRegistrar{}, Bundles: staticBundle{capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: e.pub}}}},
			Sandboxes: chanWatcher{events}, Snapshots: e.snaps})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	rw := &runningWorker{Worker: w, events: events, stop: func() { once.Do(func() { cancel(); <-done }) }}
	t.Cleanup(rw.stop)
	return rw
}

func (e *nsEnv) token(r identity.Route, p capability.Purpose) string {
	tok, _, err := e.signer.Issue(capability.Claims{Route: r, Purpose: p})
	if err != nil {
		e.t.Fatal(err)
	}
	return tok
}

// control posts a node-api control call with a control capability for r.
func (e *nsEnv) control(w *runningWorker, path string, r identity.Route, body, out any) int {
	e.t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest("POST", w.URL()+path, bytes.NewReader(b))
	req.Header.Set(spacev1.HeaderCapability, e.token(r, capability.PurposeControl))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		e.t.Logf("%s %s: %d %s", w.cfg.ID, path, resp.StatusCode, raw)
	} else if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			e.t.Fatalf("%s: %v", path, err)
		}
	}
	return resp.StatusCode
}

func (e *nsEnv) files(w *runningWorker, method string, r identity.Route, path, body string) (int, string) {
	e.t.Helper()
	req, _ := http.NewRequest(method, w.URL()+"/files?username=root&path="+path, strings.NewReader(body))
	req.Header.Set(spacev1.HeaderCapability, e.token(r, capability.PurposeFiles))
	if method == "POST" {
		req.Header.Set("Content-Type", "application/octet-stream")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(raw)
}

type capTransport struct{ tok string }

func (c capTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(spacev1.HeaderCapability, c.tok)
	return http.DefaultTransport.RoundTrip(r)
}

func (e *nsEnv) client(r identity.Route, p capability.Purpose) *http.Client {
	return &http.Client{Transport: capTransport{e.token(r, p)}}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(15 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func nsRoute(gen uint64, worker string) identity.Route {
	return identity.Route{SandboxID: "sbxmig", Generation: gen, ExecutionID: fmt.Sprintf("exec%d", gen), WorkerID: worker,
		Substrate: identity.SubstrateNS, ActivationID: fmt.Sprintf("act%d", gen)}
}

// TestPauseSnapshotResumeElsewhereAndRetire is the seed scenario on real
// sandboxes: S runs as execution 7 on worker A, is paused (freezer),
// snapshotted and resumed as execution 8 on worker B with its files; A
// learns of the retirement from its sandbox watch and ends the process
// stream and file watch open on 7 with "execution replaced".
func TestPauseSnapshotResumeElsewhereAndRetire(t *testing.T) {
	e := newNSEnv(t)
	a, b := e.worker("wa"), e.worker("wb")
	r7, r8 := nsRoute(7, "wa"), nsRoute(8, "wb")
	ctx := context.Background()

	var ir spacev1.InstallResponse
	if s := e.control(a, spacev1.NodePathInstall, r7, spacev1.InstallRequest{Route: r7, Template: "base"}, &ir); s != 200 {
		t.Fatalf("install 7 on A: %d", s)
	}
	if s, body := e.files(a, "POST", r7, "/root/note", "written on A by execution 7"); s != 200 {
		t.Fatalf("upload: %d %s", s, body)
	}

	// A process that keeps writing, and a watch on its directory.
	proc := processpbconnect.NewProcessClient(e.client(r7, capability.PurposeProcess), a.URL(), connect.WithProtoJSON())
	sctx, scancel := context.WithCancel(ctx)
	defer scancel()
	stream, err := proc.Start(sctx, connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{
		Cmd: "/bin/sh", Args: []string{"-c", "while :; do echo tick >> /tmp/ticks; echo tick; sleep 0.02; done"}}}))
	if err != nil {
		t.Fatal(err)
	}
	if !stream.Receive() {
		t.Fatalf("process stream: %v", stream.Err())
	}
	fsc := filesystempbconnect.NewFilesystemClient(e.client(r7, capability.PurposeFilesystem), a.URL(), connect.WithProtoJSON())
	wreq := connect.NewRequest(&filesystempb.WatchDirRequest{Path: "/root"})
	wreq.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte("root:"))) // /root is root's
	watch, err := fsc.WatchDir(sctx, wreq)
	if err != nil {
		t.Fatal(err)
	}
	if !watch.Receive() { // the start event
		t.Fatalf("watch stream: %v", watch.Err())
	}
	type ended struct {
		name string
		err  error
	}
	endc := make(chan ended, 2)
	go func() {
		for stream.Receive() {
		}
		endc <- ended{"process", stream.Err()}
	}()
	go func() {
		for watch.Receive() {
		}
		endc <- ended{"watch", watch.Err()}
	}()

	// Pause: the freezer stops the process; requests get 409 "paused".
	upper, ok := a.Manager().WritableLayer("sbxmig")
	if !ok {
		t.Fatal("no writable layer")
	}
	ticks := func() int64 {
		fi, err := os.Stat(filepath.Join(upper, "tmp", "ticks"))
		if err != nil {
			return 0
		}
		return fi.Size()
	}
	waitFor(t, "ticks", func() bool { return ticks() > 0 })
	if s := e.control(a, spacev1.NodePathPause, r7, spacev1.LifecycleRequest{Route: r7}, nil); s != 204 {
		t.Fatalf("pause: %d", s)
	}
	n0 := ticks()
	time.Sleep(300 * time.Millisecond)
	if n1 := ticks(); n1 != n0 {
		t.Fatalf("paused sandbox kept running: %d -> %d bytes", n0, n1)
	}
	if s, body := e.files(a, "GET", r7, "/root/note", ""); s != http.StatusConflict || !strings.Contains(body, sbxmanager.ReasonPaused) {
		t.Fatalf("read while paused: %d %s", s, body)
	}
	if s := e.control(a, spacev1.NodePathResume, r7, spacev1.LifecycleRequest{Route: r7}, nil); s != 204 {
		t.Fatalf("resume: %d", s)
	}
	waitFor(t, "ticks after resume", func() bool { return ticks() > n0 })
	if s, body := e.files(a, "GET", r7, "/root/note", ""); s != 200 || body != "written on A by execution 7" {
		t.Fatalf("read after resume: %d %s", s, body)
	}

	// Migrate: pause, snapshot, install 8 on B from the snapshot.
	if s := e.control(a, spacev1.NodePathPause, r7, spacev1.LifecycleRequest{Route: r7}, nil); s != 204 {
		t.Fatalf("pause: %d", s)
	}
	var sr spacev1.SnapshotResponse
	if s := e.control(a, spacev1.NodePathSnapshot, r7, spacev1.SnapshotRequest{Route: r7, SnapshotID: "sbxmig-7"}, &sr); s != 200 || sr.SizeBytes == 0 {
		t.Fatalf("snapshot: %d %+v", s, sr)
	}
	if s := e.control(b, spacev1.NodePathInstall, r8, spacev1.InstallRequest{Route: r8, Template: "base", RestoreSnapshot: "sbxmig-7"}, &ir); s != 200 {
		t.Fatalf("install 8 on B: %d", s)
	}
	if s, body := e.files(b, "GET", r8, "/root/note", ""); s != 200 || body != "written on A by execution 7" {
		t.Fatalf("file on B after restore: %d %q", s, body)
	}

	// A capability for 8 sent to A (still holding 7): refresh-route.
	if s, body := e.files(a, "GET", r8, "/root/note", ""); s != http.StatusMisdirectedRequest {
		t.Fatalf("capability for 8 at A: %d %s", s, body)
	}
	// B's watch still shows the route of 7 (published after the install):
	// that must not retire 8.
	b.events <- SandboxEvent{SandboxID: "sbxmig", Route: r7}
	// A learns of 8 from its watch and retires 7.
	a.events <- SandboxEvent{SandboxID: "sbxmig", Route: r8}
	waitFor(t, "retirement on A", func() bool { rec, _ := a.Manager().Installed("sbxmig"); return rec.Retired })
	for range 2 {
		select {
		case got := <-endc:
			if connect.CodeOf(got.err) != connect.CodeUnavailable || !strings.Contains(got.err.Error(), spacev1.ReasonExecutionReplaced) {
				t.Errorf("%s stream ended with %v, want unavailable: execution replaced", got.name, got.err)
			}
		case <-time.After(15 * time.Second):
			t.Fatal("streams of the retired execution still open")
		}
	}
	// The unexpired capability for 7 is rejected at A.
	if s, body := e.files(a, "GET", r7, "/root/note", ""); s != http.StatusMisdirectedRequest || !strings.Contains(body, "retired") {
		t.Fatalf("capability for retired 7 at A: %d %s", s, body)
	}
	// B serves 8 (its delayed event did nothing).
	if rec, _ := b.Manager().Installed("sbxmig"); rec.Retired {
		t.Fatal("a delayed event retired the newer execution")
	}
	if s, _ := e.files(b, "GET", r8, "/root/note", ""); s != 200 {
		t.Fatalf("8 on B: %d", s)
	}
	// The control plane's own retire call is idempotent; teardown frees A.
	if s := e.control(a, spacev1.NodePathRetire, r7, spacev1.LifecycleRequest{Route: r7}, nil); s != 204 {
		t.Fatalf("retire call after the watch: %d", s)
	}
	if s := e.control(a, spacev1.NodePathTeardown, r7, spacev1.TeardownRequest{Route: r7}, nil); s != 204 {
		t.Fatalf("teardown: %d", s)
	}
	if s := e.control(b, spacev1.NodePathTeardown, r8, spacev1.TeardownRequest{Route: r8}, nil); s != 204 {
		t.Fatalf("teardown 8: %d", s)
	}
}

// A worker restarted after a retirement (kill -9 style: no cleanup) serves
// nothing for the sandbox and never the retired execution.
func TestRestartAfterRetireServesNothing(t *testing.T) {
	e := newNSEnv(t)
	a := e.worker("wa")
	r1 := nsRoute(1, "wa")
	var ir spacev1.InstallResponse
	if s := e.control(a, spacev1.NodePathInstall, r1, spacev1.InstallRequest{Route: r1, Template: "base"}, &ir); s != 200 {
		t.Fatalf("install: %d", s)
	}
	a.events <- SandboxEvent{SandboxID: "sbxmig", Ended: true, Route: r1} // killed
	waitFor(t, "retirement", func() bool { rec, _ := a.Manager().Installed("sbxmig"); return rec.Retired })
	a.stop()
	a2 := e.worker("wa")
	if rec, ok := a2.Manager().Installed("sbxmig"); !ok || !rec.Retired {
		t.Fatalf("record after restart: %+v %v", rec, ok)
	}
	if s, body := e.files(a2, "GET", r1, "/root", ""); s != http.StatusMisdirectedRequest {
		t.Fatalf("retired execution after restart: %d %s", s, body)
	}
	// Reinstalling the retired execution is refused.
	if s := e.control(a2, spacev1.NodePathInstall, r1, spacev1.InstallRequest{Route: r1, Template: "base"}, &ir); s != http.StatusConflict {
		t.Fatalf("reinstall retired: %d", s)
	}
}

// At start the worker reconciles its records with the control plane's
// first full listing: an execution whose sandbox the control plane no
// longer holds (purged while the worker was down: no event will ever name
// it) is retired; one the listing names is left alone.
func TestRestartReconciles(t *testing.T) {
	e := newNSEnv(t)
	a := e.worker("wa")
	kept, gone := nsRoute(1, "wa"), nsRoute(1, "wa")
	gone.SandboxID = "sbxgone"
	var ir spacev1.InstallResponse
	for _, r := range []identity.Route{kept, gone} {
		if s := e.control(a, spacev1.NodePathInstall, r, spacev1.InstallRequest{Route: r, Template: "base"}, &ir); s != 200 {
			t.Fatalf("install %s: %d", r.SandboxID, s)
		}
	}
	a.stop()
	a2 := e.worker("wa")
	a2.events <- SandboxEvent{SandboxID: kept.SandboxID, Route: kept}
	a2.events <- SandboxEvent{Synced: true}
	waitFor(t, "retirement of the forgotten sandbox", func() bool { rec, _ := a2.Manager().Installed(gone.SandboxID); return rec.Retired })
	if rec, _ := a2.Manager().Installed(kept.SandboxID); rec.Retired {
		t.Fatal("a sandbox the control plane still holds was retired")
	}
	// A later listing that misses a sandbox installed since changes nothing.
	a2.events <- SandboxEvent{Synced: true}
	time.Sleep(200 * time.Millisecond)
	if rec, _ := a2.Manager().Installed(kept.SandboxID); rec.Retired {
		t.Fatal("a second listing retired a sandbox")
	}
}
