package edge

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"
)

// cpRecorder records the headers of capability requests to the control
// plane.
type cpRecorder struct {
	mu  sync.Mutex
	hdr []http.Header
	rt  http.RoundTripper
}

func (c *cpRecorder) RoundTrip(r *http.Request) (*http.Response, error) {
	c.mu.Lock()
	c.hdr = append(c.hdr, r.Header.Clone())
	c.mu.Unlock()
	return c.rt.RoundTrip(r)
}

func (c *cpRecorder) last() http.Header {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.hdr[len(c.hdr)-1]
}

// Service-port requests: the node learns sandbox and port from headers the
// edge sets (whatever the client sent), the traffic access token goes to
// the control plane as the caller's credential and never to the node, and
// the envd access token plays no part.
func TestServicePortForwardingAndTrafficToken(t *testing.T) {
	tr := &http.Transport{}
	rec := &cpRecorder{rt: tr}
	h := newHarness(t, func(c *Config) { c.ControlPlaneClient = &http.Client{Transport: rec} })
	t.Cleanup(tr.CloseIdleConnections)
	h.sandbox("sbx1")

	path := "/p"
	send := func(host string, hdr map[string]string) *http.Response {
		req, _ := http.NewRequest("GET", h.srv.URL+path, nil)
		req.Host = host
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		res, err := h.cl.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		readAll(t, res)
		return res
	}
	res := send("8000-sbx1.localhost", map[string]string{HeaderTrafficAccessToken: "traffic-secret", "X-Access-Token": "envd-secret"})
	if res.StatusCode != 200 {
		t.Fatalf("status %d", res.StatusCode)
	}
	calls := h.node.callsCopy()
	got := calls[len(calls)-1].Header
	if got.Get(HeaderSandboxPort) != "8000" || got.Get(HeaderSandboxID) != "sbx1" {
		t.Fatalf("node saw port %q sandbox %q", got.Get(HeaderSandboxPort), got.Get(HeaderSandboxID))
	}
	if got.Get(HeaderTrafficAccessToken) != "" || got.Get("X-Access-Token") != "" {
		t.Fatal("a caller credential reached the node")
	}
	cp := rec.last()
	if cp.Get(HeaderTrafficAccessToken) != "traffic-secret" || cp.Get("X-Access-Token") != "" {
		t.Fatalf("control plane saw traffic %q access %q", cp.Get(HeaderTrafficAccessToken), cp.Get("X-Access-Token"))
	}
	// Another traffic token is another authorization (another cache key).
	n := len(h.cp.callsCopy())
	send("8000-sbx1.localhost", map[string]string{HeaderTrafficAccessToken: "other"})
	if len(h.cp.callsCopy()) != n+1 {
		t.Fatal("a different traffic token reused the cached authorization")
	}
	// Header addressing: the edge's parsed port is forwarded.
	send("edge.example", map[string]string{HeaderSandboxID: "sbx1", HeaderSandboxPort: "8001"})
	calls = h.node.callsCopy()
	if p := calls[len(calls)-1].Header.Get(HeaderSandboxPort); p != "8001" {
		t.Fatalf("node saw port %q", p)
	}
	// envd requests keep using the envd access token.
	path = "/health"
	send("49983-sbx1.localhost", map[string]string{"X-Access-Token": "envd-secret", HeaderTrafficAccessToken: "traffic-secret"})
	if cp := rec.last(); cp.Get("X-Access-Token") != "envd-secret" || cp.Get(HeaderTrafficAccessToken) != "" {
		t.Fatalf("envd capability request headers %v", cp)
	}
}

// "Upgrade: tcp" asks for a raw TCP capability and is carried like any
// other upgrade.
func TestRawTCPUpgrade(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	h.node.handle("/", func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		_, _ = brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n")
		_ = brw.Flush()
		_, _ = io.Copy(conn, brw)
	})
	conn, err := net.Dial("tcp", h.srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	_, _ = io.WriteString(conn, "GET / HTTP/1.1\r\nHost: 5432-sbx1.localhost\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n")
	br := bufio.NewReader(conn)
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.StatusCode != 101 {
		t.Fatalf("status %d", res.StatusCode)
	}
	_, _ = conn.Write([]byte{0, 1, 2, '\n'})
	line, err := br.ReadString('\n')
	if err != nil || line != "\x00\x01\x02\n" {
		t.Fatalf("got %q %v", line, err)
	}
	cps := h.cp.callsCopy()
	if last := cps[len(cps)-1].Req; last.Protocol != "tcp" || last.Port != 5432 || last.Purpose != "service-port" {
		t.Fatalf("capability request %+v", last)
	}
}

// Concurrent requests to one node reuse their connections: the default
// node transport keeps more than http.DefaultTransport's two idle
// connections per host, so a second wave of concurrent requests opens no
// new ones.
func TestNodeConnectionsReused(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	const wave = 8
	var (
		mu      sync.Mutex
		conns   = map[string]bool{}
		arrived sync.WaitGroup
		release = make(chan struct{})
	)
	h.node.handle("/hold", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		conns[r.RemoteAddr] = true
		mu.Unlock()
		arrived.Done()
		<-release
		_, _ = io.WriteString(w, "ok")
	})
	cl := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: wave}}
	t.Cleanup(cl.CloseIdleConnections)
	for round := 0; round < 2; round++ {
		arrived.Add(wave)
		release = make(chan struct{})
		var done sync.WaitGroup
		for i := 0; i < wave; i++ {
			done.Go(func() {
				req, _ := http.NewRequest("GET", h.srv.URL+"/hold", nil)
				req.Host = "8000-sbx1.localhost"
				res, err := cl.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				if b := readAll(t, res); res.StatusCode != 200 || b != "ok" {
					t.Errorf("status %d body %q", res.StatusCode, b)
				}
			})
		}
		arrived.Wait() // all of the wave in flight at once
		close(release)
		done.Wait()
		time.Sleep(50 * time.Millisecond) // connections back in the pool
	}
	if len(conns) > wave {
		t.Fatalf("%d requests in two waves of %d used %d node connections", 2*wave, wave, len(conns))
	}
}
