package edge

import (
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	dto "github.com/prometheus/client_model/go"
)

// With several control planes the edge tries the next when one is down
// (connection refused) or answers 503, sticks to the one that answered,
// and answers 503 itself only when none can.
func TestControlPlaneFailover(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	ln.Close() // connection refused from now on
	var unavailableCalls atomic.Int32
	unavailable := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		unavailableCalls.Add(1)
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer unavailable.Close()
	h := newHarness(t, func(c *Config) { c.ControlPlaneURL = dead + ", " + unavailable.URL + "/," + c.ControlPlaneURL })

	h.sandbox("sbx1")
	if res := h.envd("POST", "sbx1", "/filesystem.Filesystem/ListDir", `{}`); res.StatusCode != 200 {
		t.Fatalf("status %d: %s", res.StatusCode, readAll(t, res))
	} else {
		res.Body.Close()
	}
	if n := len(h.cp.callsCopy()); n != 1 || unavailableCalls.Load() != 1 {
		t.Fatalf("calls: live %d, unavailable %d", n, unavailableCalls.Load())
	}
	var m dto.Metric
	_ = h.edge.metrics.cpFailovers.Write(&m)
	if n := m.GetCounter().GetValue(); n != 2 {
		t.Fatalf("failovers %v, want 2", n)
	}
	// The replica that answered is tried first from now on.
	h.sandbox("sbx2")
	if res := h.envd("POST", "sbx2", "/filesystem.Filesystem/ListDir", `{}`); res.StatusCode != 200 {
		t.Fatalf("status %d: %s", res.StatusCode, readAll(t, res))
	} else {
		res.Body.Close()
	}
	if n := len(h.cp.callsCopy()); n != 2 || unavailableCalls.Load() != 1 {
		t.Fatalf("calls: live %d, unavailable %d", n, unavailableCalls.Load())
	}
	// A refusal is final: not retried elsewhere (sbx3 is unknown: 404 at
	// the control plane, 502 sandbox-not-found at the edge).
	if res := h.envd("POST", "sbx3", "/filesystem.Filesystem/ListDir", `{}`); res.StatusCode != 502 {
		t.Fatalf("unknown sandbox: status %d: %s", res.StatusCode, readAll(t, res))
	} else {
		res.Body.Close()
	}
	if unavailableCalls.Load() != 1 {
		t.Fatal("a refusal was retried on another replica")
	}
	// The last live replica killed: nobody answers; the last one tried
	// (the 503 replica) gives the answer: 502, a control-plane error.
	h.cp.srv.Close()
	h.sandbox("sbx4")
	res := h.envd("POST", "sbx4", "/filesystem.Filesystem/ListDir", `{}`)
	body := readAll(t, res)
	if res.StatusCode != 502 {
		t.Fatalf("all replicas down: status %d: %s", res.StatusCode, body)
	}
	if unavailableCalls.Load() != 2 {
		t.Fatalf("unavailable replica calls %d, want 2 (every replica tried)", unavailableCalls.Load())
	}
}

func TestControlPlaneURLsValidate(t *testing.T) {
	for _, bad := range []string{"", " , ,", "http://a:1,ftp://b", "http://a:1,http://"} {
		if err := (Config{ControlPlaneURL: bad, EdgeKey: "k"}).Validate(); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
	if err := (Config{ControlPlaneURL: "http://a:1, https://b:2/", EdgeKey: "k"}).Validate(); err != nil {
		t.Fatal(err)
	}
	if got := (Config{ControlPlaneURL: " http://a:1/, https://b:2/ "}).withDefaults().ControlPlaneURL; got != "http://a:1,https://b:2" {
		t.Fatalf("normalized %q", got)
	}
}
