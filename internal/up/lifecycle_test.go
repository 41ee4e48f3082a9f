package up

// Lifecycle integration tests (issue 3, DESIGN.md sections 3-7 and 11) on a
// platform of their own: three workers started by Start, plus a fourth
// worker (w4) that the test builds itself so that it can hold back what w4
// learns (its sandbox-record watch and the control plane's retire call go
// through gates the test opens) and stop and restart it on the same state
// directory.
//
// Covered here, through the full path (SDK or raw HTTP -> edge -> node-api
// -> sbx-manager -> bridge -> guest):
//   - the seed scenario: execution g on A, g+1 on B; a capability for g+1 at
//     A (which still holds g, unretired) is rejected before forwarding with
//     421 refresh-route; once A learns retirement a capability for g is 421
//     at A although unexpired, and 421 at B; through the edge the same calls
//     succeed after exactly one rebuilt attempt (edge repair metric), files
//     kept and processes restarted, as the migrate response says;
//   - a PTY and a file watch on A end with "execution replaced" when S moves;
//   - pause keeps the execution (same route, frozen processes), connect
//     resumes it on the same worker with its processes;
//   - key rotation: new kid end to end, the old key accepted until NotAfter;
//   - crash safety: A stopped in the middle of a move (when the retire call
//     reaches it) and reopened on its state dir serves nothing for S until it
//     reloaded its records and never serves the retired execution.
//
// Covered by unit tests in internal/edge (the edge's cache is internal):
//   - a delayed refresh for the old route does not evict the newer cache
//     entry: TestLateRefreshDoesNotEvictNewerEntry;
//   - repair keeps the authorization expiry: TestRefreshRouteRepairsOnceAndResendsBody
//     and TestRenewalAndReauthorization (AuthorizedUntil unchanged).
// Here the full path adds: after the repair, further calls go straight to
// the new execution with no other repair (the cache holds the new entry).

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	filesystempb "github.com/spacesbx/space/api/envd/filesystem"
	"github.com/spacesbx/space/api/envd/filesystem/filesystempbconnect"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/controlplane"
	"github.com/spacesbx/space/internal/node"
	"github.com/spacesbx/space/internal/sbxmanager"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/worker"
	"github.com/spacesbx/space/sdk"
)

// ---- a platform of the test's own ----

// lcPlat is a platform started by a test (the shared one has two workers).
type lcPlat struct {
	*Platform
	logPath string
}

// startPlatform starts a platform with n workers that is closed when the
// test ends (its log is dumped if the test failed).
func startPlatform(t *testing.T, n int) *lcPlat {
	t.Helper()
	dir, err := os.MkdirTemp("", "space-lc-test-")
	if err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(dir, "platform.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(logf, &slog.HandlerOptions{Level: slog.LevelInfo}))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	p, err := Start(ctx, Config{
		APIAddr: "127.0.0.1:0", EdgeAddr: "127.0.0.1:0", DataDir: filepath.Join(dir, "data"), Workers: n,
		BinDir: plat.cfg.BinDir, DefaultLimits: spacev1.Limits{MemoryBytes: testMemoryLimit, Pids: testPidsLimit},
		Logger: log,
	})
	cancel()
	if err != nil {
		logf.Close()
		dumpLog(logPath)
		os.RemoveAll(dir)
		t.Fatalf("up.Start with %d workers: %v", n, err)
	}
	lp := &lcPlat{Platform: p, logPath: logPath}
	t.Cleanup(func() {
		p.Close()
		testTransport.CloseIdleConnections()
		if err := p.Err(); err != nil {
			t.Errorf("platform component stopped on its own: %v", err)
		}
		if t.Failed() {
			dumpLog(logPath)
		}
		logf.Close()
		os.RemoveAll(dir)
	})
	return lp
}

func (lp *lcPlat) client(t *testing.T) *sdk.Client {
	t.Helper()
	c, err := sdk.New(sdk.Config{APIURL: lp.APIURL, SandboxURL: lp.SandboxURL, APIKey: lp.APIKey,
		HTTPClient: &http.Client{Transport: testTransport}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// newSandbox creates a secure sandbox on lp (the platform's close stops it).
func (lp *lcPlat) newSandbox(t *testing.T) *sdk.Sandbox {
	t.Helper()
	sbx, err := lp.client(t).CreateSandbox(ctxFor(t, 60*time.Second), sdk.CreateOptions{Secure: true, Timeout: 30 * time.Minute})
	if err != nil {
		t.Fatalf("create sandbox: %v", err)
	}
	return sbx
}

// api sends a control-plane request with the bootstrap (admin) API key.
func (lp *lcPlat) api(t *testing.T, method, path string, body any) response {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctxFor(t, 3*time.Minute), method, lp.APIURL+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(spacev1.HeaderAPIKey, lp.APIKey)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	res, err := (&http.Client{Transport: testTransport}).Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(res.Body, 8<<20))
	return response{status: res.StatusCode, header: res.Header, body: b}
}

func (lp *lcPlat) capability(t *testing.T, id, purpose string) spacev1.CapabilityResponse {
	t.Helper()
	r := lp.api(t, http.MethodPost, "/space/v1/sandboxes/"+id+"/capabilities", spacev1.CapabilityRequest{Purpose: purpose})
	if r.status != http.StatusOK {
		t.Fatalf("capability for %s: %d %s", id, r.status, r.body)
	}
	var cr spacev1.CapabilityResponse
	if err := json.Unmarshal(r.body, &cr); err != nil {
		t.Fatal(err)
	}
	if cr.Token == "" || cr.Route.SandboxID != id {
		t.Fatalf("capability for %s: incomplete answer %+v", id, cr)
	}
	return cr
}

// migrate moves id (to target, or the scheduler's pick when empty).
func (lp *lcPlat) migrate(t *testing.T, id, target string) spacev1.MigrateResponse {
	t.Helper()
	r := lp.api(t, http.MethodPost, "/space/v1/sandboxes/"+id+"/migrate", spacev1.MigrateRequest{TargetWorker: target})
	if r.status != http.StatusOK {
		t.Fatalf("migrate %s to %q: %d %s", id, target, r.status, r.body)
	}
	var mr spacev1.MigrateResponse
	if err := json.Unmarshal(r.body, &mr); err != nil {
		t.Fatalf("migrate answer: %v (%s)", err, r.body)
	}
	return mr
}

func (lp *lcPlat) record(t *testing.T, id string) store.SandboxRecord {
	t.Helper()
	rec, _, err := lp.st.GetSandbox(ctxFor(t, 10*time.Second), id)
	if err != nil {
		t.Fatalf("sandbox record %s: %v", id, err)
	}
	return rec
}

func (lp *lcPlat) worker(t *testing.T, id string) *worker.Worker {
	t.Helper()
	for i, w := range lp.Workers {
		if fmt.Sprintf("w%d", i+1) == id {
			return w
		}
	}
	t.Fatalf("no worker %s", id)
	return nil
}

// edgeRepairs reads the edge's rebuilt-attempt counter from its /metrics.
func (lp *lcPlat) edgeRepairs(t *testing.T) int {
	t.Helper()
	return metricValue(t, lp.SandboxURL+"/metrics", `space_edge_route_repairs_total{result="rebuilt"}`)
}

// metricValue returns the value of one series of a Prometheus text page (0
// when absent).
func metricValue(t *testing.T, u, series string) int {
	t.Helper()
	r := do(t, http.MethodGet, u, nil, nil)
	if r.status != http.StatusOK {
		t.Fatalf("GET %s: %d", u, r.status)
	}
	for _, l := range strings.Split(string(r.body), "\n") {
		if v, ok := strings.CutPrefix(l, series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("metric %s: %q", series, v)
			}
			return int(f)
		}
	}
	return 0
}

// wantRefresh asserts a 421 refresh-route answer that reached no sandbox.
func wantRefresh(t *testing.T, what string, r response) {
	t.Helper()
	e := wantJSONError(t, what, r, http.StatusMisdirectedRequest)
	if got := r.header.Get(spacev1.HeaderRouteOutcome); got != spacev1.OutcomeRefreshRoute || e.Reason != spacev1.OutcomeRefreshRoute {
		t.Fatalf("%s: outcome %q reason %q, want refresh-route", what, got, e.Reason)
	}
	if x := r.header.Get(spacev1.HeaderExecution); x != "" {
		t.Fatalf("%s: rejected request reached execution %s", what, x)
	}
}

// tokenKID returns the key id in a capability's footer.
func tokenKID(t *testing.T, tok string) string {
	t.Helper()
	parts := strings.Split(tok, ".")
	if len(parts) != 4 {
		t.Fatalf("capability has no footer: %.30q", tok)
	}
	f, err := base64.RawURLEncoding.DecodeString(parts[3])
	if err != nil {
		t.Fatalf("footer: %v", err)
	}
	var ft struct {
		KID string `json:"kid"`
	}
	if err := json.Unmarshal(f, &ft); err != nil || ft.KID == "" {
		t.Fatalf("footer %q: %v", f, err)
	}
	return ft.KID
}

// waitFor polls cond every 20 ms until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ---- the extra worker (w4) ----

// gatedWatch holds the worker's sandbox-record watch until open is closed:
// the worker does not learn of retirements from etcd meanwhile.
type gatedWatch struct {
	inner worker.SandboxWatcher
	open  chan struct{}
	once  sync.Once
}

func (g *gatedWatch) WatchSandboxes(ctx context.Context, fn func(worker.SandboxEvent)) error {
	select {
	case <-g.open:
	case <-ctx.Done():
		return ctx.Err()
	}
	return g.inner.WatchSandboxes(ctx, fn)
}

func (g *gatedWatch) Open() { g.once.Do(func() { close(g.open) }) }

// nodeProxy stands in front of w4's node-api: w4 registers the proxy's URL,
// so the control plane's node calls and the edge's traffic pass through it,
// and the test can intercept the retire call.
type nodeProxy struct {
	srv    *httptest.Server
	target atomic.Pointer[url.URL]
	// onRetire, when set, handles the control plane's retire call instead
	// of forwarding it.
	onRetire atomic.Pointer[func(http.ResponseWriter)]
	retires  atomic.Int32 // retire calls intercepted
}

func newNodeProxy(t *testing.T) *nodeProxy {
	np := &nodeProxy{}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(np.target.Load())
			pr.Out.Host = ""
		},
		Transport:     testTransport,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			w.WriteHeader(http.StatusBadGateway)
		},
	}
	np.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == spacev1.NodePathRetire {
			if h := np.onRetire.Load(); h != nil {
				np.retires.Add(1)
				(*h)(w)
				return
			}
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(np.srv.Close)
	return np
}

// refuseRetire makes the proxy answer the retire call with 503 after
// running before (if any).
func (np *nodeProxy) refuseRetire(before func()) {
	h := func(w http.ResponseWriter) {
		if before != nil {
			before()
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		json.NewEncoder(w).Encode(spacev1.Error{Code: http.StatusServiceUnavailable, Message: "worker unreachable (test)"})
	}
	np.onRetire.Store(&h)
}

type proxyRegistrar struct {
	st  *store.Store
	url string
}

func (r proxyRegistrar) RegisterWorker(ctx context.Context, w spacev1.Worker, ttl time.Duration) (io.Closer, error) {
	w.NodeURL = r.url
	return r.st.RegisterWorker(ctx, w, ttl)
}

// extraWorker is one run of w4.
type extraWorker struct {
	w      *worker.Worker
	gate   *gatedWatch
	cancel context.CancelFunc
	done   chan error
}

const extraID = "w4"

// newExtraWorker builds w4 on stateDir (records are loaded here, before
// anything is served) without running it.
func (lp *lcPlat) newExtraWorker(t *testing.T, np *nodeProxy, stateDir string) *extraWorker {
	t.Helper()
	gate := &gatedWatch{inner: node.SandboxWatch(lp.st), open: make(chan struct{})}
	// ns only, as w4 always ran: the host's microvm substrate stays with the platform's workers.
	nsSub, err := lp.host.NS(extraID)
	if err != nil {
		t.Fatal(err)
	}
	w, err := lp.host.NewWorker(node.WorkerConfig{ID: extraID, StateDir: stateDir},
		node.WorkerDeps{Store: lp.st, Registrar: proxyRegistrar{lp.st, np.srv.URL}, Sandboxes: gate, Substrates: []substrate.Substrate{nsSub}})
	if err != nil {
		t.Fatalf("worker %s: %v", extraID, err)
	}
	u, _ := url.Parse(w.URL())
	np.target.Store(u)
	return &extraWorker{w: w, gate: gate, done: make(chan error, 1)}
}

// run starts the worker and waits until it is registered.
func (lp *lcPlat) run(t *testing.T, ew *extraWorker) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ew.cancel = cancel
	go func() { ew.done <- ew.w.Run(ctx) }()
	t.Cleanup(func() { ew.stop(t) })
	waitFor(t, 30*time.Second, extraID+" registered", func() bool {
		ws, _ := lp.st.ListWorkers(context.Background())
		for _, w := range ws {
			if w.ID == extraID {
				return true
			}
		}
		return false
	})
}

// stop ends the worker's Run (idempotent) and waits for it.
func (ew *extraWorker) stop(t *testing.T) {
	if ew.cancel == nil {
		return
	}
	ew.cancel()
	select {
	case err, ok := <-ew.done:
		if ok && err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("worker %s: %v", extraID, err)
		}
		close(ew.done)
	case <-time.After(60 * time.Second):
		t.Errorf("worker %s did not stop within 60s", extraID)
	}
	ew.cancel = nil
}

// ---- the tests ----

func TestLifecycle(t *testing.T) {
	lp := startPlatform(t, 3)
	var ws []spacev1.Worker
	if r := lp.api(t, http.MethodGet, "/space/v1/workers", nil); r.status != http.StatusOK || json.Unmarshal(r.body, &ws) != nil || len(ws) != 3 {
		t.Fatalf("workers: %d %s, want 3", r.status, r.body)
	}

	t.Run("pause keeps the execution", func(t *testing.T) { testPauseKeepsExecution(t, lp) })
	t.Run("streams end with execution replaced", func(t *testing.T) { testStreamsReplaced(t, lp) })
	t.Run("key rotation", func(t *testing.T) { testKeyRotation(t, lp) })

	np := newNodeProxy(t)
	w4Dir := filepath.Join(lp.cfg.DataDir, "workers", extraID)
	t.Run("seed scenario", func(t *testing.T) { testSeedScenario(t, lp, np, w4Dir) })
	t.Run("crash during a move", func(t *testing.T) { testCrashDuringMove(t, lp, np, w4Dir) })
}

// startLoop starts a counter loop in the background (it survives the Run
// that started it) and returns the path of its counter file.
func startLoop(t *testing.T, sbx *sdk.Sandbox, name string) string {
	t.Helper()
	counter := "/home/user/" + name + ".count"
	script := fmt.Sprintf(`i=0; while :; do i=$((i+1)); echo $i > %s.tmp && mv %s.tmp %s; sleep 0.1; done # %s`, counter, counter, counter, name)
	r := mustRun(t, sbx, fmt.Sprintf(`(setsid nohup sh -c '%s' </dev/null >/dev/null 2>&1 &) ; sleep 0.5; cat %s`, script, counter), "")
	if r.code != 0 {
		t.Fatalf("start loop: code %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
	}
	return counter
}

func readCounter(t *testing.T, sbx *sdk.Sandbox, path string) int {
	t.Helper()
	b, err := sbx.ReadFile(ctxFor(t, 30*time.Second), path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("counter %q: %v", b, err)
	}
	return n
}

// loopPIDs lists the pids of the named loop inside the sandbox.
func loopPIDs(t *testing.T, sbx *sdk.Sandbox, name string) string {
	t.Helper()
	// The loop's own shells only: a child the loop has just forked (for
	// its mv or sleep) carries the same arguments until it execs, so a
	// process whose parent is a loop process is left out.
	r := mustRun(t, sbx, `ps -eo pid=,ppid=,args= | grep -F '# `+name+`' | grep -v grep | awk '{pid[$1]=1; pp[$1]=$2} END {for (p in pid) if (!(pp[p] in pid)) print p}' | sort | tr '\n' ' '`, "")
	return strings.TrimSpace(r.stdout)
}

func testPauseKeepsExecution(t *testing.T, lp *lcPlat) {
	sbx := lp.newSandbox(t)
	counter := startLoop(t, sbx, "pauseloop")
	pids := loopPIDs(t, sbx, "pauseloop")
	if pids == "" {
		t.Fatal("the loop is not running")
	}
	before := lp.record(t, sbx.ID)
	capBefore := lp.capability(t, sbx.ID, "files")
	nodeURL := lp.worker(t, before.Route.WorkerID).URL()

	c0 := readCounter(t, sbx, counter)
	if r := lp.api(t, http.MethodPost, "/sandboxes/"+sbx.ID+"/pause", nil); r.status != http.StatusNoContent {
		t.Fatalf("pause: %d %s", r.status, r.body)
	}
	pausedAt := time.Now()
	rec := lp.record(t, sbx.ID)
	if rec.State != store.StatePaused || rec.Route != before.Route || rec.Generation != before.Generation {
		t.Fatalf("paused record: state %s route %v (gen %d), want paused %v (gen %d)", rec.State, rec.Route, rec.Generation, before.Route, before.Generation)
	}
	// Still installed, same execution, on the same worker; nothing reaches
	// the frozen guest: 409 paused.
	inst, ok := lp.worker(t, before.Route.WorkerID).Manager().Installed(sbx.ID)
	if !ok || inst.Route != before.Route || inst.Retired {
		t.Fatalf("paused execution on %s: %+v ok=%v", before.Route.WorkerID, inst, ok)
	}
	r := nodeGet(t, nodeURL, capBefore.Token, "/files?path="+counter, nil)
	if e := wantJSONError(t, "read while paused (node-api)", r, http.StatusConflict); e.Reason != sbxmanager.ReasonPaused {
		t.Fatalf("read while paused: reason %q", e.Reason)
	}
	// Through the edge: E2B's 502 for a paused sandbox, reason "paused".
	if _, err := sbx.ReadFile(ctxFor(t, 30*time.Second), counter); sdkStatus(err) != http.StatusBadGateway || !errors.Is(err, sdk.ErrConflict) {
		t.Fatalf("read while paused (edge): %v", err)
	}
	// A second pause is a conflict, not a second operation.
	if r := lp.api(t, http.MethodPost, "/sandboxes/"+sbx.ID+"/pause", nil); r.status != http.StatusConflict {
		t.Fatalf("second pause: %d %s", r.status, r.body)
	}
	time.Sleep(4 * time.Second)

	r = lp.api(t, http.MethodPost, "/v2/sandboxes/"+sbx.ID+"/connect", map[string]int{"timeout": 1800})
	if r.status != http.StatusCreated {
		t.Fatalf("connect (resume): %d %s", r.status, r.body)
	}
	pause := time.Since(pausedAt)
	rec = lp.record(t, sbx.ID)
	if rec.State != store.StateRunning || rec.Route != before.Route {
		t.Fatalf("resumed record: state %s route %v, want running %v", rec.State, rec.Route, before.Route)
	}
	c1 := readCounter(t, sbx, counter)
	// 10 ticks a second: had the loop run while paused it would have
	// advanced by about 40.
	if d := c1 - c0; d > 20 {
		t.Fatalf("the counter advanced by %d over a %s pause (%d -> %d): processes were not frozen", d, pause.Round(time.Millisecond), c0, c1)
	}
	// The same processes run on: same pids, the counter moves again.
	if got := loopPIDs(t, sbx, "pauseloop"); got != pids {
		t.Fatalf("loop pids %q after resume, were %q", got, pids)
	}
	waitFor(t, 10*time.Second, "the counter to advance after resume", func() bool { return readCounter(t, sbx, counter) > c1 })
	// The capability issued before the pause still reaches the same
	// execution: pause and resume kept it.
	r = nodeGet(t, nodeURL, capBefore.Token, "/files?path="+counter, nil)
	if r.status != http.StatusOK || r.header.Get(spacev1.HeaderExecution) != before.Route.ExecutionLabel() {
		t.Fatalf("pre-pause capability after resume: %d %s (execution %q)", r.status, r.body, r.header.Get(spacev1.HeaderExecution))
	}
	// Connect on a running sandbox only extends it: 200, no new execution.
	if r := lp.api(t, http.MethodPost, "/v2/sandboxes/"+sbx.ID+"/connect", map[string]int{"timeout": 1800}); r.status != http.StatusOK {
		t.Fatalf("connect (running): %d %s", r.status, r.body)
	}
	if rec := lp.record(t, sbx.ID); rec.Route != before.Route {
		t.Fatalf("connect changed the route: %v", rec.Route)
	}
	t.Logf("pause %s: counter %d -> %d", pause.Round(time.Millisecond), c0, c1)
}

func testStreamsReplaced(t *testing.T, lp *lcPlat) {
	sbx := lp.newSandbox(t)
	mustRun(t, sbx, "mkdir -p /home/user/watched", "")
	from := lp.record(t, sbx.ID).Route

	ctx := ctxFor(t, 2*time.Minute)
	p, err := sbx.PTY(ctx, 24, 80)
	if err != nil {
		t.Fatalf("pty: %v", err)
	}
	defer p.Close()
	if _, err := p.Write([]byte("echo pty-$((6*7))\n")); err != nil {
		t.Fatal(err)
	}
	// Drain the PTY's output (the stream never blocks on the pipe) and wait
	// until the shell answered: the terminal is live on A.
	var outMu sync.Mutex
	var out bytes.Buffer
	ptyOut := make(chan struct{})
	go func() {
		defer close(ptyOut)
		buf := make([]byte, 4096)
		for {
			n, err := p.Read(buf)
			outMu.Lock()
			out.Write(buf[:n])
			outMu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	waitFor(t, 20*time.Second, "the PTY to answer pty-42", func() bool {
		outMu.Lock()
		defer outMu.Unlock()
		return bytes.Contains(out.Bytes(), []byte("pty-42"))
	})

	hc := &http.Client{Transport: headerTransport{base: testTransport, hdr: map[string]string{
		"E2b-Sandbox-Id": sbx.ID, "E2b-Sandbox-Port": "49983", "X-Access-Token": sbx.AccessToken}}}
	fs := filesystempbconnect.NewFilesystemClient(hc, lp.SandboxURL, connect.WithProtoJSON())
	stream, err := fs.WatchDir(ctx, connect.NewRequest(&filesystempb.WatchDirRequest{Path: "/home/user/watched"}))
	if err != nil {
		t.Fatalf("watch: %v", err)
	}
	defer stream.Close()
	if !stream.Receive() || stream.Msg().GetStart() == nil {
		t.Fatalf("no start event: %v", stream.Err())
	}
	if got := stream.ResponseHeader().Get(spacev1.HeaderExecution); got != from.ExecutionLabel() {
		t.Fatalf("watch opened on %q, want %q", got, from.ExecutionLabel())
	}
	watchEnd := make(chan error, 1)
	go func() {
		for stream.Receive() {
		}
		watchEnd <- stream.Err()
	}()
	ptyEnd := make(chan error, 1)
	go func() { _, err := p.Wait(); ptyEnd <- err }()

	target := "w1"
	if from.WorkerID == target {
		target = "w2"
	}
	mv := lp.migrate(t, sbx.ID, target)
	moved := time.Now()
	if mv.Route.WorkerID != target || mv.Route.Generation != from.Generation+1 {
		t.Fatalf("moved to %v, want generation %d on %s", mv.Route, from.Generation+1, target)
	}

	within := 5 * time.Second
	select {
	case err := <-ptyEnd:
		var se *sdk.Error
		if !errors.As(err, &se) || !errors.Is(err, sdk.ErrUnavailable) || se.Code != connect.CodeUnavailable.String() ||
			!strings.Contains(se.Message, spacev1.ReasonExecutionReplaced) {
			t.Fatalf("PTY ended with %v (%T), want unavailable %q", err, err, spacev1.ReasonExecutionReplaced)
		}
		t.Logf("PTY ended %s after the move returned: %v", time.Since(moved).Round(time.Millisecond), err)
	case <-time.After(within):
		t.Fatalf("the PTY on %s did not end within %s of the move", from.WorkerID, within)
	}
	select {
	case err := <-watchEnd:
		if connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), spacev1.ReasonExecutionReplaced) {
			t.Fatalf("watch ended with %v (code %v), want unavailable %q", err, connect.CodeOf(err), spacev1.ReasonExecutionReplaced)
		}
		t.Logf("watch ended %s after the move returned: %v", time.Since(moved).Round(time.Millisecond), err)
	case <-time.After(within):
		t.Fatalf("the file watch on %s did not end within %s of the move", from.WorkerID, within)
	}
	<-ptyOut
	// New streams open on the new execution.
	stream2, err := fs.WatchDir(ctx, connect.NewRequest(&filesystempb.WatchDirRequest{Path: "/home/user/watched"}))
	if err != nil {
		t.Fatalf("watch after the move: %v", err)
	}
	defer stream2.Close()
	if !stream2.Receive() || stream2.Msg().GetStart() == nil {
		t.Fatalf("no start event after the move: %v", stream2.Err())
	}
	if got := stream2.ResponseHeader().Get(spacev1.HeaderExecution); got != mv.Route.ExecutionLabel() {
		t.Fatalf("watch after the move opened on %q, want %q", got, mv.Route.ExecutionLabel())
	}
}

func testKeyRotation(t *testing.T, lp *lcPlat) {
	sbx := lp.newSandbox(t)
	oldCap := lp.capability(t, sbx.ID, "files")
	oldKID := tokenKID(t, oldCap.Token)
	nodeURL := lp.worker(t, oldCap.Route.WorkerID).URL()
	const path = "/files?path=/etc/hostname"

	start := time.Now()
	r := lp.api(t, http.MethodPost, "/space/v1/keys/rotate", nil)
	if r.status != http.StatusOK {
		t.Fatalf("rotate: %d %s", r.status, r.body)
	}
	var rot spacev1.RotateResponse
	if err := json.Unmarshal(r.body, &rot); err != nil {
		t.Fatal(err)
	}
	if rot.KeyID == "" || rot.KeyID == oldKID || rot.PreviousKeyID != oldKID {
		t.Fatalf("rotation %+v, old kid %s", rot, oldKID)
	}
	// The bundle holds both keys; the old one retires 135 s (plus the
	// propagation delay) after the rotation, never earlier.
	b, err := lp.st.GetBundle(ctxFor(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var oldKey, newKey *capability.Key
	for i := range b.Keys {
		switch b.Keys[i].ID {
		case oldKID:
			oldKey = &b.Keys[i]
		case rot.KeyID:
			newKey = &b.Keys[i]
		}
	}
	if oldKey == nil || newKey == nil {
		t.Fatalf("bundle %d lacks the old or new key: %+v", b.Revision, b.Keys)
	}
	if !newKey.NotAfter.IsZero() {
		t.Fatalf("new key has NotAfter %v", newKey.NotAfter)
	}
	lo := start.Add(capability.RetiredKeyGrace)
	hi := time.Now().Add(capability.RetiredKeyGrace + controlplane.DefaultKeyPropagation + time.Second)
	if oldKey.NotAfter.Before(lo) || oldKey.NotAfter.After(hi) || !oldKey.NotAfter.Equal(rot.PreviousNotAfter) {
		t.Fatalf("old key NotAfter %v (answer %v), want in [%v, %v]", oldKey.NotAfter, rot.PreviousNotAfter, lo, hi)
	}
	if !oldKey.NotAfter.After(oldCap.ExpiresAt.Add(capability.Skew)) {
		t.Fatalf("old key retires at %v before its last token expires (%v + skew)", oldKey.NotAfter, oldCap.ExpiresAt)
	}
	// Every worker picked the bundle up.
	for i, w := range lp.Workers {
		waitFor(t, 10*time.Second, fmt.Sprintf("w%d to install bundle %d", i+1, b.Revision), func() bool { return w.Verifier().Revision() >= b.Revision })
	}

	// New capabilities carry the new kid and work at node-api and end to end.
	newCap := lp.capability(t, sbx.ID, "files")
	if kid := tokenKID(t, newCap.Token); kid != rot.KeyID {
		t.Fatalf("capability after rotation signed by %s, want %s", kid, rot.KeyID)
	}
	if r := nodeGet(t, nodeURL, newCap.Token, path, nil); r.status != http.StatusOK {
		t.Fatalf("new-key capability: %d %s", r.status, r.body)
	}
	assertServing(t, sbx)
	if _, err := sbx.WriteFile(ctxFor(t, 30*time.Second), "/home/user/after-rotation", []byte("ok")); err != nil {
		t.Fatalf("write after rotation: %v", err)
	}
	// The old-key capability is still accepted (unexpired, key before
	// NotAfter).
	if r := nodeGet(t, nodeURL, oldCap.Token, path, nil); r.status != http.StatusOK {
		t.Fatalf("old-key capability before NotAfter: %d %s", r.status, r.body)
	}
	// With the published bundle, a receiver whose clock is past the old
	// key's NotAfter rejects the old key's tokens (not waiting 135 s).
	v, err := capability.NewVerifier(b)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(oldCap.Token, capability.PurposeFiles); err != nil {
		t.Fatalf("old-key capability now: %v", err)
	}
	v.SetClock(func() time.Time { return oldKey.NotAfter.Add(time.Second) })
	if _, err := v.Verify(oldCap.Token, capability.PurposeFiles); !errors.Is(err, capability.ErrKeyNotValid) {
		t.Fatalf("old-key capability after NotAfter: %v, want %v", err, capability.ErrKeyNotValid)
	}
	t.Logf("rotated %s -> %s; old key NotAfter %s after the rotation", oldKID, rot.KeyID, oldKey.NotAfter.Sub(start).Round(time.Second))
}

func testSeedScenario(t *testing.T, lp *lcPlat, np *nodeProxy, w4Dir string) {
	a := lp.newExtraWorker(t, np, w4Dir)
	lp.run(t, a)
	sbx := lp.newSandbox(t)
	ctx := ctxFor(t, 3*time.Minute)
	// S runs on A = w4 as execution g.
	if lp.record(t, sbx.ID).Route.WorkerID != extraID {
		lp.migrate(t, sbx.ID, extraID)
	}
	old := lp.record(t, sbx.ID).Route
	if old.WorkerID != extraID {
		t.Fatalf("S is on %s, want %s", old.WorkerID, extraID)
	}
	content := []byte("kept across the move " + randHex(8) + "\n")
	if _, err := sbx.WriteFile(ctx, "/home/user/kept.txt", content); err != nil {
		t.Fatal(err)
	}
	counter := startLoop(t, sbx, "seedloop")
	if loopPIDs(t, sbx, "seedloop") == "" {
		t.Fatal("the loop is not running")
	}
	// Warm the edge's cache (files and process entries name g on A).
	if got, err := sbx.ReadFile(ctx, "/home/user/kept.txt"); err != nil || !bytes.Equal(got, content) {
		t.Fatalf("read on A: %q %v", got, err)
	}
	assertServing(t, sbx)
	capOld := lp.capability(t, sbx.ID, "files")
	if capOld.Route != old || capOld.NodeURL != np.srv.URL {
		t.Fatalf("capability %v at %s, want %v at %s", capOld.Route, capOld.NodeURL, old, np.srv.URL)
	}
	const path = "/files?path=/home/user/kept.txt"
	r := nodeGet(t, a.w.URL(), capOld.Token, path, nil)
	if r.status != http.StatusOK || r.header.Get(spacev1.HeaderExecution) != old.ExecutionLabel() {
		t.Fatalf("g at A: %d %s", r.status, r.body)
	}

	// S moves to B; A does not hear of it: the control plane's retire call
	// is refused at A's door and A's record watch is held.
	np.refuseRetire(nil)
	mv := lp.migrate(t, sbx.ID, "w1")
	np.onRetire.Store(nil)
	if np.retires.Load() == 0 {
		t.Fatal("the control plane never called retire on A")
	}
	if mv.From != old || mv.Route.Generation != old.Generation+1 || mv.Route.WorkerID != "w1" || mv.Route.ExecutionID == old.ExecutionID {
		t.Fatalf("migrate: from %v to %v", mv.From, mv.Route)
	}
	if !mv.ProcessesRestarted || !mv.FilesKept || !strings.Contains(mv.Note, "processes were restarted") || !strings.Contains(mv.Note, "files were kept") {
		t.Fatalf("migrate answer does not say what moved: %+v", mv)
	}
	if rec := lp.record(t, sbx.ID); rec.Route != mv.Route || rec.State != store.StateRunning {
		t.Fatalf("record after the move: %s %v", rec.State, rec.Route)
	}
	capNew := lp.capability(t, sbx.ID, "files")
	if capNew.Route != mv.Route {
		t.Fatalf("capability after the move names %v, want %v", capNew.Route, mv.Route)
	}
	bURL := lp.worker(t, "w1").URL()

	// A still holds g, unretired (it has not learned anything yet).
	inst, ok := a.w.Manager().Installed(sbx.ID)
	if !ok || inst.Route != old || inst.Retired {
		t.Fatalf("A's record before it learned retirement: %+v ok=%v", inst, ok)
	}
	// A capability for g+1 sent to A is rejected before forwarding.
	wantRefresh(t, "g+1 at A (A unaware of the move)", nodeGet(t, a.w.URL(), capNew.Token, path, nil))
	// g is frozen by the move: A serves nothing of it either.
	if r := nodeGet(t, a.w.URL(), capOld.Token, path, nil); r.status == http.StatusOK || r.header.Get(spacev1.HeaderExecution) != "" {
		t.Fatalf("g at A after the move, before retirement: %d %s", r.status, r.body)
	}

	// A learns retirement from its record watch.
	a.gate.Open()
	waitFor(t, 15*time.Second, "A to retire g", func() bool {
		inst, ok := a.w.Manager().Installed(sbx.ID)
		return !ok || inst.Retired
	})
	if !time.Now().Before(capOld.ExpiresAt) {
		t.Fatalf("capability for g expired (%v) before the check", capOld.ExpiresAt)
	}
	wantRefresh(t, "g at A after retirement (unexpired)", nodeGet(t, a.w.URL(), capOld.Token, path, nil))
	wantRefresh(t, "g at B", nodeGet(t, bURL, capOld.Token, path, nil))
	wantRefresh(t, "g+1 at A after retirement", nodeGet(t, a.w.URL(), capNew.Token, path, nil))
	r = nodeGet(t, bURL, capNew.Token, path, nil)
	if r.status != http.StatusOK || r.header.Get(spacev1.HeaderExecution) != mv.Route.ExecutionLabel() || !bytes.Equal(r.body, content) {
		t.Fatalf("g+1 at B: %d %q (execution %q)", r.status, r.body, r.header.Get(spacev1.HeaderExecution))
	}

	// Through the edge (its cache still names g on A): each call succeeds
	// after exactly one rebuilt attempt. Files were kept.
	n0 := lp.edgeRepairs(t)
	got, err := sbx.ReadFile(ctx, "/home/user/kept.txt")
	if err != nil || !bytes.Equal(got, content) {
		t.Fatalf("read through the edge after the move: %q %v", got, err)
	}
	n1 := lp.edgeRepairs(t)
	if n1-n0 != 1 {
		t.Fatalf("read after the move: %d rebuilt attempts, want 1", n1-n0)
	}
	// The repaired entry is used from now on: no further repair.
	if _, err := sbx.ReadFile(ctx, "/home/user/kept.txt"); err != nil {
		t.Fatal(err)
	}
	if n := lp.edgeRepairs(t); n != n1 {
		t.Fatalf("second read after the move repaired again (%d -> %d)", n1, n)
	}
	// Processes were restarted: the loop is gone, its counter stands still.
	r0 := mustRun(t, sbx, "cat "+counter, "")
	n2 := lp.edgeRepairs(t)
	if n2-n1 != 1 {
		t.Fatalf("exec after the move: %d rebuilt attempts, want 1", n2-n1)
	}
	if pids := loopPIDs(t, sbx, "seedloop"); pids != "" {
		t.Fatalf("the loop survived the move: pids %q", pids)
	}
	time.Sleep(500 * time.Millisecond)
	if r1 := mustRun(t, sbx, "cat "+counter, ""); r1.stdout != r0.stdout || r0.stdout == "" {
		t.Fatalf("counter after the move: %q then %q (want a kept, still value)", r0.stdout, r1.stdout)
	}
	// The edge's answers come from g+1.
	er := do(t, http.MethodGet, lp.SandboxURL+path, nil, map[string]string{
		"E2b-Sandbox-Id": sbx.ID, "E2b-Sandbox-Port": "49983", "X-Access-Token": sbx.AccessToken})
	if er.status != http.StatusOK || er.header.Get(spacev1.HeaderExecution) != mv.Route.ExecutionLabel() {
		t.Fatalf("edge after the move: %d, execution %q, want %q", er.status, er.header.Get(spacev1.HeaderExecution), mv.Route.ExecutionLabel())
	}
	a.stop(t)
}

func testCrashDuringMove(t *testing.T, lp *lcPlat, np *nodeProxy, w4Dir string) {
	a := lp.newExtraWorker(t, np, w4Dir)
	lp.run(t, a)
	sbx := lp.newSandbox(t)
	ctx := ctxFor(t, 3*time.Minute)
	if lp.record(t, sbx.ID).Route.WorkerID != extraID {
		lp.migrate(t, sbx.ID, extraID)
	}
	old := lp.record(t, sbx.ID).Route
	content := []byte("before the crash " + randHex(8) + "\n")
	if _, err := sbx.WriteFile(ctx, "/home/user/crash.txt", content); err != nil {
		t.Fatal(err)
	}
	capOld := lp.capability(t, sbx.ID, "files")
	const path = "/files?path=/home/user/crash.txt"
	if r := nodeGet(t, a.w.URL(), capOld.Token, path, nil); r.status != http.StatusOK {
		t.Fatalf("g at A: %d %s", r.status, r.body)
	}

	// A is killed in the middle of the move: after the new execution is
	// published, when the control plane's retire call reaches it, before
	// it could record the retirement.
	np.refuseRetire(func() { a.cancel() })
	mv := lp.migrate(t, sbx.ID, "w2")
	np.onRetire.Store(nil)
	a.stop(t)
	if np.retires.Load() == 0 || mv.Route.WorkerID != "w2" || mv.Route.Generation != old.Generation+1 {
		t.Fatalf("move: retires %d, route %v", np.retires.Load(), mv.Route)
	}

	// Restart A on the same state directory, its watch held. Its records
	// are loaded before anything can be served: g is there, unretired
	// (A never learned), and nothing is active.
	a2 := lp.newExtraWorker(t, np, w4Dir)
	inst, ok := a2.w.Manager().Installed(sbx.ID)
	if !ok || inst.Route != old || inst.Retired {
		t.Fatalf("A's reloaded record: %+v ok=%v, want g=%v unretired", inst, ok, old)
	}
	if n := a2.w.Manager().Active(); n != 0 {
		t.Fatalf("A runs %d activations right after restart", n)
	}
	lp.run(t, a2)
	// The unexpired capability for g is never served by A.
	r := nodeGet(t, a2.w.URL(), capOld.Token, path, nil)
	if r.status == http.StatusOK || r.header.Get(spacev1.HeaderExecution) != "" || bytes.Contains(r.body, content) {
		t.Fatalf("restarted A served the retired execution: %d %s", r.status, r.body)
	}
	t.Logf("restarted A, before it learned retirement, answers g with %d %s", r.status, bytes.TrimSpace(r.body))
	// Once its watch runs, A retires g: 421 refresh-route.
	a2.gate.Open()
	waitFor(t, 15*time.Second, "restarted A to retire g", func() bool {
		inst, ok := a2.w.Manager().Installed(sbx.ID)
		return !ok || inst.Retired
	})
	wantRefresh(t, "g at restarted A", nodeGet(t, a2.w.URL(), capOld.Token, path, nil))
	// S serves from B with its files, through the edge.
	got, err := sbx.ReadFile(ctx, "/home/user/crash.txt")
	if err != nil || !bytes.Equal(got, content) {
		t.Fatalf("read on B after the crash: %q %v", got, err)
	}
	a2.stop(t)
}
