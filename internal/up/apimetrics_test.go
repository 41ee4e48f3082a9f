package up

// Metrics over time, team metrics, refreshes and autoResume through the
// whole platform (issue 17): the worker's sampler, node-api's range call,
// the control plane's routes and the edge's resume of a paused sandbox.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/controlplane"
	"github.com/spacesbx/space/sdk"
)

// apiCall makes one REST call with the platform's key; out may be nil.
func apiCall(t *testing.T, method, path string, in, out any) int {
	t.Helper()
	var body io.Reader
	if in != nil {
		b, _ := json.Marshal(in)
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctxFor(t, 60*time.Second), method, plat.APIURL+path, body)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-API-Key", plat.APIKey)
	req.Header.Set("Content-Type", "application/json")
	res, err := (&http.Client{Transport: testTransport}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	raw, _ := io.ReadAll(res.Body)
	if out != nil && res.StatusCode/100 == 2 {
		if err := json.Unmarshal(raw, out); err != nil {
			t.Fatalf("%s %s: %v: %s", method, path, err, raw)
		}
	}
	return res.StatusCode
}

func TestMetricsOverTime(t *testing.T) {
	c := newClient(t)
	sbx := newSandbox(t)
	ctx := ctxFor(t, 2*time.Minute)
	mustRun(t, sbx, "setsid sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 &", "")
	start := time.Now()
	var ms []sdk.SandboxMetric
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(2 * time.Second) {
		var err error
		if ms, err = c.GetMetrics(ctx, sbx.ID, start, time.Time{}); err != nil {
			t.Fatal(err)
		}
		if len(ms) >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d samples after a minute: %+v", len(ms), ms)
		}
	}
	end := time.Now()
	ms, err := c.GetMetrics(ctx, sbx.ID, start, end)
	if err != nil || len(ms) < 3 {
		t.Fatalf("window: %+v %v", ms, err)
	}
	for i, m := range ms {
		if m.TimestampUnix < start.Unix() || m.TimestampUnix > end.Unix() || (i > 0 && !m.Timestamp.After(ms[i-1].Timestamp)) {
			t.Fatalf("sample %d out of [%d, %d] or order: %+v", i, start.Unix(), end.Unix(), ms)
		}
		if m.CPUUsedPct <= 0 || m.MemUsed <= 0 || m.MemTotal <= 0 || m.CPUCount < 1 {
			t.Fatalf("sample %d of a busy sandbox: %+v", i, m)
		}
		t.Logf("sample %d: %s cpu %.1f%% mem %d MiB disk %d KiB", i, m.Timestamp.Format(time.TimeOnly), m.CPUUsedPct, m.MemUsed>>20, m.DiskUsed>>10)
	}
	// One sample per 5 s pass; where in its pass a sandbox is sampled
	// moves with the worker's load, so one gap may be short and the next
	// long: the mean is the interval.
	if gap := ms[len(ms)-1].Timestamp.Sub(ms[0].Timestamp) / time.Duration(len(ms)-1); gap < 3*time.Second || gap > 8*time.Second {
		t.Fatalf("samples %v apart on average, want ~5 s", gap)
	}
	if later, err := c.GetMetrics(ctx, sbx.ID, end.Add(time.Hour), time.Time{}); err != nil || len(later) != 0 {
		t.Fatalf("future window: %+v %v", later, err)
	}
	if code := apiCall(t, "GET", fmt.Sprintf("/sandboxes/%s/metrics?start=%d&end=%d", sbx.ID, end.Unix(), start.Unix()), nil, nil); code != 400 {
		t.Fatalf("end before start: %d", code)
	}

	latest, err := c.LatestMetrics(ctx, []string{sbx.ID, "nosuchsandbox"})
	if m, ok := latest[sbx.ID]; err != nil || len(latest) != 1 || !ok || m.CPUUsedPct <= 0 || m.TimestampUnix < ms[len(ms)-1].TimestampUnix {
		t.Fatalf("latest: %+v %v", latest, err)
	}
	tm, err := c.TeamMetrics(ctx, controlplane.DefaultTeamID, start.Add(-time.Minute), time.Time{})
	if err != nil || len(tm) == 0 || tm[len(tm)-1].ConcurrentSandboxes < 1 {
		t.Fatalf("team metrics: %+v %v", tm, err)
	}
	mx, err := c.MaxTeamMetric(ctx, controlplane.DefaultTeamID, sdk.MetricConcurrentSandboxes, start.Add(-time.Minute), time.Time{})
	if err != nil || mx.Value < 1 {
		t.Fatalf("max: %+v %v", mx, err)
	}
	if _, err := c.TeamMetrics(ctx, "someone-else", time.Time{}, time.Time{}); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("another team's metrics: %v", err)
	}
	before, _ := c.GetSandbox(ctx, sbx.ID)
	if err := c.Refresh(ctx, sbx.ID, 50*time.Minute); err != nil {
		t.Fatal(err)
	}
	if after, _ := c.GetSandbox(ctx, sbx.ID); !after.EndAt.After(before.EndAt) {
		t.Fatalf("refresh: end %v -> %v", before.EndAt, after.EndAt)
	}
}

// TestAutoResume: a paused sandbox created with autoResume is resumed by
// traffic through the edge (once for concurrent requests of every
// purpose, whether the edge had a cached route or not) and the requests
// are served; without autoResume it stays paused and requests fail.
func TestAutoResume(t *testing.T) {
	c := newClient(t)
	ctx := ctxFor(t, 3*time.Minute)
	var created e2bapi.Sandbox
	if code := apiCall(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "base", "timeout": 300,
		"autoPause": true, "autoResume": map[string]any{"enabled": true}}, &created); code != 201 {
		t.Fatalf("create: %d", code)
	}
	t.Cleanup(func() { _ = c.KillSandbox(ctxFor(t, 15*time.Second), created.SandboxID) })
	sbx := c.Attach(created.SandboxID, created.EnvdAccessToken)
	plain := newSandbox(t)
	for _, s := range []*sdk.Sandbox{sbx, plain} {
		if _, err := s.WriteFile(ctx, "/home/user/note", []byte("kept")); err != nil {
			t.Fatal(err)
		}
	}
	var d e2bapi.SandboxDetail
	if apiCall(t, "GET", "/sandboxes/"+sbx.ID, nil, &d); d.Lifecycle == nil || !d.Lifecycle.AutoResume || d.Lifecycle.OnTimeout != "pause" {
		t.Fatalf("lifecycle: %+v", d.Lifecycle)
	}
	pause := func(id string) {
		t.Helper()
		if code := apiCall(t, "POST", "/sandboxes/"+id+"/pause", nil, nil); code != 204 {
			t.Fatalf("pause %s: %d", id, code)
		}
	}
	state := func(id string) string {
		var d e2bapi.SandboxDetail
		apiCall(t, "GET", "/sandboxes/"+id, nil, &d)
		return d.State
	}
	pause(sbx.ID)
	pause(plain.ID)

	n0 := plat.cp.AutoResumesStarted()
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		wg.Go(func() {
			if i%2 == 0 { // files: the edge holds a route from the write
				b, err := sbx.ReadFile(ctx, "/home/user/note")
				if err == nil && string(b) != "kept" {
					err = fmt.Errorf("read %q", b)
				}
				errs[i] = err
				return
			}
			var out bytes.Buffer // process: no route cached
			code, err := sbx.Run(ctx, "cat /home/user/note", sdk.RunOptions{Stdout: &out})
			if err == nil && (code != 0 || out.String() != "kept") {
				err = fmt.Errorf("run: code %d out %q", code, out.String())
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("request %d on the paused autoResume sandbox: %v", i, err)
		}
	}
	if n := plat.cp.AutoResumesStarted() - n0; n != 1 {
		t.Fatalf("%d resumes for concurrent requests, want 1", n)
	}
	if s := state(sbx.ID); s != "running" {
		t.Fatalf("state after traffic: %s", s)
	}

	// Without autoResume: the request fails and the sandbox stays paused.
	if _, err := plain.ReadFile(ctx, "/home/user/note"); err == nil {
		t.Fatal("read from a paused sandbox without autoResume succeeded")
	} else if !strings.Contains(err.Error(), "paused") {
		t.Fatalf("paused sandbox error: %v", err)
	}
	if s := state(plain.ID); s != "paused" {
		t.Fatalf("plain sandbox state: %s", s)
	}
}

// TestMicroVMMetrics: a microVM sandbox's samples come from the same
// sampler (QEMU's CPU times, the guest RAM it touched).
func TestMicroVMMetrics(t *testing.T) {
	lp := vmPlatform(t)
	sbx := newVM(t, lp)
	c := lp.client(t)
	ctx := ctxFor(t, 2*time.Minute)
	start := time.Now()
	var ms []sdk.SandboxMetric
	for deadline := time.Now().Add(60 * time.Second); len(ms) < 2; time.Sleep(2 * time.Second) {
		var err error
		if ms, err = c.GetMetrics(ctx, sbx.ID, start, time.Time{}); err != nil {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d samples of a VM after a minute", len(ms))
		}
	}
	for i, m := range ms {
		if m.CPUCount < 1 || m.MemTotal <= 0 || m.MemUsed <= 0 || m.MemUsed > m.MemTotal || (i > 0 && !m.Timestamp.After(ms[i-1].Timestamp)) {
			t.Fatalf("VM sample %d: %+v", i, m)
		}
		t.Logf("VM sample %d: cpu %.1f%% mem %d/%d MiB", i, m.CPUUsedPct, m.MemUsed>>20, m.MemTotal>>20)
	}
}
