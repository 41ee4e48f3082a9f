package controlplane

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/store"
)

// serveMetricsRange answers NodePathMetricsRange from n.samples, filtered
// as the worker does.
func (n *fakeNode) serveMetricsRange(w http.ResponseWriter, r *http.Request, body []byte) {
	var req spacev1.MetricsRangeRequest
	_ = json.Unmarshal(body, &req)
	if err := n.verify(r, func() spacev1.TeardownRequest { return spacev1.TeardownRequest{Route: req.Route} }); err != nil {
		n.mu.Lock()
		n.tokenErr = err
		n.mu.Unlock()
		w.WriteHeader(http.StatusForbidden)
		return
	}
	n.mu.Lock()
	samples := n.samples
	n.mu.Unlock()
	if samples == nil {
		samples = []spacev1.MetricsResponse{{Timestamp: time.Now(), CPUCount: 2, CPUUsedPct: 7.5,
			MemUsed: 10 << 20, MemTotal: 512 << 20, DiskUsed: 2 << 20}}
	}
	out := []spacev1.MetricsResponse{}
	for _, s := range samples {
		if (!req.Start.IsZero() && s.Timestamp.Before(req.Start)) || (!req.End.IsZero() && s.Timestamp.After(req.End)) {
			continue
		}
		out = append(out, s)
	}
	if req.Last > 0 && len(out) > req.Last {
		out = out[len(out)-req.Last:]
	}
	_ = json.NewEncoder(w).Encode(spacev1.MetricsRangeResponse{Samples: out})
}

// series is five samples 5 s apart from base, cpu 10, 20, ... percent.
func series(base time.Time) []spacev1.MetricsResponse {
	var out []spacev1.MetricsResponse
	for i := range 5 {
		out = append(out, spacev1.MetricsResponse{Timestamp: base.Add(time.Duration(i) * 5 * time.Second), CPUCount: 1,
			CPUUsedPct: float64(10 * (i + 1)), MemUsed: 1 << 20, MemTotal: 256 << 20})
	}
	return out
}

func TestSandboxMetricsRange(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	n := newFakeNode(t, "w1", st)
	e.register(n, 10)
	base := time.Unix(time.Now().Add(-time.Minute).Unix(), 0)
	n.samples = series(base)
	sb := createV2(t, e, map[string]any{"templateID": "base"})
	path := "/sandboxes/" + sb.SandboxID + "/metrics"

	get := func(q string) []e2bapi.SandboxMetric {
		t.Helper()
		r := e.api("GET", path+q, nil)
		if r.Code != 200 {
			t.Fatalf("GET %s: %d %s", q, r.Code, r.Body)
		}
		var ms []e2bapi.SandboxMetric
		r.decode(t, &ms)
		return ms
	}
	if ms := get(""); len(ms) != 5 || ms[0].CPUUsedPct != 10 || ms[4].CPUUsedPct != 50 {
		t.Fatalf("open window: %+v", ms)
	}
	// [base+5, base+15], inclusive, oldest first.
	ms := get(fmt.Sprintf("?start=%d&end=%d", base.Unix()+5, base.Unix()+15))
	if len(ms) != 3 || ms[0].TimestampUnix != base.Unix()+5 || ms[2].TimestampUnix != base.Unix()+15 ||
		ms[0].CPUUsedPct != 20 || ms[2].CPUUsedPct != 40 {
		t.Fatalf("window: %+v", ms)
	}
	for i := 1; i < len(ms); i++ {
		if !ms[i].Timestamp.After(ms[i-1].Timestamp) {
			t.Fatalf("not oldest first: %+v", ms)
		}
	}
	if ms := get(fmt.Sprintf("?start=%d", base.Unix()+16)); len(ms) != 1 || ms[0].CPUUsedPct != 50 {
		t.Fatalf("start only: %+v", ms)
	}
	if ms := get(fmt.Sprintf("?end=%d", base.Unix()-1)); len(ms) != 0 {
		t.Fatalf("before the first: %+v", ms)
	}
	// Bad windows are 400, before anything else is looked at.
	for _, q := range []string{"?start=abc", "?end=1.5", "?start=-1", "?start=20&end=10", "?end=99999999999999"} {
		expectError(t, e.api("GET", path+q, nil), 400)
	}
	// Another team's sandbox is 404.
	expectError(t, e.do("GET", path, map[string]string{"X-API-Key": otherTeamKey(t, st)}, nil), 404)
}

func TestSandboxesMetrics(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	n := newFakeNode(t, "w1", st)
	e.register(n, 10)
	base := time.Unix(time.Now().Add(-time.Minute).Unix(), 0)
	n.samples = series(base)
	a := createV2(t, e, map[string]any{"templateID": "base"})
	b := createV2(t, e, map[string]any{"templateID": "base"})
	other := otherTeamKey(t, st)
	r := e.do("POST", "/v2/sandboxes", map[string]string{"X-API-Key": other}, map[string]any{"templateID": "base"})
	var foreign e2bapi.Sandbox
	r.decode(t, &foreign)
	if foreign.SandboxID == "" {
		t.Fatalf("other team's create: %d %s", r.Code, r.Body)
	}

	// Comma-separated and repeated; other teams' and unknown ids absent.
	r = e.api("GET", "/sandboxes/metrics?sandbox_ids="+a.SandboxID+","+foreign.SandboxID+"&sandbox_ids="+b.SandboxID+",nosuchsandbox", nil)
	if r.Code != 200 {
		t.Fatalf("%d %s", r.Code, r.Body)
	}
	var got e2bapi.SandboxesWithMetrics
	r.decode(t, &got)
	if len(got.Sandboxes) != 2 || got.Sandboxes[a.SandboxID].CPUUsedPct != 50 || got.Sandboxes[b.SandboxID].TimestampUnix != base.Unix()+20 {
		t.Fatalf("latest: %s", r.Body)
	}
	if _, ok := got.Sandboxes[foreign.SandboxID]; ok {
		t.Fatal("another team's sandbox is listed")
	}
	expectError(t, e.api("GET", "/sandboxes/metrics", nil), 400)
	expectError(t, e.api("GET", "/sandboxes/metrics?sandbox_ids=../x", nil), 400)
	expectError(t, e.api("GET", "/sandboxes/metrics?sandbox_ids="+strings.Repeat("a,", 0)+manyIDs(maxMetricsSandboxes+1), nil), 400)
	expectError(t, e.do("GET", "/sandboxes/metrics?sandbox_ids="+a.SandboxID, nil, nil), 401)
}

func manyIDs(n int) string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("sbx%04d", i)
	}
	return strings.Join(ids, ",")
}

func TestTeamMetrics(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, func(c *Config) { c.TeamMetricsInterval = -1 }) // sampled by hand below
	e.srv.teamMetrics.interval = 5 * time.Second
	base := time.Unix(time.Now().Add(-time.Hour).Unix(), 0)
	rec := func(id, team string, st store.SandboxState, created time.Time) store.SandboxEntry {
		return store.SandboxEntry{Record: store.SandboxRecord{ID: id, TeamID: team, State: st, CreatedAt: created}}
	}
	// t0: two running, one paused (created long ago); t0+5: a third
	// started; t0+10: one killed, another team's start.
	tm := e.srv.teamMetrics
	old := base.Add(-time.Hour)
	tm.sample(base, []store.SandboxEntry{rec("a", DefaultTeamID, store.StateRunning, old), rec("b", DefaultTeamID, store.StateRunning, old),
		rec("c", DefaultTeamID, store.StatePaused, old)})
	tm.sample(base.Add(5*time.Second), []store.SandboxEntry{rec("a", DefaultTeamID, store.StateRunning, old), rec("b", DefaultTeamID, store.StateRunning, old),
		rec("c", DefaultTeamID, store.StatePaused, old), rec("d", DefaultTeamID, store.StateCreating, base.Add(3*time.Second))})
	tm.sample(base.Add(10*time.Second), []store.SandboxEntry{rec("a", DefaultTeamID, store.StateKilled, old), rec("b", DefaultTeamID, store.StateRunning, old),
		rec("d", DefaultTeamID, store.StateRunning, base.Add(3*time.Second)), rec("x", "other", store.StateRunning, base.Add(8*time.Second))})

	path := "/teams/" + DefaultTeamID + "/metrics"
	r := e.api("GET", path, nil)
	var ms []e2bapi.TeamMetric
	r.decode(t, &ms)
	if r.Code != 200 || len(ms) != 3 {
		t.Fatalf("%d %s", r.Code, r.Body)
	}
	if ms[0].ConcurrentSandboxes != 2 || ms[1].ConcurrentSandboxes != 3 || ms[2].ConcurrentSandboxes != 2 ||
		ms[0].SandboxStartRate != 0 || ms[1].SandboxStartRate != 0.2 || ms[2].SandboxStartRate != 0 ||
		ms[1].TimestampUnix != base.Unix()+5 || !ms[1].Timestamp.Equal(base.Add(5*time.Second)) {
		t.Fatalf("series: %s", r.Body)
	}
	r = e.api("GET", fmt.Sprintf("%s?start=%d&end=%d", path, base.Unix()+5, base.Unix()+10), nil)
	r.decode(t, &ms)
	if len(ms) != 2 || ms[0].TimestampUnix != base.Unix()+5 {
		t.Fatalf("window: %s", r.Body)
	}
	r = e.api("GET", path+"/max?metric=concurrent_sandboxes", nil)
	var mx e2bapi.MaxTeamMetric
	r.decode(t, &mx)
	if r.Code != 200 || mx.Value != 3 || mx.TimestampUnix != base.Unix()+5 {
		t.Fatalf("max concurrent: %d %s", r.Code, r.Body)
	}
	r = e.api("GET", fmt.Sprintf("%s/max?metric=sandbox_start_rate&start=%d", path, base.Unix()+6), nil)
	r.decode(t, &mx)
	if r.Code != 200 || mx.Value != 0 || mx.TimestampUnix != base.Unix()+10 {
		t.Fatalf("max rate after the start: %d %s", r.Code, r.Body)
	}
	// Bad input is 400; another team's metrics (and an unknown team) are
	// 404, for the other team's key too.
	expectError(t, e.api("GET", path+"/max", nil), 400)
	expectError(t, e.api("GET", path+"/max?metric=cpu", nil), 400)
	expectError(t, e.api("GET", path+"?start=x", nil), 400)
	expectError(t, e.api("GET", path+"?start=10&end=5", nil), 400)
	expectError(t, e.api("GET", "/teams/other/metrics", nil), 404)
	expectError(t, e.api("GET", "/teams/other/metrics/max?metric=concurrent_sandboxes", nil), 404)
	expectError(t, e.do("GET", path, map[string]string{"X-API-Key": otherTeamKey(t, st)}, nil), 404)
	expectError(t, e.do("GET", path, nil, nil), 401)
	r = e.do("GET", "/teams/other/metrics", map[string]string{"X-API-Key": otherTeamKey(t, st)}, nil)
	r.decode(t, &ms)
	if r.Code != 200 || len(ms) != 1 || ms[0].ConcurrentSandboxes != 1 || ms[0].SandboxStartRate != 0.2 {
		t.Fatalf("other team's own: %d %s", r.Code, r.Body)
	}
}

func TestTeamMetricsSampler(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, func(c *Config) { c.TeamMetricsInterval = 20 * time.Millisecond })
	n := newFakeNode(t, "w1", st)
	e.register(n, 10)
	createV2(t, e, map[string]any{"templateID": "base"})
	waitFor(t, func() bool {
		var ms []e2bapi.TeamMetric
		r := e.api("GET", "/teams/"+DefaultTeamID+"/metrics", nil)
		_ = json.Unmarshal(r.Body, &ms)
		return len(ms) > 0 && ms[len(ms)-1].ConcurrentSandboxes == 1
	})
}

func TestRefresh(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	n := newFakeNode(t, "w1", st)
	e.register(n, 10)
	sb := createV2(t, e, map[string]any{"templateID": "base", "timeout": 60})
	path := "/sandboxes/" + sb.SandboxID + "/refreshes"
	end0 := e.record(sb.SandboxID).EndAt
	if r := e.api("POST", path, map[string]any{"duration": 600}); r.Code != 204 {
		t.Fatalf("refresh: %d %s", r.Code, r.Body)
	}
	end1 := e.record(sb.SandboxID).EndAt
	if !end1.After(end0) || end1.Sub(e.clock.Now()) < 599*time.Second {
		t.Fatalf("end %v -> %v", end0, end1)
	}
	// Never shortens; no body means E2B's default (15 s), also no shorter.
	if r := e.api("POST", path, map[string]any{"duration": 1}); r.Code != 204 {
		t.Fatalf("short refresh: %d %s", r.Code, r.Body)
	}
	if r := e.api("POST", path, nil); r.Code != 204 {
		t.Fatalf("refresh without body: %d %s", r.Code, r.Body)
	}
	if got := e.record(sb.SandboxID).EndAt; !got.Equal(end1) {
		t.Fatalf("shortened: %v -> %v", end1, got)
	}
	expectError(t, e.api("POST", path, map[string]any{"duration": 3601}), 400)
	expectError(t, e.api("POST", path, map[string]any{"duration": -1}), 400)
	expectError(t, e.api("POST", path, map[string]any{"duration": "soon"}), 400)
	expectError(t, e.do("POST", path, map[string]string{"X-API-Key": otherTeamKey(t, st)}, map[string]any{"duration": 60}), 404)
	expectError(t, e.api("POST", "/sandboxes/nosuchsandbox/refreshes", map[string]any{"duration": 60}), 404)
	expectError(t, e.do("POST", path, nil, map[string]any{"duration": 60}), 401)
}

// The create body's autoResume is stored and reported; traffic (a
// capability request) to the paused sandbox resumes it once however many
// requests arrive together; without autoResume it stays paused.
func TestAutoResume(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	n := newFakeNode(t, "w1", st)
	e.register(n, 10)
	lg := &callLog{}
	life := attachLife(n, lg)

	sb := createV2(t, e, map[string]any{"templateID": "base", "autoPause": true, "autoResume": map[string]any{"enabled": true}})
	var d e2bapi.SandboxDetail
	e.api("GET", "/sandboxes/"+sb.SandboxID, nil).decode(t, &d)
	if d.Lifecycle == nil || !d.Lifecycle.AutoResume || d.Lifecycle.OnTimeout != "pause" {
		t.Fatalf("lifecycle %+v", d.Lifecycle)
	}
	plain := createV2(t, e, map[string]any{"templateID": "base"})
	e.api("GET", "/sandboxes/"+plain.SandboxID, nil).decode(t, &d)
	if d.Lifecycle == nil || d.Lifecycle.AutoResume || d.Lifecycle.OnTimeout != "kill" {
		t.Fatalf("plain lifecycle %+v", d.Lifecycle)
	}
	r := e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "autoPause": true, "autoPauseMemory": false, "autoResume": map[string]any{"enabled": true}})
	expectError(t, r, 400)

	for _, id := range []string{sb.SandboxID, plain.SandboxID} {
		if r := e.api("POST", "/sandboxes/"+id+"/pause", nil); r.Code != 204 {
			t.Fatalf("pause: %d %s", r.Code, r.Body)
		}
	}
	capPath := "/space/v1/sandboxes/" + sb.SandboxID + "/capabilities"
	// Unauthorized traffic resumes nothing.
	expectError(t, e.do("POST", capPath, map[string]string{"X-API-Key": edgeKey, "X-Access-Token": "wrong"}, map[string]any{"purpose": "process"}), 401)
	expectError(t, e.do("POST", capPath, map[string]string{"X-API-Key": otherTeamKey(t, st)}, map[string]any{"purpose": "process"}), 404)
	if s := e.record(sb.SandboxID).State; s != store.StatePaused {
		t.Fatalf("resumed by unauthorized traffic: %s", s)
	}

	lg.reset()
	release := life.setBlock(spacev1.NodePathResume)
	const callers = 6
	var wg sync.WaitGroup
	results := make([]resp, callers)
	for i := range callers {
		purpose := []string{"process", "filesystem", "files"}[i%3]
		wg.Go(func() {
			results[i] = e.do("POST", capPath, map[string]string{"X-API-Key": edgeKey, "X-Access-Token": sb.EnvdAccessToken}, map[string]any{"purpose": purpose})
		})
	}
	<-life.entered
	time.Sleep(50 * time.Millisecond) // the others arrive while the resume runs
	close(release)
	wg.Wait()
	rec := e.record(sb.SandboxID)
	for i, r := range results {
		var cr spacev1.CapabilityResponse
		if r.Code != 200 {
			t.Fatalf("caller %d: %d %s", i, r.Code, r.Body)
		}
		r.decode(t, &cr)
		if cr.Route != rec.Route {
			t.Fatalf("caller %d got route %v, published %v", i, cr.Route, rec.Route)
		}
	}
	resumes := 0
	for _, ev := range lg.all() {
		if strings.Contains(ev, " resume ") {
			resumes++
		}
	}
	if resumes != 1 || rec.State != store.StateRunning {
		t.Fatalf("resumes %d (log %v), state %s", resumes, lg.all(), rec.State)
	}
	if rec.EndAt.Sub(e.clock.Now()) < DefaultTimeout-time.Minute {
		t.Fatalf("resumed with end %v", rec.EndAt)
	}

	// Without autoResume: still paused, 409 paused (the edge's 502).
	r = e.do("POST", "/space/v1/sandboxes/"+plain.SandboxID+"/capabilities", map[string]string{"X-API-Key": edgeKey, "X-Access-Token": plain.EnvdAccessToken}, map[string]any{"purpose": "process"})
	expectError(t, r, 409)
	if s := e.record(plain.SandboxID).State; s != store.StatePaused {
		t.Fatalf("plain sandbox %s", s)
	}
}

func FuzzParseWindow(f *testing.F) {
	for _, s := range [][2]string{{"", ""}, {"1", "2"}, {"-1", ""}, {"abc", "9"}, {"253402300799", "253402300800"}, {"5", "4"}} {
		f.Add(s[0], s[1])
	}
	f.Fuzz(func(t *testing.T, start, end string) {
		q := url.Values{}
		if start != "" {
			q.Set("start", start)
		}
		if end != "" {
			q.Set("end", end)
		}
		w, err := parseWindow(q)
		if err != nil {
			return
		}
		if w.start < 0 || w.end < 0 || w.start > maxUnixSeconds || w.end > maxUnixSeconds || (w.start != 0 && w.end != 0 && w.end < w.start) {
			t.Fatalf("accepted %q %q as %+v", start, end, w)
		}
		s, e := w.times()
		if (w.start != 0 && !w.contains(s)) || (w.end != 0 && !w.contains(e)) {
			t.Fatalf("window %+v does not contain its bounds %v %v", w, s, e)
		}
	})
}
