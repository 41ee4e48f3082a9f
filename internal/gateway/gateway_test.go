package gateway

import (
	"bufio"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/testenv"
)

func testRoute() identity.Route {
	return identity.Route{SandboxID: "sbxa", Generation: 3, ExecutionID: "exec3", WorkerID: "w1", Substrate: "ns", ActivationID: "act1"}
}

type fixture struct {
	signer *capability.Signer
	ver    *capability.Verifier
	gw     *Gateway
	port   int // the "sandbox" port (a loopback listener)
	srv    *httptest.Server
}

func newFixture(t *testing.T, h http.Handler) *fixture {
	t.Helper()
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	s, err := capability.NewSigner("k1", priv)
	if err != nil {
		t.Fatal(err)
	}
	ver, err := capability.NewVerifier(capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: pub}}})
	if err != nil {
		t.Fatal(err)
	}
	if h == nil {
		h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get(spacev1.HeaderCapability) != "" {
				t.Errorf("capability leaked to the sandbox port")
			}
			io.WriteString(w, "hello from "+r.URL.Path)
		})
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	_, ps, _ := net.SplitHostPort(srv.Listener.Addr().String())
	port, _ := strconv.Atoi(ps)
	dial := func(ctx context.Context, p int) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
	}
	gw, err := New(Config{Route: testRoute(), Verifier: ver, Dial: dial})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(gw.Close)
	return &fixture{signer: s, ver: ver, gw: gw, port: port, srv: srv}
}

func (f *fixture) token(t *testing.T, r identity.Route, port int, proto string) string {
	t.Helper()
	tok, _, err := f.signer.Issue(capability.Claims{Route: r, Purpose: capability.PurposeServicePort, Port: port, Protocol: proto})
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func (f *fixture) request(t *testing.T, tok string, port int, hdr map[string]string) *http.Response {
	t.Helper()
	r := httptest.NewRequest(http.MethodGet, "/x", nil)
	r.Header.Set(HeaderSandboxPort, strconv.Itoa(port))
	if tok != "" {
		r.Header.Set(spacev1.HeaderCapability, tok)
	}
	for k, v := range hdr {
		r.Header.Set(k, v)
	}
	w := httptest.NewRecorder()
	f.gw.ServeHTTP(w, r)
	return w.Result()
}

func TestAdmissionRejections(t *testing.T) {
	f := newFixture(t, nil)
	rt := testRoute()
	other := rt
	other.SandboxID = "sbxb"
	olderGen := rt
	olderGen.Generation, olderGen.ExecutionID = 2, "exec2"
	otherAct := rt
	otherAct.ActivationID = "act0"

	// A token from a key the gateway's bundle does not hold.
	_, priv2, _ := ed25519.GenerateKey(rand.Reader)
	s2, _ := capability.NewSigner("k1", priv2) // same kid, other key: bad signature
	forged, _, _ := s2.Issue(capability.Claims{Route: rt, Purpose: capability.PurposeServicePort, Port: f.port, Protocol: "http"})
	s3, _ := capability.NewSigner("k9", priv2)
	unknownKid, _, _ := s3.Issue(capability.Claims{Route: rt, Purpose: capability.PurposeServicePort, Port: f.port, Protocol: "http"})
	wrongPurpose, _, _ := f.signer.Issue(capability.Claims{Route: rt, Purpose: capability.PurposeFiles})

	cases := []struct {
		name    string
		tok     string
		port    int
		hdr     map[string]string
		status  int
		outcome string
	}{
		{"allow", f.token(t, rt, f.port, "http"), f.port, nil, 200, ""},
		{"missing capability", "", f.port, nil, 403, spacev1.OutcomeDeny},
		{"wrong port", f.token(t, rt, f.port+1, "http"), f.port, nil, 403, spacev1.OutcomeDeny},
		{"wrong protocol ws for http", f.token(t, rt, f.port, "ws"), f.port, nil, 403, spacev1.OutcomeDeny},
		{"wrong protocol http for upgrade", f.token(t, rt, f.port, "http"), f.port, map[string]string{"Upgrade": "websocket", "Connection": "Upgrade"}, 403, spacev1.OutcomeDeny},
		{"wrong protocol tcp for ws", f.token(t, rt, f.port, "tcp"), f.port, map[string]string{"Upgrade": "websocket", "Connection": "Upgrade"}, 403, spacev1.OutcomeDeny},
		{"wrong purpose", wrongPurpose, f.port, nil, 403, spacev1.OutcomeDeny},
		{"bad signature", forged, f.port, nil, 403, spacev1.OutcomeDeny},
		{"unknown key", unknownKid, f.port, nil, 403, spacev1.OutcomeDeny},
		{"malformed", "v4.public.garbage", f.port, nil, 403, spacev1.OutcomeDeny},
		{"other sandbox", f.token(t, other, f.port, "http"), f.port, nil, 403, spacev1.OutcomeDeny},
		{"other generation", f.token(t, olderGen, f.port, "http"), f.port, nil, 421, spacev1.OutcomeRefreshRoute},
		{"other activation", f.token(t, otherAct, f.port, "http"), f.port, nil, 421, spacev1.OutcomeRefreshRoute},
		{"envd port", f.token(t, rt, EnvdPort, "http"), EnvdPort, nil, 400, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			res := f.request(t, c.tok, c.port, c.hdr)
			body, _ := io.ReadAll(res.Body)
			if res.StatusCode != c.status || res.Header.Get(spacev1.HeaderRouteOutcome) != c.outcome {
				t.Fatalf("status %d outcome %q, want %d %q (%s)", res.StatusCode, res.Header.Get(spacev1.HeaderRouteOutcome), c.status, c.outcome, body)
			}
			if c.status == 200 && string(body) != "hello from /x" {
				t.Fatalf("body %q", body)
			}
		})
	}
	// Expired (beyond the skew) is a Deny too.
	f.ver.SetClock(func() time.Time { return time.Now().Add(capability.Lifetime + capability.Skew + time.Minute) })
	res := f.request(t, f.token(t, rt, f.port, "http"), f.port, nil)
	if res.StatusCode != 403 {
		t.Fatalf("expired capability: status %d", res.StatusCode)
	}
}

// The gateway compares with its trusted state only: request headers that
// name another sandbox or route change nothing.
func TestIdentityFromTrustedStateOnly(t *testing.T) {
	f := newFixture(t, nil)
	rt := testRoute()
	other := rt
	other.SandboxID = "sbxb"
	res := f.request(t, f.token(t, other, f.port, "http"), f.port, map[string]string{"E2b-Sandbox-Id": "sbxb"})
	if res.StatusCode != 403 {
		t.Fatalf("other sandbox with matching header: %d", res.StatusCode)
	}
	if err := f.gw.SetActivation(other); err == nil {
		t.Fatal("SetActivation accepted a route of another sandbox")
	}
}

// wsEcho is a minimal upgrade server: it answers 101 and echoes bytes.
func wsEcho(t *testing.T) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") == "" {
			io.WriteString(w, "plain")
			return
		}
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		defer c.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + r.Header.Get("Upgrade") + "\r\n\r\n")
		brw.Flush()
		io.Copy(c, brw)
	})
}

// openUpgrade opens an upgraded stream through a real HTTP server in front
// of the gateway and returns the raw connection after the 101.
func openUpgrade(t *testing.T, base, tok string, port int, up string) (net.Conn, *bufio.Reader, int) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "GET /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: %s\r\n%s: %d\r\n%s: %s\r\n\r\n",
		up, HeaderSandboxPort, port, spacev1.HeaderCapability, tok)
	br := bufio.NewReader(c)
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.StatusCode != http.StatusSwitchingProtocols {
		c.Close()
		return nil, nil, res.StatusCode
	}
	return c, br, res.StatusCode
}

func echoOnce(c net.Conn, br *bufio.Reader, msg string) (string, error) {
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, msg+"\n"); err != nil {
		return "", err
	}
	return br.ReadString('\n')
}

func TestStreamsAcrossActivationAndEpoch(t *testing.T) {
	for _, proto := range []string{"ws", "tcp"} {
		t.Run(proto, func(t *testing.T) {
			f := newFixture(t, wsEcho(t))
			front := httptest.NewServer(f.gw)
			defer front.Close()
			up := "websocket"
			if proto == "tcp" {
				// Raw TCP: the sandbox port is a plain echo listener.
				up = "tcp"
				ln, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				defer ln.Close()
				go func() {
					for {
						c, err := ln.Accept()
						if err != nil {
							return
						}
						go func() { defer c.Close(); io.Copy(c, c) }()
					}
				}()
				f.port = ln.Addr().(*net.TCPAddr).Port
			}
			rt := testRoute()
			c, br, st := openUpgrade(t, front.URL, f.token(t, rt, f.port, proto), f.port, up)
			if st != 101 {
				t.Fatalf("open: %d", st)
			}
			defer c.Close()
			if got, err := echoOnce(c, br, "one"); err != nil || got != "one\n" {
				t.Fatalf("echo: %q %v", got, err)
			}
			// Activation-attempt-only change: the stream stays, new opens
			// need the new activation.
			next := rt
			next.ActivationID = "act2"
			if err := f.gw.SetActivation(next); err != nil {
				t.Fatal(err)
			}
			if got, err := echoOnce(c, br, "two"); err != nil || got != "two\n" {
				t.Fatalf("echo after activation change: %q %v", got, err)
			}
			if _, _, st := openUpgrade(t, front.URL, f.token(t, rt, f.port, proto), f.port, up); st != 421 {
				t.Fatalf("open with the old activation: %d, want 421", st)
			}
			c2, br2, st := openUpgrade(t, front.URL, f.token(t, next, f.port, proto), f.port, up)
			if st != 101 {
				t.Fatalf("open with the new activation: %d", st)
			}
			defer c2.Close()
			if got, err := echoOnce(c2, br2, "three"); err != nil || got != "three\n" {
				t.Fatalf("echo on new stream: %q %v", got, err)
			}
			// A new execution ends every stream.
			newExec := next
			newExec.Generation, newExec.ExecutionID = 4, "exec4"
			if err := f.gw.SetActivation(newExec); !errors.Is(err, ErrEpochChanged) {
				t.Fatalf("epoch change: %v", err)
			}
			for _, cc := range []struct {
				c  net.Conn
				br *bufio.Reader
			}{{c, br}, {c2, br2}} {
				cc.c.SetDeadline(time.Now().Add(5 * time.Second))
				io.WriteString(cc.c, "four\n")
				if got, err := cc.br.ReadString('\n'); err == nil {
					t.Fatalf("stream survived a new execution: %q", got)
				}
			}
			if _, _, st := openUpgrade(t, front.URL, f.token(t, newExec, f.port, proto), f.port, up); st != 421 {
				t.Fatalf("open after retirement: %d, want 421", st)
			}
		})
	}
}

func TestControlChannel(t *testing.T) {
	f := newFixture(t, nil)
	next := testRoute()
	next.ActivationID = "act2"
	msgs := []struct{ in, want string }{
		{`{"op":"activation","route":{"sandbox":"sbxa","generation":3,"execution":"exec3","worker":"w1","substrate":"ns","activation":"act2"}}`, "ok\n"},
		{`{"op":"activation","route":{"sandbox":"other","generation":3,"execution":"exec3","worker":"w1","substrate":"ns","activation":"act2"}}`, "error: "},
		{`{"op":"activation"}`, "error: "},
		{`not json`, "error: "},
		{`{"op":"reboot"}`, "error: "},
		{`{"op":"retire"}`, "ok retired\n"},
	}
	for _, m := range msgs {
		if got := handleControl(f.gw, []byte(m.in)); !strings.HasPrefix(got, m.want) {
			t.Fatalf("%s: %q, want prefix %q", m.in, got, m.want)
		}
	}
	if r, retired := f.gw.Route(); r != next || !retired {
		t.Fatalf("route %v retired %v", r, retired)
	}
}

// TestNetnsDialer enters a real network namespace: a listener exists only
// inside it, and the host's listener on the same port is not reachable.
func TestNetnsDialer(t *testing.T) {
	testenv.RequireRoot(t, "network namespaces")
	// A helper process in a new netns (unshare -n) running a tiny server.
	if _, err := exec.LookPath("python3"); err != nil {
		testenv.Skipf(t, "python3 not available")
	}
	// Host listener on some port: must NOT be what the gateway reaches.
	hostLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hostLn.Close()
	_, ps, _ := net.SplitHostPort(hostLn.Addr().String())
	port, _ := strconv.Atoi(ps)
	go func() {
		for {
			c, err := hostLn.Accept()
			if err != nil {
				return
			}
			io.WriteString(c, "host\n")
			c.Close()
		}
	}()
	script := fmt.Sprintf(`
import socket, subprocess
subprocess.run(["ip","link","set","lo","up"])
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1",%d)); s.listen(8); print("ready", flush=True)
while True:
    c,_=s.accept(); c.sendall(b"sandbox\n"); c.close()
`, port)
	cmd := exec.Command("unshare", "-n", "python3", "-c", script)
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		testenv.Skipf(t, "unshare: %v", err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	if l, err := bufio.NewReader(out).ReadString('\n'); err != nil || l != "ready\n" {
		t.Fatalf("helper: %q %v", l, err)
	}
	pid := cmd.Process.Pid
	var host unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &host); err != nil {
		t.Fatal(err)
	}
	_, ino, start, err := NetnsIdentity(pid)
	if err != nil {
		t.Fatal(err)
	}
	// Recorded identity must match.
	if _, err := OpenNetns(pid, ino+1, start); !errors.Is(err, ErrNetnsMismatch) {
		t.Fatalf("wrong inode: %v", err)
	}
	if _, err := OpenNetns(pid, ino, start+1); !errors.Is(err, ErrNetnsMismatch) {
		t.Fatalf("wrong start time (reused pid): %v", err)
	}
	fdsBefore := openFDs(t)
	d, err := OpenNetns(pid, ino, start)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	dialSandbox := func() {
		t.Helper()
		c, err := d.DialPort(context.Background(), port)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(c)
		c.Close()
		if string(b) != "sandbox\n" {
			t.Fatalf("reached %q, want the sandbox's listener", b)
		}
	}
	// More dials than the pool holds: the refilled sockets are made in
	// the sandbox's namespace too.
	for i := 0; i < 3*netnsPoolSize; i++ {
		dialSandbox()
	}
	// A socket the factory cannot make is an error for the dial that
	// takes it, not a wait (RLIMIT_NOFILE down to what is open now).
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	low := lim
	low.Cur = uint64(openFDs(t))
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	var sawEMFILE bool
	// Dups of pooled sockets may also hit the limit first (refused too):
	// enough dials that the pool runs dry and the factory must make one.
	for i := 0; i < 4*netnsPoolSize+4 && !sawEMFILE; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		c, err := d.DialPort(ctx, port)
		cancel()
		switch {
		case err == nil:
			c.Close() // a pooled socket made before the limit
		case errors.Is(err, unix.EMFILE):
			sawEMFILE = true
		case errors.Is(err, context.DeadlineExceeded):
			unix.Setrlimit(unix.RLIMIT_NOFILE, &lim)
			t.Fatal("dial waited for a socket the factory could not make")
		default:
			// The dup of a pooled socket hit the limit: also refused.
		}
	}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if !sawEMFILE {
		t.Fatal("socket creation failure never reported")
	}
	dialSandbox() // the factory makes sockets again
	// A closed port inside the namespace is refused (no fallback to host).
	if _, err := d.DialPort(context.Background(), port+1); !errors.Is(err, unix.ECONNREFUSED) {
		t.Fatalf("closed port: %v", err)
	}
	// Goroutines other than the socket factory never run in the
	// sandbox's namespace.
	if ino == host.Ino {
		t.Fatal("helper did not get its own network namespace")
	}
	for i := 0; i < 20; i++ {
		ch := make(chan uint64)
		go func() {
			var self unix.Stat_t
			unix.Stat("/proc/thread-self/ns/net", &self)
			ch <- self.Ino
		}()
		if got := <-ch; got != host.Ino {
			t.Fatalf("a goroutine ran in namespace %d, host is %d", got, host.Ino)
		}
	}
	// Close releases the namespace and every socket made ahead; a dial
	// after it is refused.
	d.Close()
	if n := openFDs(t); n != fdsBefore {
		t.Fatalf("%d descriptors open after Close, %d before OpenNetns", n, fdsBefore)
	}
	if _, err := d.DialPort(context.Background(), port); err == nil {
		t.Fatal("dial after Close succeeded")
	}
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents) - 1 // the directory being read
}
