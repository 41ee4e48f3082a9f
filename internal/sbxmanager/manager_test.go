package sbxmanager

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

var spacedHost string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "sbxmanager-test")
	if err != nil {
		panic(err)
	}
	spacedHost = filepath.Join(dir, "spaced-host")
	if out, err := exec.Command("go", "build", "-o", spacedHost, "github.com/spacesbx/space/cmd/spaced-host").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build spaced-host: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			code = 1
		}
	}
	os.Exit(code)
}

// writeTestError answers refused requests as node-api's WriteError does
// (nodeapi imports this package, so its tests cannot import nodeapi).
func writeTestError(w http.ResponseWriter, err error) {
	status := errdefs.HTTPStatus(err)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(spacev1.Error{Code: status, Message: err.Error(), Reason: errdefs.Reason(err)})
}

// fakeSubstrate runs an in-process guest per activation: the request path
// above it (admission, spaced-host, peer checks) is the real one.
type fakeSubstrate struct {
	mu      sync.Mutex
	started int
	// startGate, when set, is received from before a start completes.
	startGate chan struct{}
	// startErr, when set, fails every start.
	startErr error
	// reportGeneration, when set, is the generation every guest reports
	// as its own (a guest that is not the execution it should be).
	reportGeneration atomic.Uint64
}

type fakeInstance struct {
	route identity.Route
	sock  string
	srv   *http.Server
	done  chan struct{}
	once  sync.Once
}

func (f *fakeSubstrate) Name() string { return identity.SubstrateNS }

// Capabilities are an ns sandbox's: the guest's listener is this process
// (its network namespace stands for the sandbox's).
func (f *fakeSubstrate) Capabilities() substrate.Capabilities {
	return substrate.Capabilities{Netns: true}
}

// fakeLayer is the writable layer's directory in a fake activation
// directory (a plain directory: nothing to mount).
const fakeLayer = "upper"

func (f *fakeSubstrate) PrepareLayer(_ context.Context, dir string, _ substrate.Limits) (string, func() error, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", nil, err
	}
	return f.LayerDir(dir), func() error { return nil }, nil
}

func (f *fakeSubstrate) LayerDir(dir string) string { return filepath.Join(dir, fakeLayer) }

func (f *fakeSubstrate) Start(ctx context.Context, spec substrate.Spec) (substrate.Instance, error) {
	f.mu.Lock()
	gate, startErr := f.startGate, f.startErr
	f.mu.Unlock()
	if gate != nil {
		<-gate
	}
	if startErr != nil {
		return nil, startErr
	}
	if err := os.MkdirAll(spec.Dir, 0o700); err != nil {
		return nil, err
	}
	sock := filepath.Join(spec.Dir, "guest.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		return nil, err
	}
	route := spec.Route
	mux := http.NewServeMux()
	mux.HandleFunc("GET /_space/identity", func(w http.ResponseWriter, r *http.Request) {
		id := route
		if g := f.reportGeneration.Load(); g != 0 {
			id.Generation = g
		}
		json.NewEncoder(w).Encode(id)
	})
	mux.HandleFunc("/files", func(w http.ResponseWriter, r *http.Request) {
		if d, err := time.ParseDuration(r.URL.Query().Get("delay")); err == nil {
			time.Sleep(d)
		}
		fmt.Fprintf(w, "file of %s gen %d", route.SandboxID, route.Generation)
	})
	mux.HandleFunc("/process.Process/Start", func(w http.ResponseWriter, r *http.Request) {
		// A stream that lasts until the client or the lease ends it, or
		// (?end=<duration>) a command that finishes after that long.
		w.WriteHeader(200)
		fmt.Fprintln(w, "started")
		w.(http.Flusher).Flush()
		if d, err := time.ParseDuration(r.URL.Query().Get("end")); err == nil {
			select {
			case <-time.After(d):
				fmt.Fprintln(w, "finished")
			case <-r.Context().Done():
			}
			return
		}
		<-r.Context().Done()
	})
	inst := &fakeInstance{route: route, sock: sock, srv: &http.Server{Handler: mux}, done: make(chan struct{})}
	go inst.srv.Serve(l)
	f.mu.Lock()
	f.started++
	f.mu.Unlock()
	return inst, nil
}

func (i *fakeInstance) Route() identity.Route        { return i.route }
func (i *fakeInstance) GuestSocket() string          { return i.sock }
func (i *fakeInstance) InitPID() int                 { return os.Getpid() }
func (i *fakeInstance) Pause(context.Context) error  { return nil }
func (i *fakeInstance) Resume(context.Context) error { return nil }
func (i *fakeInstance) Done() <-chan struct{}        { return i.done }
func (i *fakeInstance) Stop(context.Context) error {
	i.once.Do(func() { i.srv.Close(); close(i.done) })
	return nil
}

type fixture struct {
	m      *Manager
	signer *capability.Signer
	srv    *httptest.Server
	dir    string
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	signer, _ := capability.NewSigner("k1", priv)
	ver, _ := capability.NewVerifier(capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: pub}}})
	dir := t.TempDir()
	m, err := New(Config{WorkerID: "w1", StateDir: dir, SpacedHostPath: spacedHost, AgentPath: "/nonexistent", EnvdVersion: "0.5.7"},
		Deps{Substrates: []substrate.Substrate{&fakeSubstrate{}}, WriteError: writeTestError, Verifier: ver})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m)
	t.Cleanup(func() { srv.Close(); m.Close() })
	return &fixture{m: m, signer: signer, srv: srv, dir: dir}
}

func route(sbx string, gen uint64) identity.Route {
	return identity.Route{SandboxID: sbx, Generation: gen, ExecutionID: fmt.Sprintf("e%d", gen), WorkerID: "w1", Substrate: "ns", ActivationID: "a1"}
}

func (f *fixture) token(t *testing.T, r identity.Route, p capability.Purpose) string {
	t.Helper()
	tok, _, err := f.signer.Issue(capability.Claims{Route: r, Purpose: p})
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func (f *fixture) get(t *testing.T, path, token string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", f.srv.URL+path, nil)
	if token != "" {
		req.Header.Set(spacev1.HeaderCapability, token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, string(b)
}

func (f *fixture) install(t *testing.T, r identity.Route) {
	t.Helper()
	if _, err := f.m.Install(context.Background(), spacev1.InstallRequest{Route: r, Template: "base"}); err != nil {
		t.Fatal(err)
	}
}

func TestAllowForwardsThroughBridge(t *testing.T) {
	f := newFixture(t)
	f.install(t, route("sbxa", 1))
	resp, body := f.get(t, "/files?path=x", f.token(t, route("sbxa", 1), capability.PurposeFiles))
	if resp.StatusCode != 200 || body != "file of sbxa gen 1" {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
	if got := resp.Header.Get(spacev1.HeaderExecution); got != "sbxa/1/e1" {
		t.Fatalf("Space-Execution %q", got)
	}
}

func TestOutcomesOnTheWire(t *testing.T) {
	f := newFixture(t)
	f.install(t, route("sbxa", 2))
	f.install(t, route("sbxb", 1))
	tampered := f.token(t, route("sbxa", 2), capability.PurposeFiles)
	tampered = tampered[:30] + string('A'+(tampered[30]-'A'+1)%26) + tampered[31:]
	cases := []struct {
		name    string
		token   string
		status  int
		outcome string
	}{
		{"missing capability", "", 403, spacev1.OutcomeDeny},
		{"tampered capability", tampered, 403, spacev1.OutcomeDeny},
		{"wrong purpose", f.token(t, route("sbxa", 2), capability.PurposeProcess), 403, spacev1.OutcomeDeny},
		{"older generation", f.token(t, route("sbxa", 1), capability.PurposeFiles), 421, spacev1.OutcomeRefreshRoute},
		{"newer generation", f.token(t, route("sbxa", 3), capability.PurposeFiles), 421, spacev1.OutcomeRefreshRoute},
		{"unknown sandbox", f.token(t, route("sbxz", 1), capability.PurposeFiles), 421, spacev1.OutcomeRefreshRoute},
	}
	for _, tc := range cases {
		resp, body := f.get(t, "/files", tc.token)
		if resp.StatusCode != tc.status || resp.Header.Get(spacev1.HeaderRouteOutcome) != tc.outcome {
			t.Errorf("%s: %d %q %s", tc.name, resp.StatusCode, resp.Header.Get(spacev1.HeaderRouteOutcome), body)
		}
		var e spacev1.Error
		if json.Unmarshal([]byte(body), &e) != nil || e.Message == "" {
			t.Errorf("%s: body is not a JSON error: %s", tc.name, body)
		}
	}
	// A capability for sandbox A reaches only A's execution.
	resp, body := f.get(t, "/files", f.token(t, route("sbxa", 2), capability.PurposeFiles))
	if resp.StatusCode != 200 || !strings.HasPrefix(body, "file of sbxa") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	// Unknown guest paths are refused before admission.
	if resp, _ := f.get(t, "/etc/passwd", f.token(t, route("sbxa", 2), capability.PurposeFiles)); resp.StatusCode != 404 {
		t.Fatalf("unknown path: %d", resp.StatusCode)
	}
}

// A restarted manager reloads its records before serving: it never
// forwards to an execution it has no activation for, and still tells a
// stale route apart (RefreshRoute) from a forged one (Deny).
func TestRestartReloadsRecordsFailClosed(t *testing.T) {
	f := newFixture(t)
	f.install(t, route("sbxa", 1))
	f.srv.Close()
	f.m.Close()
	pub := f.m.ver
	m2, err := New(Config{WorkerID: "w1", StateDir: f.dir, SpacedHostPath: spacedHost, AgentPath: "/x"},
		Deps{Substrates: []substrate.Substrate{&fakeSubstrate{}}, WriteError: writeTestError, Verifier: pub})
	if err != nil {
		t.Fatal(err)
	}
	defer m2.Close()
	if n := len(m2.Records()); n != 1 {
		t.Fatalf("records after restart: %d", n)
	}
	srv := httptest.NewServer(m2)
	defer srv.Close()
	req, _ := http.NewRequest("GET", srv.URL+"/files", nil)
	req.Header.Set(spacev1.HeaderCapability, f.token(t, route("sbxa", 1), capability.PurposeFiles))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("record without activation: %d", resp.StatusCode)
	}
}

func TestAuditLogNamesJTINotToken(t *testing.T) {
	f := newFixture(t)
	f.install(t, route("sbxa", 1))
	tok := f.token(t, route("sbxa", 1), capability.PurposeFiles)
	f.get(t, "/files", tok)
	b, err := os.ReadFile(filepath.Join(f.dir, "audit.log"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"outcome":"allow"`) || !strings.Contains(string(b), `"jti":`) {
		t.Fatalf("audit log: %s", b)
	}
	if strings.Contains(string(b), tok[10:60]) {
		t.Fatal("audit log contains the token")
	}
}

// A request admitted just before its execution is replaced, retired or
// torn down on this worker (the change lands between admission and the
// lookup of the running activation) gets RefreshRoute, never 503
// "installed but not active", and never reaches the new execution.
func TestAdmittedThenReplacedIsRefreshRoute(t *testing.T) {
	cases := []struct {
		name   string
		change func(t *testing.T, f *fixture)
	}{
		{"replaced", func(t *testing.T, f *fixture) { f.install(t, route("sbxa", 2)) }},
		{"retired", func(t *testing.T, f *fixture) {
			if err := f.m.Retire(context.Background(), route("sbxa", 1)); err != nil {
				t.Error(err)
			}
		}},
		{"torn down", func(t *testing.T, f *fixture) {
			if err := f.m.Teardown(context.Background(), route("sbxa", 1)); err != nil {
				t.Error(err)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.install(t, route("sbxa", 1))
			var once sync.Once
			f.m.testHookAdmitted = func() { once.Do(func() { tc.change(t, f) }) }
			resp, body := f.get(t, "/files", f.token(t, route("sbxa", 1), capability.PurposeFiles))
			if resp.StatusCode != http.StatusMisdirectedRequest || resp.Header.Get(spacev1.HeaderRouteOutcome) != spacev1.OutcomeRefreshRoute {
				t.Fatalf("request admitted before the change: %d %q %s", resp.StatusCode, resp.Header.Get(spacev1.HeaderRouteOutcome), body)
			}
		})
	}
}
