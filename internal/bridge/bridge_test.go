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
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

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
	switch os.Getenv("BRIDGE_HELPER") {
	case "serve-fd3": // serve as the guest on an inherited listener
		l, err := net.FileListener(os.NewFile(3, "listener"))
		if err != nil {
			os.Exit(3)
		}
		fmt.Println("listening")
		http.Serve(l, fakeGuest(want, nil))
		os.Exit(0)
	case "fake-qemu": // a VMM's chardev: one client at a time, relayed to the port
		os.Exit(fakeQEMU(os.Getenv("QEMU_SOCK"), os.Getenv("PORT_SOCK")))
	case "listen-fd3": // call listen(2) on an inherited bound socket
		if err := unix.Listen(3, 16); err != nil {
			os.Exit(3)
		}
		fmt.Println("listening")
		select {}
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
	return startWith(t, id, extra, nil)
}

// startWith is start with the bridge's Config changed by mutate first.
func startWith(t *testing.T, id identity.Route, extra http.Handler, mutate func(*Config)) *env {
	t.Helper()
	dir := t.TempDir()
	sock, srv := startGuest(t, dir, id, extra)
	cfg := Config{GuestSocket: sock, GuestPID: os.Getpid(), Expected: want}
	if mutate != nil {
		mutate(&cfg)
	}
	b, err := New(cfg)
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

func checkOf(err error) string {
	var ve *VerifyError
	if errors.As(err, &ve) {
		return ve.Check
	}
	return ""
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
	if !errors.Is(err, ErrListener) || checkOf(err) != CheckListener {
		t.Fatalf("got %v", err)
	}
}

// helper starts the test binary in a helper role with extra files.
func helper(t *testing.T, role string, files ...*os.File) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "BRIDGE_HELPER="+role)
	cmd.ExtraFiles = files
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if l, _ := bufio.NewReader(out).ReadString('\n'); l != "listening\n" {
		t.Fatalf("helper %s: %q", role, l)
	}
	return cmd
}

// The agent holds and serves the listener, but another process called
// listen(2) on it: the listener's credentials (SO_PEERCRED/SO_PEERPIDFD)
// name that process, and the peer-process check refuses it although the
// path inode, the listener's fd and sock_diag all agree.
func TestRefusesListenerWhoseCredentialsAreAnotherProcess(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "guest.sock")
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: sock}); err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "guest")
	helper(t, "listen-fd3", f)
	l, err := net.FileListener(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: fakeGuest(want, nil)}
	go srv.Serve(l)
	defer srv.Close()
	_, err = New(Config{GuestSocket: sock, GuestPID: os.Getpid(), Expected: want})
	if !errors.Is(err, procid.ErrMismatch) || checkOf(err) != CheckPeerProcess {
		t.Fatalf("got %v", err)
	}
}

// After the bridge started, the agent hands its listener to another
// process and closes its own: the path inode and the listener's
// credentials are unchanged, but the listener is no longer among the
// agent's fds, and the next connection is refused.
func TestListenerHandedToAnotherProcessIsRefused(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "guest.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	srv := &http.Server{Handler: fakeGuest(want, nil)}
	go srv.Serve(l)
	defer srv.Close()
	b, err := New(Config{GuestSocket: sock, GuestPID: os.Getpid(), Expected: want})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	f, err := l.(*net.UnixListener).File()
	if err != nil {
		t.Fatal(err)
	}
	helper(t, "serve-fd3", f)
	f.Close()
	srv.Close() // the agent's own copy of the listener is gone
	_, err = b.dialGuest(context.Background())
	if !errors.Is(err, ErrListener) || checkOf(err) != CheckListener {
		t.Fatalf("got %v", err)
	}
}

// A connection that did not go through the recorded listener (as if the
// path had been swapped between the stat and the connect) fails the
// sock_diag peer-socket check.
func TestPeerSocketCheck(t *testing.T) {
	e := start(t, want, nil)
	b := e.bridge
	c, err := net.Dial("unix", e.guestSock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := b.verifyTransport(c); err != nil {
		t.Fatalf("genuine connection: %v", err)
	}
	// Another listener of the agent, at another path, recorded instead.
	other := filepath.Join(t.TempDir(), "other.sock")
	ol, err := net.Listen("unix", other)
	if err != nil {
		t.Fatal(err)
	}
	defer ol.Close()
	var st unix.Stat_t
	unix.Stat(other, &st)
	raw, _ := ol.(*net.UnixListener).SyscallConn()
	var lst unix.Stat_t
	raw.Control(func(fd uintptr) { unix.Fstat(int(fd), &lst) })
	dev, ino, lis := b.pathDev, b.pathIno, b.listener
	b.pathDev, b.pathIno, b.listener = uint64(st.Dev), st.Ino, uint32(lst.Ino)
	b.listenerFD.Store(-1)
	defer func() { b.pathDev, b.pathIno, b.listener = dev, ino, lis }()
	err = b.verifyTransport(c)
	if !errors.Is(err, ErrListener) || checkOf(err) != CheckPeerSocket {
		t.Fatalf("connection through another listener: %v", err)
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
	if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), CheckPathInode+" check failed") {
		t.Fatalf("status %d body %s", resp.StatusCode, body)
	}
	if !strings.Contains(resp.Header.Get("Connection"), "close") && resp.Close == false {
		t.Fatal("refused connection kept open")
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

// A guest that reports another identity on a later connection is refused
// on that connection, with a typed error, though every transport check passes.
func TestGuestReportingAnotherIdentityLaterIsRefused(t *testing.T) {
	var gen atomic.Uint64
	gen.Store(want.Generation)
	extra := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {})
	dir := t.TempDir()
	sock := filepath.Join(dir, "guest.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+IdentityPath, func(w http.ResponseWriter, r *http.Request) {
		id := want
		id.Generation = gen.Load()
		json.NewEncoder(w).Encode(id)
	})
	mux.Handle("/", extra)
	srv := &http.Server{Handler: mux}
	go srv.Serve(l)
	defer srv.Close()
	b, err := New(Config{GuestSocket: sock, GuestPID: os.Getpid(), Expected: want})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	gen.Store(want.Generation + 1)
	_, err = b.dialGuest(context.Background())
	if !errors.Is(err, ErrGuestIdentity) || checkOf(err) != CheckGuestIdentity {
		t.Fatalf("got %v", err)
	}
}

// After a guest connection dropped mid-operation, the next operation comes
// on a new manager connection and a new guest connection that passes every
// check again.
func TestNextConnectionAfterDropIsVerifiedAgain(t *testing.T) {
	drop := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/drop" {
			c, _, _ := w.(http.Hijacker).Hijack()
			c.Close()
		}
	})
	e := start(t, want, drop)
	do := func(path string) int {
		resp, err := e.client.Get("http://x" + path)
		if err != nil {
			return 0
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	if s := do("/echo"); s != 200 {
		t.Fatalf("warm-up %d", s)
	}
	before := e.bridge.verified.Load()
	if s := do("/drop"); s == 200 {
		t.Fatal("dropped operation reported success")
	}
	if got := e.bridge.verified.Load(); got != before {
		t.Fatalf("the bridge reconnected to the guest on its own (%d -> %d)", before, got)
	}
	if s := do("/echo"); s != 200 {
		t.Fatalf("next operation %d", s)
	}
	if got := e.bridge.verified.Load(); got != before+1 {
		t.Fatalf("next operation did not pass the checks on a new connection (%d -> %d)", before, got)
	}
}

// BenchmarkVerifyTransport measures the per-connection transport checks
// (listener fd, sock_diag, SO_PEERCRED/SO_PEERPIDFD, start time and
// executable), excluding the dial and the identity exchange.
func BenchmarkVerifyTransport(b *testing.B) {
	for _, sd := range []bool{true, false} {
		name := "with-sockdiag"
		if !sd {
			name = "without-sockdiag"
		}
		b.Run(name, func(b *testing.B) {
			dir := b.TempDir()
			sock := filepath.Join(dir, "guest.sock")
			l, err := net.Listen("unix", sock)
			if err != nil {
				b.Fatal(err)
			}
			srv := &http.Server{Handler: fakeGuest(want, nil)}
			go srv.Serve(l)
			defer srv.Close()
			br, err := New(Config{GuestSocket: sock, GuestPID: os.Getpid(), Expected: want, noSockDiag: !sd})
			if err != nil {
				b.Fatal(err)
			}
			defer br.Close()
			c, err := net.Dial("unix", sock)
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			b.ResetTimer()
			for b.Loop() {
				if err := br.verifyTransport(c); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkDialGuest measures a whole new guest connection: path inode,
// dial, transport checks and the identity exchange.
func BenchmarkDialGuest(b *testing.B) {
	for _, sd := range []bool{true, false} {
		name := "with-sockdiag"
		if !sd {
			name = "without-sockdiag"
		}
		b.Run(name, func(b *testing.B) {
			dir := b.TempDir()
			sock := filepath.Join(dir, "guest.sock")
			l, err := net.Listen("unix", sock)
			if err != nil {
				b.Fatal(err)
			}
			srv := &http.Server{Handler: fakeGuest(want, nil)}
			go srv.Serve(l)
			defer srv.Close()
			br, err := New(Config{GuestSocket: sock, GuestPID: os.Getpid(), Expected: want, noSockDiag: !sd})
			if err != nil {
				b.Fatal(err)
			}
			defer br.Close()
			b.ResetTimer()
			for b.Loop() {
				gc, err := br.dialGuest(context.Background())
				if err != nil {
					b.Fatal(err)
				}
				gc.conn.Close()
			}
		})
	}
}

// A bridge outlives the manager that launched it: another process is
// refused until the manager file names it (with its own start time, so a
// stale file naming a reused pid does not let anyone in).
func TestRestartedManagerTakesOverThroughTheManagerFile(t *testing.T) {
	other := exec.Command("sleep", "60")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { other.Process.Kill(); other.Wait() }()
	file := filepath.Join(t.TempDir(), "manager")
	e := startWith(t, want, nil, func(c *Config) { c.ManagerPID = other.Process.Pid; c.ManagerFile = file })
	get := func() error {
		e.tr.CloseIdleConnections()
		resp, err := e.client.Get("http://x/echo")
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	if err := get(); err == nil {
		t.Fatal("a connection from another process than the manager was served (no manager file)")
	}
	st, err := procid.StartTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, []byte(fmt.Sprintf("%d %d\n", os.Getpid(), st+1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := get(); err == nil {
		t.Fatal("served a peer the manager file names with another start time")
	}
	if err := os.WriteFile(file, []byte("garbage"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := get(); err == nil {
		t.Fatal("served a peer with a malformed manager file")
	}
	if err := WriteManagerFile(file); err != nil {
		t.Fatal(err)
	}
	if err := get(); err != nil {
		t.Fatalf("the manager the file names was refused: %v", err)
	}
	if err := get(); err != nil {
		t.Fatalf("the new manager's next connection was refused: %v", err)
	}
	// The manager is a pid and a start time, checked on every connection:
	// a process that got a dead manager's pid is not it.
	os.Remove(file)
	cur := e.bridge.manager.Load()
	e.bridge.manager.Store(&managerProc{pid: cur.pid, start: cur.start + 1})
	if err := get(); err == nil {
		t.Fatal("served a peer with the manager's pid but another start time")
	}
}
