package up

// Service ports through the full path: client -> space-edge -> node-api ->
// sbx-manager (first check) -> netgtw (second check, one per activation) ->
// 127.0.0.1:<port> inside the sandbox's network namespace.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
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
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/gateway"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/sdk"
)

var netgtwOnce sync.Once

// ensureNetgtw builds netgtw next to spaced-host when the platform's bin
// dir lacks it (TestMain builds only spaced-host and spaced-guest unless
// SPACE_BIN_DIR is set). sbx-manager looks it up at each activation.
func ensureNetgtw(t *testing.T) {
	t.Helper()
	var err error
	netgtwOnce.Do(func() {
		p := filepath.Join(plat.cfg.BinDir, "netgtw")
		if _, serr := os.Stat(p); serr == nil {
			return
		}
		out, berr := exec.Command("go", "build", "-o", p, "github.com/spacesbx/space/cmd/netgtw").CombinedOutput()
		if berr != nil {
			err = fmt.Errorf("build netgtw: %v\n%s", berr, out)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
}

func spCtx(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// spEchoServer serves raw TCP echo on 8001 and an upgrade-then-echo server
// (WebSocket handshake pass-through) on 8002.
const spEchoServer = `
import socket, threading
def echo(c):
    try:
        while True:
            b = c.recv(65536)
            if not b: break
            c.sendall(b)
    finally:
        c.close()
def ws(c):
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = c.recv(4096)
        if not d:
            c.close(); return
        buf += d
    head, rest = buf.split(b"\r\n\r\n", 1)
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
    if rest: c.sendall(rest)
    echo(c)
def serve(port, h):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c, _ = s.accept(); threading.Thread(target=h, args=(c,), daemon=True).start()
threading.Thread(target=serve, args=(8001, echo), daemon=True).start()
serve(8002, ws)
`

// spStartServers starts python3 -m http.server 8000 and the echo servers
// in the background inside sbx and waits until 8000 answers inside.
func spStartServers(t *testing.T, sbx *sdk.Sandbox) {
	t.Helper()
	ctx := spCtx(t, 60*time.Second)
	if _, err := sbx.WriteFile(ctx, "/tmp/echo.py", []byte(spEchoServer)); err != nil {
		t.Fatalf("upload echo server: %v", err)
	}
	var out bytes.Buffer
	code, err := sbx.Run(ctx, `cd /tmp && (setsid nohup python3 -m http.server 8000 >/tmp/http.log 2>&1 </dev/null &) && (setsid nohup python3 /tmp/echo.py >/tmp/echo.log 2>&1 </dev/null &) && `+
		`for i in $(seq 1 100); do python3 -c 'import socket; [socket.create_connection(("127.0.0.1", p), 1).close() for p in (8000, 8001, 8002)]' 2>/dev/null && exit 0; sleep 0.1; done; cat /tmp/http.log /tmp/echo.log; exit 1`,
		sdk.RunOptions{Stdout: &out, Stderr: &out})
	if err != nil || code != 0 {
		t.Fatalf("start servers in %s: code %d err %v: %s", sbx.ID, code, err, out.String())
	}
}

func spCreate(t *testing.T, c *sdk.Client) *sdk.Sandbox {
	t.Helper()
	var sbx *sdk.Sandbox
	var err error
	// Retried: activation can fail for reasons outside service ports
	// (the control plane already retries on another worker).
	for i := 0; i < 3; i++ {
		if sbx, err = c.CreateSandbox(spCtx(t, 30*time.Second), sdk.CreateOptions{Timeout: 5 * time.Minute}); err == nil {
			break
		}
		t.Logf("create sandbox (attempt %d): %v", i+1, err)
	}
	if err != nil {
		t.Fatalf("create sandbox: %v", err)
	}
	spKillAtEnd(t, c, sbx.ID)
	return sbx
}

func spKillAtEnd(t *testing.T, c *sdk.Client, id string) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if err := c.KillSandbox(ctx, id); err != nil && !errors.Is(err, sdk.ErrNotFound) {
			t.Errorf("kill %s: %v", id, err)
		}
	})
}

// spGet sends a GET through the edge addressed by Host or by headers.
func spGet(t *testing.T, host string, hdr map[string]string) (int, http.Header, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(spCtx(t, 30*time.Second), "GET", plat.SandboxURL+"/", nil)
	if host != "" {
		req.Host = host
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	res, err := testTransport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, res.Header, string(b)
}

// spCapability asks the control plane (owner's API key) for a capability.
func spCapability(t *testing.T, id string, port int, proto string) spacev1.CapabilityResponse {
	t.Helper()
	body, _ := json.Marshal(spacev1.CapabilityRequest{Purpose: "service-port", Port: port, Protocol: proto})
	req, _ := http.NewRequestWithContext(spCtx(t, 30*time.Second), "POST", plat.APIURL+"/space/v1/sandboxes/"+id+"/capabilities", bytes.NewReader(body))
	req.Header.Set("X-API-Key", plat.APIKey)
	req.Header.Set("Content-Type", "application/json")
	res, err := testTransport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var cr spacev1.CapabilityResponse
	if res.StatusCode != 200 || json.NewDecoder(res.Body).Decode(&cr) != nil {
		t.Fatalf("capability for %s %d/%s: %d", id, port, proto, res.StatusCode)
	}
	return cr
}

// spGatewaySock is the netgtw socket of route's activation (the test
// process is sbx-manager, the only peer netgtw accepts).
func spGatewaySock(r identity.Route) string {
	sum := sha256.Sum256([]byte(fmt.Sprintf("%s/%d/%s/%s", r.SandboxID, r.Generation, r.ExecutionID, r.ActivationID)))
	return filepath.Join(plat.cfg.DataDir, "workers", r.WorkerID, "act", hex.EncodeToString(sum[:8]), "gw.sock")
}

// spDirect sends a service-port GET with a capability straight to a base
// URL (node-api) or, with sock set, asks that netgtw socket for the guest
// connection (the dial protocol sbx-manager speaks) and sends the GET on
// it; it returns the status and route outcome.
func spDirect(t *testing.T, base, sock, token string, port int, hdr map[string]string) (int, string) {
	t.Helper()
	if sock != "" {
		proto := gateway.ProtocolHTTP
		if strings.EqualFold(hdr["Upgrade"], "tcp") {
			proto = gateway.ProtocolTCP
		}
		gc, hold, err := gateway.OpenGuest(spCtx(t, 30*time.Second), sock, nil, gateway.DialRequest{Token: token, Port: port, Protocol: proto})
		var refused *gateway.RefusedError
		if errors.As(err, &refused) {
			return refused.Status, refused.Outcome
		}
		if err != nil {
			t.Fatal(err)
		}
		defer hold.Close()
		defer gc.Close()
		gc.SetDeadline(time.Now().Add(30 * time.Second))
		fmt.Fprintf(gc, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
		res, err := http.ReadResponse(bufio.NewReader(gc), nil)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		return res.StatusCode, ""
	}
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	req, _ := http.NewRequestWithContext(spCtx(t, 30*time.Second), "GET", base+"/", nil)
	req.Header.Set(spacev1.HeaderCapability, token)
	req.Header.Set("E2b-Sandbox-Port", fmt.Sprint(port))
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	res, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, res.Body)
	res.Body.Close()
	return res.StatusCode, res.Header.Get(spacev1.HeaderRouteOutcome)
}

// spUpgrade opens an upgraded stream through the edge.
func spUpgrade(t *testing.T, host, upgrade string) (net.Conn, *bufio.Reader, int) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(plat.SandboxURL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(c, "GET /ws HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: %s\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n", host, upgrade)
	br := bufio.NewReader(c)
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		c.Close()
		t.Fatalf("upgrade %s: %v", host, err)
	}
	if res.StatusCode != http.StatusSwitchingProtocols {
		io.Copy(io.Discard, res.Body)
		c.Close()
		return nil, nil, res.StatusCode
	}
	return c, br, res.StatusCode
}

func spEcho(c net.Conn, br *bufio.Reader, msg string) (string, error) {
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, msg+"\n"); err != nil {
		return "", err
	}
	return br.ReadString('\n')
}

func TestServicePorts(t *testing.T) {
	ensureNetgtw(t)
	c := newSPClient(t)
	a := spCreate(t, c)
	spStartServers(t, a)
	host := func(port int) string { return fmt.Sprintf("%d-%s.localhost", port, a.ID) }

	t.Run("HTTPByHost", func(t *testing.T) {
		st, _, body := spGet(t, host(8000), nil)
		if st != 200 || !strings.Contains(body, "Directory listing") {
			t.Fatalf("status %d body %.200q", st, body)
		}
	})
	t.Run("HTTPByHeader", func(t *testing.T) {
		st, _, body := spGet(t, "", map[string]string{"E2b-Sandbox-Id": a.ID, "E2b-Sandbox-Port": "8000"})
		if st != 200 || !strings.Contains(body, "Directory listing") {
			t.Fatalf("status %d body %.200q", st, body)
		}
	})
	t.Run("ClosedPort", func(t *testing.T) {
		if st, _, _ := spGet(t, host(8009), nil); st != http.StatusBadGateway {
			t.Fatalf("closed port: status %d, want 502", st)
		}
	})
	t.Run("WebSocketEcho", func(t *testing.T) {
		conn, br, st := spUpgrade(t, host(8002), "websocket")
		if st != 101 {
			t.Fatalf("status %d", st)
		}
		defer conn.Close()
		for _, m := range []string{"hello", "world"} {
			if got, err := spEcho(conn, br, m); err != nil || got != m+"\n" {
				t.Fatalf("echo %q: %q %v", m, got, err)
			}
		}
	})
	t.Run("RawTCP", func(t *testing.T) {
		conn, br, st := spUpgrade(t, host(8001), "tcp")
		if st != 101 {
			t.Fatalf("status %d", st)
		}
		defer conn.Close()
		payload := string([]byte{0, 1, 2, 0xff}) + strings.Repeat("x", 100000)
		if got, err := spEcho(conn, br, payload); err != nil || got != payload+"\n" {
			t.Fatalf("raw echo: %d bytes %v", len(got), err)
		}
	})

	cap8000 := spCapability(t, a.ID, 8000, "http")
	gwSock := spGatewaySock(cap8000.Route)
	if _, err := os.Stat(gwSock); err != nil {
		t.Fatalf("netgtw socket: %v", err)
	}
	t.Run("PortBoundCapability", func(t *testing.T) {
		// Sanity: the capability opens its own port at both layers.
		if st, _ := spDirect(t, cap8000.NodeURL, "", cap8000.Token, 8000, nil); st != 200 {
			t.Fatalf("node-api with own port: %d", st)
		}
		if st, _ := spDirect(t, "", gwSock, cap8000.Token, 8000, nil); st != 200 {
			t.Fatalf("netgtw with own port: %d", st)
		}
		// 8001 is open in the sandbox, but the capability is for 8000.
		if st, o := spDirect(t, cap8000.NodeURL, "", cap8000.Token, 8001, nil); st != 403 || o != spacev1.OutcomeDeny {
			t.Fatalf("node-api 8000 cap on 8001: %d %q", st, o)
		}
		if st, o := spDirect(t, "", gwSock, cap8000.Token, 8001, nil); st != 403 || o != spacev1.OutcomeDeny {
			t.Fatalf("netgtw 8000 cap on 8001: %d %q", st, o)
		}
	})
	t.Run("WrongProtocol", func(t *testing.T) {
		ws := spCapability(t, a.ID, 8000, "ws")
		if st, o := spDirect(t, ws.NodeURL, "", ws.Token, 8000, nil); st != 403 || o != spacev1.OutcomeDeny {
			t.Fatalf("node-api ws cap for http: %d %q", st, o)
		}
		if st, o := spDirect(t, "", gwSock, ws.Token, 8000, nil); st != 403 || o != spacev1.OutcomeDeny {
			t.Fatalf("netgtw ws cap for http: %d %q", st, o)
		}
		if st, o := spDirect(t, "", gwSock, cap8000.Token, 8000, map[string]string{"Upgrade": "tcp", "Connection": "Upgrade"}); st != 403 || o != spacev1.OutcomeDeny {
			t.Fatalf("netgtw http cap for tcp: %d %q", st, o)
		}
	})

	// A second sandbox, created with private traffic.
	b := spCreatePrivate(t, c)
	t.Run("OtherSandboxDeniedAtGateway", func(t *testing.T) {
		capB := spCapability(t, b.sbx.ID, 8000, "http")
		if st, o := spDirect(t, "", gwSock, capB.Token, 8000, nil); st != 403 || o != spacev1.OutcomeDeny {
			t.Fatalf("netgtw of %s with a capability for %s: %d %q", a.ID, b.sbx.ID, st, o)
		}
	})
	t.Run("PrivateTraffic", func(t *testing.T) {
		spStartServers(t, b.sbx)
		bh := fmt.Sprintf("8000-%s.localhost", b.sbx.ID)
		if st, _, _ := spGet(t, bh, nil); st != 403 {
			t.Fatalf("private sandbox without traffic token: %d", st)
		}
		if st, _, _ := spGet(t, bh, map[string]string{"e2b-traffic-access-token": "wrong"}); st != 403 {
			t.Fatalf("private sandbox with a wrong traffic token: %d", st)
		}
		if st, _, _ := spGet(t, bh, map[string]string{"X-Access-Token": b.sbx.AccessToken}); st != 403 {
			t.Fatalf("private sandbox with the envd token instead: %d", st)
		}
		if st, _, body := spGet(t, bh, map[string]string{"e2b-traffic-access-token": b.traffic}); st != 200 || !strings.Contains(body, "Directory listing") {
			t.Fatalf("private sandbox with its traffic token: %d", st)
		}
		// The public sandbox needs none.
		if st, _, _ := spGet(t, host(8000), nil); st != 200 {
			t.Fatalf("public sandbox: %d", st)
		}
	})

	// Last: it retires a's gateway.
	t.Run("ActivationChangeKeepsStreamsNewExecutionEndsThem", func(t *testing.T) {
		mgr := spManagerOf(t, cap8000.Route.WorkerID)
		conn, br, st := spUpgrade(t, host(8002), "websocket")
		if st != 101 {
			t.Fatalf("status %d", st)
		}
		defer conn.Close()
		tcp, tbr, st := spUpgrade(t, host(8001), "tcp")
		if st != 101 {
			t.Fatalf("tcp status %d", st)
		}
		defer tcp.Close()
		if got, err := spEcho(conn, br, "before"); err != nil || got != "before\n" {
			t.Fatalf("echo: %q %v", got, err)
		}
		next := cap8000.Route
		next.ActivationID = "reactivated-" + next.ActivationID
		if ans, err := mgr.SetGatewayActivation(a.ID, next); err != nil || ans != "ok" {
			t.Fatalf("activation change: %q %v", ans, err)
		}
		if got, err := spEcho(conn, br, "after-activation"); err != nil || got != "after-activation\n" {
			t.Fatalf("WebSocket across an activation-only change: %q %v", got, err)
		}
		if got, err := spEcho(tcp, tbr, "tcp-after-activation"); err != nil || got != "tcp-after-activation\n" {
			t.Fatalf("raw TCP across an activation-only change: %q %v", got, err)
		}
		// New opens need the new identity: the old activation's capability
		// (still current at the control plane) is refused by netgtw.
		if st, o := spDirect(t, "", gwSock, cap8000.Token, 8000, nil); st != 421 || o != spacev1.OutcomeRefreshRoute {
			t.Fatalf("old activation at netgtw: %d %q", st, o)
		}
		if _, _, st := spUpgrade(t, host(8002), "websocket"); st != 421 {
			t.Fatalf("new WebSocket with the old activation through the edge: %d, want 421", st)
		}
		// A new execution ends every stream at once.
		newExec := next
		newExec.Generation++
		newExec.ExecutionID = "next-" + newExec.ExecutionID
		if ans, err := mgr.SetGatewayActivation(a.ID, newExec); err != nil || ans != "ok retired" {
			t.Fatalf("execution change: %q %v", ans, err)
		}
		for name, s := range map[string]struct {
			c  net.Conn
			br *bufio.Reader
		}{"websocket": {conn, br}, "tcp": {tcp, tbr}} {
			if got, err := spEcho(s.c, s.br, "after-execution"); err == nil {
				t.Fatalf("%s survived a new execution: %q", name, got)
			}
		}
	})
}

type spPrivate struct {
	sbx     *sdk.Sandbox
	traffic string
}

// spCreatePrivate creates a sandbox as the e2b SDK does with
// network: {allowPublicTraffic: false}.
func spCreatePrivate(t *testing.T, c *sdk.Client) spPrivate {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"templateID": "base", "timeout": 300, "network": map[string]any{"allowPublicTraffic": false}})
	var s e2bapi.Sandbox
	for i := 0; ; i++ {
		req, _ := http.NewRequestWithContext(spCtx(t, 30*time.Second), "POST", plat.APIURL+"/v2/sandboxes", bytes.NewReader(body))
		req.Header.Set("X-API-Key", plat.APIKey)
		req.Header.Set("Content-Type", "application/json")
		res, err := testTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		msg, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode == 201 && json.Unmarshal(msg, &s) == nil {
			break
		}
		if i == 2 {
			t.Fatalf("create private sandbox: %d %s", res.StatusCode, msg)
		}
		t.Logf("create private sandbox (attempt %d): %d %s", i+1, res.StatusCode, msg)
	}
	spKillAtEnd(t, c, s.SandboxID)
	if s.TrafficAccessToken == nil || *s.TrafficAccessToken == "" {
		t.Fatal("private sandbox without trafficAccessToken")
	}
	return spPrivate{sbx: c.Attach(s.SandboxID, s.EnvdAccessToken), traffic: *s.TrafficAccessToken}
}

func spManagerOf(t *testing.T, worker string) interface {
	SetGatewayActivation(string, identity.Route) (string, error)
} {
	t.Helper()
	for i, w := range plat.Workers {
		if fmt.Sprintf("w%d", i+1) == worker {
			return w.Manager()
		}
	}
	t.Fatalf("no worker %s", worker)
	return nil
}

func newSPClient(t *testing.T) *sdk.Client {
	t.Helper()
	c, err := sdk.New(sdk.Config{APIURL: plat.APIURL, SandboxURL: plat.SandboxURL, APIKey: plat.APIKey,
		HTTPClient: &http.Client{Transport: testTransport}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}
