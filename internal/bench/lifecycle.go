package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/sdk"
)

// LifecycleResult holds pause, same-worker resume and cross-worker resume
// (migrate) latencies; Migrate is keyed by the writable layer's size in MiB.
type LifecycleResult struct {
	Pause, Resume []time.Duration
	Migrate       map[int][]time.Duration
	// Recover is from killing a sandbox's init (its processes die, as in
	// an agent crash) until a file read through the edge succeeds again
	// (the worker reports the execution lost, the control plane recovers
	// it as a new execution); Create are plain creates of the same run,
	// one before each recovery.
	Recover, Create []time.Duration
}

// recoveries is how many sandboxes MeasureLifecycle kills and times the
// recovery of.
const recoveries = 5

// lifecycleCall POSTs body to the control plane and times it until the
// answer arrives (the operation is complete when the API answers).
func lifecycleCall(ctx context.Context, p *Platform, path, body string) (time.Duration, error) {
	return lifecycleCallOut(ctx, p, path, body, nil)
}

// lifecycleCallOut is lifecycleCall that decodes the JSON answer into out
// (unless out is nil); decoding is not timed.
func lifecycleCallOut(ctx context.Context, p *Platform, path, body string, out any) (time.Duration, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.APIURL+path, strings.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("X-API-Key", p.APIKey)
	req.Header.Set("Content-Type", "application/json")
	t := time.Now()
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	d := time.Since(t)
	if res.StatusCode >= 300 {
		return 0, fmt.Errorf("%s: %d %s", path, res.StatusCode, bytes.TrimSpace(b))
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			return 0, fmt.Errorf("%s: answer: %w", path, err)
		}
	}
	return d, nil
}

// MeasureLifecycle measures, on a platform with at least two workers:
// pause and same-worker resume (connect) of a running sandbox, rounds
// times; and cross-worker resume by migrate with a writable layer of each
// size in layersMiB, moves times each (the sandbox alternates workers).
func MeasureLifecycle(ctx context.Context, p *Platform, rounds, moves int, layersMiB []int) (LifecycleResult, error) {
	res := LifecycleResult{Migrate: map[int][]time.Duration{}}
	sbx, err := p.Client.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 30 * time.Minute})
	if err != nil {
		return res, fmt.Errorf("create: %w", err)
	}
	defer p.Client.KillSandbox(context.Background(), sbx.ID)
	for range rounds {
		d, err := lifecycleCall(ctx, p, "/sandboxes/"+sbx.ID+"/pause", "")
		if err != nil {
			return res, err
		}
		res.Pause = append(res.Pause, d)
		d, err = lifecycleCall(ctx, p, "/v2/sandboxes/"+sbx.ID+"/connect", `{"timeout":1800}`)
		if err != nil {
			return res, err
		}
		res.Resume = append(res.Resume, d)
	}
	for _, mib := range layersMiB {
		// Grow the writable layer to the wanted size (incompressible data).
		cmd := fmt.Sprintf("rm -f /home/user/layer.bin; head -c %dM /dev/urandom > /home/user/layer.bin && sync", mib)
		if code, err := sbx.Run(ctx, cmd, sdk.RunOptions{}); err != nil || code != 0 {
			return res, fmt.Errorf("fill layer %d MiB: exit %d: %v", mib, code, err)
		}
		for range moves {
			d, err := lifecycleCall(ctx, p, "/space/v1/sandboxes/"+sbx.ID+"/migrate", "{}")
			if err != nil {
				return res, err
			}
			res.Migrate[mib] = append(res.Migrate[mib], d)
		}
	}
	for range recoveries {
		c, r, err := measureRecovery(ctx, p)
		if err != nil {
			return res, fmt.Errorf("recovery: %w", err)
		}
		res.Create, res.Recover = append(res.Create, c), append(res.Recover, r)
	}
	return res, nil
}

// measureRecovery creates a sandbox (timed), writes a file, kills its init
// from the host and times until the file reads again.
func measureRecovery(ctx context.Context, p *Platform) (create, recovery time.Duration, err error) {
	t0 := time.Now()
	sbx, err := p.Client.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 30 * time.Minute})
	if err != nil {
		return 0, 0, err
	}
	create = time.Since(t0)
	defer p.Client.KillSandbox(context.Background(), sbx.ID)
	if _, err := sbx.WriteFile(ctx, "/home/user/kept", []byte("kept")); err != nil {
		return 0, 0, err
	}
	route, err := currentRoute(ctx, p, sbx.ID)
	if err != nil {
		return 0, 0, err
	}
	pid, err := AgentPID(route)
	if err != nil {
		return 0, 0, err
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return 0, 0, fmt.Errorf("kill init %d: %w", pid, err)
	}
	t1 := time.Now()
	for deadline := t1.Add(60 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		b, err := sbx.ReadFile(ctx, "/home/user/kept")
		if err == nil && string(b) == "kept" {
			return create, time.Since(t1), nil
		}
		if time.Now().After(deadline) {
			return 0, 0, fmt.Errorf("sandbox %s not served 60s after its init died: %v", sbx.ID, err)
		}
	}
}

// currentRoute is the route of sandbox id's running execution.
func currentRoute(ctx context.Context, p *Platform, id string) (identity.Route, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.APIURL+"/space/v1/sandboxes/"+id+"/executions", nil)
	if err != nil {
		return identity.Route{}, err
	}
	req.Header.Set("X-API-Key", p.APIKey)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return identity.Route{}, err
	}
	defer res.Body.Close()
	var execs []spacev1.Execution
	if err := json.NewDecoder(res.Body).Decode(&execs); err != nil {
		return identity.Route{}, err
	}
	for _, e := range execs {
		if e.State == "running" {
			return e.Route, nil
		}
	}
	return identity.Route{}, fmt.Errorf("sandbox %s has no running execution", id)
}

// AgentPID is the host pid of route's sandbox init (ns substrate): the one
// process of its agent cgroup.
func AgentPID(r identity.Route) (int, error) {
	name := "agent." + r.SandboxID + "-" + r.ActivationID
	// Under a worker's parent (space/<worker>/) or a flat one (space/).
	var pats []string
	for _, depth := range []string{"*/*/", "*/"} {
		pats = append(pats, "/sys/fs/cgroup/pids/"+depth+name, "/sys/fs/cgroup/unified/"+depth+name, "/sys/fs/cgroup/"+depth+name)
	}
	for _, pat := range pats {
		dirs, _ := filepath.Glob(pat)
		for _, d := range dirs {
			b, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			if err != nil {
				continue
			}
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil {
					return pid, nil
				}
			}
		}
	}
	return 0, fmt.Errorf("no agent cgroup %s", name)
}

// Rows renders the lifecycle figures.
func (r LifecycleResult) Rows(layersMiB []int) []Row {
	pa, re := ms(r.Pause), ms(r.Resume)
	rows := []Row{
		{fmt.Sprintf("pause p50, n=%d (ms)", len(pa)), fmt.Sprintf("%.1f", Median(pa)), fmt.Sprintf("%.1f resume p50", Median(re)), ratio(Median(pa), Median(re)), "", NotJudged},
		{fmt.Sprintf("same-worker resume p50, n=%d (ms)", len(re)), fmt.Sprintf("%.1f", Median(re)), fmt.Sprintf("%.1f p99", Percentile(re, 99)), "", "", NotJudged},
	}
	var small []float64
	for i, mib := range layersMiB {
		m := ms(r.Migrate[mib])
		base, rt := fmt.Sprintf("%.1f p99", Percentile(m, 99)), ""
		if i == 0 {
			small = m
		} else {
			base = fmt.Sprintf("%.1f at %d MiB", Median(small), layersMiB[0])
			rt = ratio(Median(m), Median(small))
		}
		rows = append(rows, Row{fmt.Sprintf("cross-worker resume p50, %d MiB layer, n=%d (ms)", mib, len(m)),
			fmt.Sprintf("%.1f", Median(m)), base, rt, "", NotJudged})
		rows = append(rows, Row{fmt.Sprintf("cross-worker resume p99, %d MiB layer (ms)", mib),
			fmt.Sprintf("%.1f", Percentile(m, 99)), "", "", "", NotJudged})
	}
	return append(rows, r.recoveryRows()...)
}

// recoveryRows renders the recovery figure beside the creates of its run.
func (r LifecycleResult) recoveryRows() []Row {
	rc, cr := ms(r.Recover), ms(r.Create)
	if len(rc) == 0 {
		return nil
	}
	return []Row{{fmt.Sprintf("recovery after the sandbox's init died p50, n=%d (ms)", len(rc)),
		fmt.Sprintf("%.1f", Median(rc)), fmt.Sprintf("%.1f create p50", Median(cr)), ratio(Median(rc), Median(cr)), "", NotJudged}}
}
