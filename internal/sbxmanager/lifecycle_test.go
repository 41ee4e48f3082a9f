package sbxmanager

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/envelope"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/snapshot"
	"github.com/spacesbx/space/internal/substrate"
)

// connectSubstrate is a fake substrate whose guest speaks enough of the
// Connect streaming protocol (envelopes) for the stream-lease tests, and
// records pauses and forwarded requests.
type connectSubstrate struct {
	fakeSubstrate              // capabilities and writable layer
	forwarded     atomic.Int64 // requests that reached any guest
	mu            sync.Mutex
	insts         []*connectInstance
}

type connectInstance struct {
	fakeInstance
	paused atomic.Bool
	pauses atomic.Int64
}

func (i *connectInstance) Pause(context.Context) error {
	i.paused.Store(true)
	i.pauses.Add(1)
	return nil
}
func (i *connectInstance) Resume(context.Context) error { i.paused.Store(false); return nil }

func frame(flags byte, msg string) []byte { return envelope.Frame(flags, []byte(msg)) }

func (f *connectSubstrate) Name() string { return identity.SubstrateNS }

func (f *connectSubstrate) Start(ctx context.Context, spec substrate.Spec) (substrate.Instance, error) {
	if err := os.MkdirAll(filepath.Join(spec.Dir, fakeLayer), 0o755); err != nil {
		return nil, err
	}
	sock := filepath.Join(spec.Dir, "guest.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		return nil, err
	}
	route := spec.Route
	done := make(chan struct{})
	// A handler that has not read its request body is not told when the
	// connection closes: wait for the instance's end as well.
	wait := func(r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-done:
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /_space/identity", func(w http.ResponseWriter, r *http.Request) { json.NewEncoder(w).Encode(route) })
	count := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) { f.forwarded.Add(1); h(w, r) }
	}
	mux.HandleFunc("/files", count(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("stream") != "" { // a plain streaming body
			w.Write([]byte("chunk\n"))
			w.(http.Flusher).Flush()
			wait(r)
			return
		}
		fmt.Fprintf(w, "file of %s gen %d", route.SandboxID, route.Generation)
	}))
	// Connect server streams: one message, then wait for the end.
	stream := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/connect+json")
		w.WriteHeader(200)
		w.Write(frame(0, `{"event":{"start":{"pid":7}}}`))
		w.(http.Flusher).Flush()
		wait(r)
	}
	mux.HandleFunc("/process.Process/Start", count(stream))
	mux.HandleFunc("/filesystem.Filesystem/WatchDir", count(stream))
	// A stream whose guest has not answered yet.
	mux.HandleFunc("/process.Process/Connect", count(func(w http.ResponseWriter, r *http.Request) { wait(r) }))
	inst := &connectInstance{fakeInstance: fakeInstance{route: route, sock: sock, srv: &http.Server{Handler: mux}, done: done}}
	go inst.srv.Serve(l)
	f.mu.Lock()
	f.insts = append(f.insts, inst)
	f.mu.Unlock()
	return inst, nil
}

func (f *connectSubstrate) last() *connectInstance {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.insts[len(f.insts)-1]
}

type lcFixture struct {
	fixture
	sub   *connectSubstrate
	snaps *snapshot.Local
	ver   *capability.Verifier
	// runs is the substrate the manager gets: sub, or one built on it.
	runs substrate.Substrate
}

func newLCFixture(t *testing.T) *lcFixture {
	t.Helper()
	sub := &connectSubstrate{}
	return newLCFixtureOn(t, sub, sub)
}

// newLCFixtureOn is newLCFixture with a manager running runs, a substrate
// built on sub.
func newLCFixtureOn(t *testing.T, sub *connectSubstrate, runs substrate.Substrate) *lcFixture {
	t.Helper()
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	signer, _ := capability.NewSigner("k1", priv)
	ver, _ := capability.NewVerifier(capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: pub}}})
	dir := t.TempDir()
	snaps, err := snapshot.NewLocal(filepath.Join(dir, "snapshots"))
	if err != nil {
		t.Fatal(err)
	}
	f := &lcFixture{sub: sub, snaps: snaps, ver: ver, runs: runs}
	f.signer, f.dir = signer, filepath.Join(dir, "w1")
	f.open(t)
	return f
}

// open starts (or restarts) the manager on the fixture's state dir.
func (f *lcFixture) open(t *testing.T) {
	t.Helper()
	m, err := New(Config{WorkerID: "w1", StateDir: f.dir, SpacedHostPath: spacedHost, AgentPath: "/nonexistent", NetgtwPath: "/nonexistent"},
		Deps{Substrates: []substrate.Substrate{f.runs}, WriteError: writeTestError, Verifier: f.ver, Snapshots: f.snaps})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m)
	f.m, f.srv = m, srv
	t.Cleanup(func() { srv.Close(); m.Close() })
}

// crash drops the manager without retiring or tearing anything down (its
// activations stop as they would when the process dies).
func (f *lcFixture) crash() {
	f.srv.Close()
	f.m.Close()
}

func (f *lcFixture) stream(t *testing.T, path string, r identity.Route, p capability.Purpose) *http.Response {
	t.Helper()
	req, _ := http.NewRequest("POST", f.srv.URL+path, bytes.NewReader(frame(0, `{}`)))
	req.Header.Set("Content-Type", "application/connect+json")
	req.Header.Set(spacev1.HeaderCapability, f.token(t, r, p))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// readEnvelopes reads Connect envelopes until the end-of-stream message
// (returned) or an error; onMsg (if set) runs after every other message.
func readEnvelopes(body io.Reader, onMsg func()) (end string, n int, err error) {
	br := bufio.NewReader(body)
	for {
		var hdr [5]byte
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			return "", n, err
		}
		msg := make([]byte, binary.BigEndian.Uint32(hdr[1:]))
		if _, err := io.ReadFull(br, msg); err != nil {
			return "", n, err
		}
		n++
		if hdr[0]&0x02 != 0 {
			return string(msg), n, nil
		}
		if onMsg != nil {
			onMsg()
		}
	}
}

type endStream struct {
	Error struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

// expectReplacedEnd checks that a Connect stream ends (soon) with an
// end-of-stream error "unavailable: execution replaced". started is
// closed once the stream's first message arrived (or the stream ended):
// a replacement before it would cut the stream short of wantMsgs.
func expectReplacedEnd(t *testing.T, name string, resp *http.Response, wantMsgs int) (done, started <-chan struct{}) {
	t.Helper()
	d, st := make(chan struct{}), make(chan struct{})
	var once sync.Once
	go func() {
		defer close(d)
		defer once.Do(func() { close(st) })
		defer resp.Body.Close()
		end, n, err := readEnvelopes(resp.Body, func() { once.Do(func() { close(st) }) })
		if err != nil {
			t.Errorf("%s: stream cut without an end-of-stream message: %v", name, err)
			return
		}
		var es endStream
		if err := json.Unmarshal([]byte(end), &es); err != nil || es.Error.Code != "unavailable" ||
			!strings.HasPrefix(es.Error.Message, spacev1.ReasonExecutionReplaced+":") {
			t.Errorf("%s: end-of-stream %q (%v)", name, end, err)
		}
		if n != wantMsgs {
			t.Errorf("%s: %d messages, want %d", name, n, wantMsgs)
		}
	}()
	return d, st
}

func waitDone(t *testing.T, what string, chs ...<-chan struct{}) {
	t.Helper()
	for _, ch := range chs {
		select {
		case <-ch:
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: still open", what)
		}
	}
}

func routeOn(sbx string, gen uint64, worker string) identity.Route {
	r := route(sbx, gen)
	r.WorkerID = worker
	return r
}

// The seed scenario at the worker: S runs as execution 7 on worker A (w1)
// and resumes as execution 8 on worker B.
func TestSeedScenarioAtWorker(t *testing.T) {
	f := newLCFixture(t)
	r7 := route("sbxs", 7)
	f.install(t, r7)

	// A capability for execution 8 (on B) reaching A: refresh-route, and
	// the guest never sees the request.
	before := f.sub.forwarded.Load()
	resp, body := f.get(t, "/files", f.token(t, routeOn("sbxs", 8, "w2"), capability.PurposeFiles))
	if resp.StatusCode != http.StatusMisdirectedRequest || resp.Header.Get(spacev1.HeaderRouteOutcome) != spacev1.OutcomeRefreshRoute {
		t.Fatalf("capability for 8 at A: %d %s", resp.StatusCode, body)
	}
	if f.sub.forwarded.Load() != before {
		t.Fatal("a request for execution 8 was forwarded to execution 7")
	}
	// Until A learns of the retirement, 7 is served.
	if resp, body := f.get(t, "/files", f.token(t, r7, capability.PurposeFiles)); resp.StatusCode != 200 {
		t.Fatalf("7 before retirement: %d %s", resp.StatusCode, body)
	}

	// A PTY/process stream and a file watch open on A.
	proc := f.stream(t, "/process.Process/Start", r7, capability.PurposeProcess)
	watch := f.stream(t, "/filesystem.Filesystem/WatchDir", r7, capability.PurposeFilesystem)
	if proc.StatusCode != 200 || watch.StatusCode != 200 {
		t.Fatalf("streams: %d %d", proc.StatusCode, watch.StatusCode)
	}
	procDone, procStarted := expectReplacedEnd(t, "process stream", proc, 2)
	watchDone, watchStarted := expectReplacedEnd(t, "watch stream", watch, 2)
	waitDone(t, "first messages of the streams", procStarted, watchStarted)
	tok7 := f.token(t, r7, capability.PurposeFiles) // unexpired throughout

	if err := f.m.Retire(context.Background(), r7); err != nil {
		t.Fatal(err)
	}
	waitDone(t, "streams of the retired execution", procDone, watchDone)
	before = f.sub.forwarded.Load()
	resp, body = f.get(t, "/files", tok7)
	if resp.StatusCode != http.StatusMisdirectedRequest || resp.Header.Get(spacev1.HeaderRouteOutcome) != spacev1.OutcomeRefreshRoute ||
		!strings.Contains(body, "retired") {
		t.Fatalf("unexpired capability for retired 7: %d %s", resp.StatusCode, body)
	}
	if f.sub.forwarded.Load() != before {
		t.Fatal("retired execution served a request")
	}
	if rec, _ := f.m.Installed("sbxs"); !rec.Retired || f.m.Active() != 0 {
		t.Fatalf("after retire: %+v active=%d", rec, f.m.Active())
	}
}

func TestRetireRules(t *testing.T) {
	f := newLCFixture(t)
	ctx := context.Background()
	r7 := route("sbxr", 7)
	f.install(t, r7)
	// Unknown sandbox: nothing served, nothing to do.
	if err := f.m.Retire(ctx, route("other", 1)); err != nil {
		t.Fatalf("retire unknown: %v", err)
	}
	// A route newer than the installed one is not this worker's to retire.
	if err := f.m.Retire(ctx, route("sbxr", 9)); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("retire newer: %v", err)
	}
	if err := f.m.Retire(ctx, identity.Route{SandboxID: "Bad"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("retire invalid: %v", err)
	}
	for range 2 { // idempotent
		if err := f.m.Retire(ctx, r7); err != nil {
			t.Fatal(err)
		}
	}
	// A retired execution cannot be revived by a late or retried install.
	if _, err := f.m.Install(ctx, spacev1.InstallRequest{Route: r7, Template: "base"}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("reinstall retired: %v", err)
	}
	// Lifecycle calls on a retired execution are conflicts; snapshot works.
	if err := f.m.Pause(ctx, r7); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("pause retired: %v", err)
	}
	// A newer generation can be installed here; retiring the old route
	// afterwards (a late notice) is a no-op that leaves the new one alone.
	r8 := route("sbxr", 8)
	f.install(t, r8)
	if err := f.m.Retire(ctx, r7); err != nil {
		t.Fatal(err)
	}
	if resp, body := f.get(t, "/files", f.token(t, r8, capability.PurposeFiles)); resp.StatusCode != 200 || body != "file of sbxr gen 8" {
		t.Fatalf("8 after late retire of 7: %d %s", resp.StatusCode, body)
	}
	// Teardown removes a retired record.
	if err := f.m.Retire(ctx, r8); err != nil {
		t.Fatal(err)
	}
	if err := f.m.Teardown(ctx, r8); err != nil {
		t.Fatal(err)
	}
	if _, ok := f.m.Installed("sbxr"); ok {
		t.Fatal("record survived teardown")
	}
}

func TestPauseResume(t *testing.T) {
	f := newLCFixture(t)
	ctx := context.Background()
	r := route("sbxp", 1)
	f.install(t, r)
	inst := f.sub.last()
	proc := f.stream(t, "/process.Process/Start", r, capability.PurposeProcess)
	for range 2 {
		if err := f.m.Pause(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	if !inst.paused.Load() || inst.pauses.Load() != 1 || !f.m.Paused("sbxp") {
		t.Fatalf("paused=%v pauses=%d", inst.paused.Load(), inst.pauses.Load())
	}
	before := f.sub.forwarded.Load()
	resp, body := f.get(t, "/files", f.token(t, r, capability.PurposeFiles))
	var e spacev1.Error
	json.Unmarshal([]byte(body), &e)
	if resp.StatusCode != http.StatusConflict || e.Reason != ReasonPaused {
		t.Fatalf("request while paused: %d %s", resp.StatusCode, body)
	}
	if f.sub.forwarded.Load() != before {
		t.Fatal("request forwarded into a paused guest")
	}
	// Admission still comes first: a stale capability gets refresh-route.
	if resp, _ := f.get(t, "/files", f.token(t, route("sbxp", 0+2), capability.PurposeFiles)); resp.StatusCode != http.StatusMisdirectedRequest {
		t.Fatalf("stale capability while paused: %d", resp.StatusCode)
	}
	// Wrong execution, unknown sandbox.
	if err := f.m.Pause(ctx, route("sbxp", 2)); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("pause other execution: %v", err)
	}
	if err := f.m.Resume(ctx, route("nope", 1)); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("resume unknown: %v", err)
	}
	for range 2 {
		if err := f.m.Resume(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	if inst.paused.Load() || f.m.Paused("sbxp") {
		t.Fatal("still paused")
	}
	if resp, body := f.get(t, "/files", f.token(t, r, capability.PurposeFiles)); resp.StatusCode != 200 {
		t.Fatalf("after resume: %d %s", resp.StatusCode, body)
	}
	// The stream opened before the pause survived it (same execution).
	proc.Body.Close()
}

// Crash safety: install gen 1, retire, crash (no cleanup), reopen: the
// gen-1 capability gets RefreshRoute; a crash before the retirement was
// persisted leaves a record that is never forwarded to (no activation).
func TestRetiredSurvivesCrash(t *testing.T) {
	f := newLCFixture(t)
	r1 := route("sbxc", 1)
	f.install(t, r1)
	f.install(t, route("sbxd", 1))
	if err := f.m.Retire(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	f.crash()
	f.open(t)
	before := f.sub.forwarded.Load()
	resp, body := f.get(t, "/files", f.token(t, r1, capability.PurposeFiles))
	if resp.StatusCode != http.StatusMisdirectedRequest || resp.Header.Get(spacev1.HeaderRouteOutcome) != spacev1.OutcomeRefreshRoute {
		t.Fatalf("retired gen 1 after restart: %d %s", resp.StatusCode, body)
	}
	resp, body = f.get(t, "/files", f.token(t, route("sbxd", 1), capability.PurposeFiles))
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("unretired record without activation after restart: %d %s", resp.StatusCode, body)
	}
	if f.sub.forwarded.Load() != before {
		t.Fatal("restarted manager forwarded a request")
	}
	if rec, ok := f.m.Installed("sbxc"); !ok || !rec.Retired {
		t.Fatalf("record after restart: %+v %v", rec, ok)
	}
	// The retired execution can still be retired (idempotent) and torn down.
	if err := f.m.Retire(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	if err := f.m.Teardown(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
}
