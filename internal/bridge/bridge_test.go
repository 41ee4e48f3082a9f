package bridge

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/procid"
)

var want = identity.Route{SandboxID: "sbx1", Generation: 3, ExecutionID: "e3", WorkerID: "w1", Substrate: "ns", ActivationID: "a1"}

// TestMain doubles as an impostor guest: with BRIDGE_IMPOSTOR=path the test
// binary binds a guest-like server at path that reports the expected
// identity, as a process that took over the socket path would.
func TestMain(m *testing.M) {
	if p := os.Getenv("BRIDGE_IMPOSTOR"); p != "" {
		os.Remove(p)
		l, err := net.Listen("unix", p)
		if err != nil {
			os.Exit(3)
		}
		fmt.Println("listening")
		http.Serve(l, fakeGuest(want, nil))
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

func fakeGuest(id identity.Route, extra http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+IdentityPath, func(w http.ResponseWriter, r *http.Request) {
		json.NewEncoder(w).Encode(id)
	})
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.Header.Get(spacev1.HeaderCapability) != "" {
			w.WriteHeader(http.StatusTeapot) // capability must never reach the guest
			return
		}
		w.Write(b)
	})
	mux.HandleFunc("/stream", func(w http.ResponseWriter, r *http.Request) {
		fl := w.(http.Flusher)
		for i := range 3 {
			fmt.Fprintf(w, "tick %d\n", i)
			fl.Flush()
			time.Sleep(20 * time.Millisecond)
		}
	})
	if extra != nil {
		mux.Handle("/", extra)
	}
	return mux
}

type env struct {
	guestSock string
	guestSrv  *http.Server
	bridge    *Bridge
	client    *http.Client
	tr        *http.Transport
	done      chan error
}

func startGuest(t *testing.T, dir string, id identity.Route, extra http.Handler) (string, *http.Server) {
	t.Helper()
	sock := filepath.Join(dir, "guest.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: fakeGuest(id, extra)}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return sock, srv
}

func start(t *testing.T, id identity.Route, extra http.Handler) *env {
	t.Helper()
	dir := t.TempDir()
	sock, srv := startGuest(t, dir, id, extra)
	b, err := New(Config{GuestSocket: sock, GuestPID: os.Getpid(), Expected: want})
	if err != nil {
		t.Fatal(err)
	}
	hs := filepath.Join(dir, "host.sock")
	l, err := net.Listen("unix", hs)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{guestSock: sock, guestSrv: srv, bridge: b, done: make(chan error, 1)}
	go func() { e.done <- b.Serve(l) }()
	e.tr = &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", hs)
	}}
	e.client = &http.Client{Transport: e.tr}
	t.Cleanup(func() {
		e.tr.CloseIdleConnections()
		b.Close()
		<-e.done
	})
	return e
}

func TestForwardAddsExecutionHeaderAndStripsCapability(t *testing.T) {
	e := start(t, want, nil)
	req, _ := http.NewRequest("POST", "http://x/echo", strings.NewReader("ping"))
	req.Header.Set(spacev1.HeaderCapability, "secret-token")
	resp, err := e.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "ping" {
		t.Fatalf("status %d body %q", resp.StatusCode, body)
	}
	if got := resp.Header.Get(spacev1.HeaderExecution); got != "sbx1/3/e3" {
		t.Fatalf("Space-Execution = %q", got)
	}
}

func TestStreamingIsNotBuffered(t *testing.T) {
	e := start(t, want, nil)
	resp, err := e.client.Get("http://x/stream")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil || line != "tick 0\n" {
		t.Fatalf("first line %q %v", line, err)
	}
	rest, _ := io.ReadAll(br)
	if string(rest) != "tick 1\ntick 2\n" {
		t.Fatalf("rest %q", rest)
	}
}

func TestRefusesGuestReportingAnotherIdentity(t *testing.T) {
	other := want
	other.Generation = 2
	sock, _ := startGuest(t, t.TempDir(), other, nil)
	_, err := New(Config{GuestSocket: sock, GuestPID: os.Getpid(), Expected: want})
	if !errors.Is(err, ErrGuestIdentity) {
		t.Fatalf("got %v", err)
	}
}

func TestRefusesListenerOfAnotherProcess(t *testing.T) {
	sock, _ := startGuest(t, t.TempDir(), want, nil)
	// The recorded guest is a different live process than the listener.
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	_, err := New(Config{GuestSocket: sock, GuestPID: cmd.Process.Pid, Expected: want})
	if !errors.Is(err, procid.ErrMismatch) {
		t.Fatalf("got %v", err)
	}
}

func TestSocketReboundByAnotherProcessIsRefused(t *testing.T) {
	e := start(t, want, nil)
	// The socket path is unlinked and re-bound by an impostor process that
	// even reports the right identity.
	os.Remove(e.guestSock)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "BRIDGE_IMPOSTOR="+e.guestSock)
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	if l, _ := bufio.NewReader(out).ReadString('\n'); l != "listening\n" {
		t.Fatalf("impostor: %q", l)
	}
	resp, err := e.client.Get("http://x/echo")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), "mismatch") {
		t.Fatalf("status %d body %s", resp.StatusCode, body)
	}
}

func TestDroppedGuestConnectionFailsAndDoesNotReconnect(t *testing.T) {
	drop := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/drop" {
			c, _, _ := w.(http.Hijacker).Hijack()
			c.Close()
		}
	})
	e := start(t, want, drop)
	// One manager connection: first a good request, then one whose guest
	// connection drops mid-operation, then another on the same connection.
	e.tr.MaxConnsPerHost = 1
	get := func(path string) (int, error) {
		resp, err := e.client.Get("http://x" + path)
		if err != nil {
			return 0, err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	if s, err := get("/echo"); err != nil || s != 200 {
		t.Fatalf("warm-up %d %v", s, err)
	}
	if s, err := get("/drop"); err == nil && s == 200 {
		t.Fatal("dropped guest connection reported success")
	}
}

func TestConfigValidate(t *testing.T) {
	if _, err := New(Config{}); err == nil {
		t.Fatal("empty config accepted")
	}
	bad := want
	bad.ExecutionID = ""
	if _, err := New(Config{GuestSocket: "/x", GuestPID: 1, Expected: bad}); err == nil {
		t.Fatal("invalid identity accepted")
	}
}
