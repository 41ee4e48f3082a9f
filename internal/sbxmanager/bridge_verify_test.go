package sbxmanager

import (
	"bufio"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/substrate"
)

// newFixtureMetrics is newFixture with the manager's metrics registered.
func newFixtureMetrics(t *testing.T) (*fixture, *prometheus.Registry) {
	t.Helper()
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	signer, _ := capability.NewSigner("k1", priv)
	ver, _ := capability.NewVerifier(capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: pub}}})
	dir := t.TempDir()
	reg := prometheus.NewRegistry()
	m, err := New(Config{WorkerID: "w1", StateDir: dir, SpacedHostPath: spacedHost, AgentPath: "/nonexistent", Registerer: reg},
		Deps{Substrates: []substrate.Substrate{&fakeSubstrate{}}, WriteError: writeTestError, Verifier: ver})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m)
	t.Cleanup(func() { srv.Close(); m.Close() })
	return &fixture{m: m, signer: signer, srv: srv, dir: dir}, reg
}

func bridgeRejects(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "space_node_bridge_verification_failures_total" {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatal("no bridge verification metric")
	return 0
}

// killBridge kills the sandbox's spaced-host and waits until it is reaped.
func killBridge(t *testing.T, f *fixture, sbx string) *activation {
	t.Helper()
	f.m.mu.RLock()
	a := f.m.active[sbx]
	f.m.mu.RUnlock()
	if a == nil {
		t.Fatal("no activation")
	}
	syscall.Kill(a.hostProc.PID, syscall.SIGKILL)
	select {
	case <-a.hostDone:
	case <-time.After(5 * time.Second):
		t.Fatal("spaced-host not reaped")
	}
	return a
}

// A spaced-host killed and replaced by another one on the same socket path
// (same binary, same arguments, a perfectly working bridge to the right
// guest) is refused: it is not the process sbx-manager launched. The
// operation fails with a JSON error and the metric counts it.
// Subtests: k = killed and replaced, t = socket path taken over (short
// names: the sockets live under t.TempDir and Unix paths are short).
func TestBridgeRestartedBehindManagersBackIsRejected(t *testing.T) {
	t.Run("k", func(t *testing.T) { testBridgeReplaced(t, true) })
	// The recorded bridge still runs, but its socket path was unlinked and
	// bound by another spaced-host: SO_PEERCRED/SO_PEERPIDFD name another
	// process.
	t.Run("t", func(t *testing.T) { testBridgeReplaced(t, false) })
}

func testBridgeReplaced(t *testing.T, kill bool) {
	f, reg := newFixtureMetrics(t)
	r := route("sbxa", 1)
	f.install(t, r)
	tok := f.token(t, r, capability.PurposeFiles)
	if resp, body := f.get(t, "/files", tok); resp.StatusCode != 200 {
		t.Fatalf("before: %d %s", resp.StatusCode, body)
	}
	f.m.mu.RLock()
	a := f.m.active["sbxa"]
	f.m.mu.RUnlock()
	if kill {
		killBridge(t, f, "sbxa")
	} else {
		a.tr.CloseIdleConnections() // only new connections matter here
	}
	want, _ := json.Marshal(r)
	cmd := exec.Command(spacedHost, "--guest-socket", a.inst.GuestSocket(), "--guest-pid", strconv.Itoa(a.inst.InitPID()),
		"--listen", a.hostSock, "--expected", string(want), "--manager-pid", strconv.Itoa(os.Getpid()))
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	if l, _ := bufio.NewReader(out).ReadString('\n'); l != "spaced-host ready\n" {
		t.Fatalf("impostor bridge: %q", l)
	}
	before := bridgeRejects(t, reg)
	for i := range 2 { // the next operations too: nothing is cached or reconnected
		resp, body := f.get(t, "/files", tok)
		var e spacev1.Error
		if resp.StatusCode != http.StatusServiceUnavailable || json.Unmarshal([]byte(body), &e) != nil || e.Message == "" {
			t.Fatalf("operation %d through a replaced bridge: %d %s", i, resp.StatusCode, body)
		}
	}
	if got := bridgeRejects(t, reg); got < before+2 {
		t.Fatalf("bridge verification failures %v -> %v", before, got)
	}
}

// Killing the bridge in the middle of an operation (an open stream) fails
// that operation; the next one fails too (nothing restarts or reconnects
// to anything behind the manager's back).
func TestBridgeKilledMidOperationFailsIt(t *testing.T) {
	f := newFixture(t)
	r := route("sbxa", 1)
	f.install(t, r)
	req, _ := http.NewRequest("POST", f.srv.URL+"/process.Process/Start", nil)
	req.Header.Set(spacev1.HeaderCapability, f.token(t, r, capability.PurposeProcess))
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("stream open: %v", err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if l, _ := br.ReadString('\n'); l != "started\n" {
		t.Fatalf("stream: %q", l)
	}
	ended := make(chan error, 1)
	go func() { _, err := io.ReadAll(br); ended <- err }()
	killBridge(t, f, "sbxa")
	select {
	case err := <-ended:
		if err == nil {
			t.Fatal("stream through a killed bridge ended cleanly")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("stream survived its bridge")
	}
	if resp, body := f.get(t, "/files", f.token(t, r, capability.PurposeFiles)); resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("after the bridge died: %d %s", resp.StatusCode, body)
	}
}

// dropSecond serves HTTP/1.1 on l; on the second request of a connection it
// reads the request and closes the connection without answering (a bridge
// connection dropped mid-operation).
func dropSecond(t *testing.T, l net.Listener, requests *atomic.Int32) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			br := bufio.NewReader(c)
			for n := 0; ; n++ {
				req, err := http.ReadRequest(br)
				if err != nil {
					return
				}
				io.Copy(io.Discard, req.Body)
				requests.Add(1)
				if n == 1 {
					return
				}
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			}
		}()
	}
}

// A bridge connection that drops mid-operation fails the operation: the
// transport does not silently re-send it on a new connection (plain
// net/http would, for a GET). The next operation gets a new connection,
// verified again.
func TestDroppedBridgeConnectionIsNotRetried(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "host.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var requests atomic.Int32
	go dropSecond(t, l, &requests)
	var verified atomic.Int32
	tr, rt := newBridgeTransport(sock, func(net.Conn) error { verified.Add(1); return nil })
	defer tr.CloseIdleConnections()
	get := func(rt http.RoundTripper) error {
		req, _ := http.NewRequest("GET", "http://spaced-host/files", nil)
		resp, err := rt.RoundTrip(req)
		if err != nil {
			return err
		}
		io.Copy(io.Discard, resp.Body)
		return resp.Body.Close()
	}
	if err := get(rt); err != nil || verified.Load() != 1 {
		t.Fatalf("first: %v, %d verified", err, verified.Load())
	}
	err = get(rt)
	if !errors.Is(err, ErrBridgeConnLost) {
		t.Fatalf("dropped operation: %v", err)
	}
	if n := requests.Load(); n != 2 {
		t.Fatalf("bridge saw %d requests, want 2 (the dropped one exactly once)", n)
	}
	if err := get(rt); err != nil {
		t.Fatalf("next operation: %v", err)
	}
	if v := verified.Load(); v < 2 {
		t.Fatalf("next connection not verified again: %d", v)
	}

	// Control: the plain transport re-sends the dropped GET on its own.
	tr2, _ := newBridgeTransport(sock, func(net.Conn) error { return nil })
	defer tr2.CloseIdleConnections()
	before := requests.Load()
	if err := get(tr2); err != nil {
		t.Fatal(err)
	}
	if err := get(tr2); err != nil {
		t.Fatalf("control: net/http did not retry (%v); the test above proves nothing", err)
	}
	if n := requests.Load() - before; n != 3 {
		t.Fatalf("control: %d requests", n)
	}
}
