package controlplane

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/snapshot"
	"github.com/spacesbx/space/internal/store"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const edgeKey = "edge-service-key-0123456789"

type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time          { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) Advance(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// fakeNode is a node-api that verifies control capabilities against the
// published bundle and records what it was asked.
type fakeNode struct {
	networks []spacev1.NetworkRequest
	t        *testing.T
	id       string
	st       *store.Store
	srv      *httptest.Server
	mu       sync.Mutex
	installs []spacev1.InstallRequest
	teardown []spacev1.TeardownRequest
	failWith int // status to answer installs with (0: succeed)
	tokenErr error
	// life, when set, serves the lifecycle paths and logs every call in
	// order (lifecycle_test.go).
	life *lifeNode
	// samples answer NodePathMetricsRange (metricsrange_test.go; nil:
	// one sample taken now).
	samples []spacev1.MetricsResponse
}

func newFakeNode(t *testing.T, id string, st *store.Store) *fakeNode {
	n := &fakeNode{t: t, id: id, st: st}
	n.srv = httptest.NewServer(http.HandlerFunc(n.serve))
	t.Cleanup(n.srv.Close)
	return n
}

func (n *fakeNode) verify(r *http.Request, route func() spacev1.TeardownRequest) error {
	b, err := n.st.GetBundle(r.Context())
	if err != nil {
		return err
	}
	v, err := capability.NewVerifier(b)
	if err != nil {
		return err
	}
	c, err := v.Verify(r.Header.Get(spacev1.HeaderCapability), capability.PurposeControl)
	if err != nil {
		return err
	}
	if c.WorkerID != n.id {
		return io.ErrUnexpectedEOF
	}
	if c.Route != route().Route {
		return io.ErrShortBuffer
	}
	return nil
}

func (n *fakeNode) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	if n.life != nil && n.life.serve(n, w, r, body) {
		return
	}
	switch r.URL.Path {
	case spacev1.NodePathInstall:
		var req spacev1.InstallRequest
		_ = json.Unmarshal(body, &req)
		if err := n.verify(r, func() spacev1.TeardownRequest { return spacev1.TeardownRequest{Route: req.Route} }); err != nil {
			n.mu.Lock()
			n.tokenErr = err
			n.mu.Unlock()
			w.WriteHeader(http.StatusForbidden)
			return
		}
		n.mu.Lock()
		n.installs = append(n.installs, req)
		fail := n.failWith
		n.mu.Unlock()
		if fail != 0 {
			w.WriteHeader(fail)
			_ = json.NewEncoder(w).Encode(spacev1.Error{Code: fail, Message: "boom"})
			return
		}
		_ = json.NewEncoder(w).Encode(spacev1.InstallResponse{Route: req.Route, EnvdVersion: "0.2.1"})
	case spacev1.NodePathTeardown:
		var req spacev1.TeardownRequest
		_ = json.Unmarshal(body, &req)
		if err := n.verify(r, func() spacev1.TeardownRequest { return req }); err != nil {
			n.mu.Lock()
			n.tokenErr = err
			n.mu.Unlock()
			w.WriteHeader(http.StatusForbidden)
			return
		}
		n.mu.Lock()
		n.teardown = append(n.teardown, req)
		n.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	case spacev1.NodePathNetwork:
		var req spacev1.NetworkRequest
		_ = json.Unmarshal(body, &req)
		if err := n.verify(r, func() spacev1.TeardownRequest { return spacev1.TeardownRequest{Route: req.Route} }); err != nil {
			n.mu.Lock()
			n.tokenErr = err
			n.mu.Unlock()
			w.WriteHeader(http.StatusForbidden)
			return
		}
		n.mu.Lock()
		n.networks = append(n.networks, req)
		n.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	case spacev1.NodePathMetrics:
		var req spacev1.LifecycleRequest
		_ = json.Unmarshal(body, &req)
		if err := n.verify(r, func() spacev1.TeardownRequest { return spacev1.TeardownRequest(req) }); err != nil {
			n.mu.Lock()
			n.tokenErr = err
			n.mu.Unlock()
			w.WriteHeader(http.StatusForbidden)
			return
		}
		_ = json.NewEncoder(w).Encode(spacev1.MetricsResponse{Timestamp: time.Now(), CPUCount: 2, CPUUsedPct: 7.5,
			MemUsed: 10 << 20, MemTotal: 512 << 20, DiskUsed: 2 << 20})
	case spacev1.NodePathMetricsRange:
		n.serveMetricsRange(w, r, body)
	default:
		w.WriteHeader(http.StatusNotFound)
	}
}

func (n *fakeNode) counts() (int, int, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.installs), len(n.teardown), n.tokenErr
}

func (n *fakeNode) setFail(code int) { n.mu.Lock(); n.failWith = code; n.mu.Unlock() }

type env struct {
	t     *testing.T
	st    *store.Store
	dir   string
	srv   *Server
	clock *fakeClock
	key   string
	snaps *snapshot.Local
}

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

func newEnv(t *testing.T, st *store.Store, mut func(*Config)) *env {
	t.Helper()
	e := &env{t: t, st: st, dir: t.TempDir(), clock: &fakeClock{t: time.Now()}}
	e.start(mut)
	return e
}

func (e *env) start(mut func(*Config)) {
	cfg := Config{DataDir: e.dir, EdgeKey: edgeKey, ReapInterval: 20 * time.Millisecond, InstallTimeout: 5 * time.Second}
	if mut != nil {
		mut(&cfg)
	}
	if e.snaps == nil {
		snaps, err := snapshot.NewLocal(filepath.Join(e.dir, "snapshots"))
		if err != nil {
			e.t.Fatal(err)
		}
		e.snaps = snaps
	}
	srv, err := New(cfg, Deps{Store: e.st, Logger: quiet(), Clock: e.clock.Now, Snapshots: e.snaps})
	if err != nil {
		e.t.Fatal(err)
	}
	e.srv = srv
	e.key, _ = srv.BootstrapAPIKey()
	e.t.Cleanup(func() { srv.Close() })
}

func (e *env) register(n *fakeNode, capacity int) *store.Registration {
	reg, err := e.st.RegisterWorker(context.Background(), spacev1.Worker{
		ID: n.id, NodeURL: n.srv.URL, State: "ready", Capacity: capacity}, 5*time.Second)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { reg.Close() })
	return reg
}

type resp struct {
	Code   int
	Header http.Header
	Body   []byte
}

func (r resp) decode(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal(r.Body, v); err != nil {
		t.Fatalf("decode %s: %v", r.Body, err)
	}
}

func (e *env) do(method, path string, headers map[string]string, body any) resp {
	e.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = bytes.NewBufferString(b)
	case []byte:
		rd = bytes.NewReader(b)
	default:
		data, _ := json.Marshal(b)
		rd = bytes.NewReader(data)
	}
	req := httptest.NewRequest(method, path, rd)
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	rec := httptest.NewRecorder()
	e.srv.Handler().ServeHTTP(rec, req)
	return resp{Code: rec.Code, Header: rec.Header(), Body: rec.Body.Bytes()}
}

func (e *env) api(method, path string, body any) resp {
	return e.do(method, path, map[string]string{"X-API-Key": e.key}, body)
}

// expectError checks an error response's status and JSON shape.
func expectError(t *testing.T, r resp, code int) {
	t.Helper()
	if r.Code != code {
		t.Fatalf("status %d, want %d: %s", r.Code, code, r.Body)
	}
	var e struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if err := json.Unmarshal(r.Body, &e); err != nil || e.Code != code || e.Message == "" {
		t.Fatalf("error body %q not {code,message} with code %d", r.Body, code)
	}
}
