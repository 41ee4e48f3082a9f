package controlplane

import (
	"fmt"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
)

func TestSandboxMetrics(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	n := newFakeNode(t, "w1", st)
	e.register(n, 10)
	sb := createV2(t, e, map[string]any{"templateID": "base"})
	path := "/sandboxes/" + sb.SandboxID + "/metrics"

	r := e.api("GET", path, nil)
	if r.Code != 200 {
		t.Fatalf("metrics: %d %s", r.Code, r.Body)
	}
	var ms []e2bapi.SandboxMetric
	r.decode(t, &ms)
	if len(ms) != 1 {
		t.Fatalf("metrics %s", r.Body)
	}
	m := ms[0]
	if m.CPUCount != 2 || m.CPUUsedPct != 7.5 || m.MemUsed != 10<<20 || m.MemTotal != 512<<20 || m.DiskUsed != 2<<20 ||
		m.DiskTotal != int64(DefaultTemplate.DiskSizeMB)<<20 || time.Since(m.Timestamp) > time.Minute || m.TimestampUnix != m.Timestamp.Unix() {
		t.Fatalf("metric %+v", m)
	}
	if _, _, err := n.counts(); err != nil {
		t.Fatalf("node saw a bad control capability: %v", err)
	}
	// A window that ends before now holds no sample; one around now does.
	past := time.Now().Add(-time.Hour).Unix()
	if r := e.api("GET", fmt.Sprintf("%s?start=%d&end=%d", path, past-60, past), nil); r.Code != 200 || string(r.Body) != "[]\n" && string(r.Body) != "[]" {
		t.Fatalf("past window: %d %q", r.Code, r.Body)
	}
	r = e.api("GET", fmt.Sprintf("%s?start=%d&end=%d", path, past, time.Now().Add(time.Hour).Unix()), nil)
	r.decode(t, &ms)
	if r.Code != 200 || len(ms) != 1 {
		t.Fatalf("current window: %d %s", r.Code, r.Body)
	}
	expectError(t, e.api("GET", path+"?start=yesterday", nil), 400)
	// Authorized like GET /sandboxes/{id}.
	expectError(t, e.do("GET", path, nil, nil), 401)
	expectError(t, e.do("GET", path, map[string]string{"X-API-Key": "e2b_bogus"}, nil), 401)
	expectError(t, e.api("GET", "/sandboxes/nosuchsandbox/metrics", nil), 404)
	// A worker that cannot answer for a running sandbox is an error.
	n.srv.Close()
	if r := e.api("GET", path, nil); r.Code/100 != 5 {
		t.Fatalf("unreachable worker: %d %s", r.Code, r.Body)
	}
	// Killed: 404 like every other read.
	if r := e.api("DELETE", "/sandboxes/"+sb.SandboxID, nil); r.Code/100 != 2 {
		t.Fatalf("kill: %d %s", r.Code, r.Body)
	}
	expectError(t, e.api("GET", path, nil), 404)
}
