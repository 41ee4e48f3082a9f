package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/spacesbx/space/sdk"
)

// LifecycleResult holds pause, same-worker resume and cross-worker resume
// (migrate) latencies; Migrate is keyed by the writable layer's size in MiB.
type LifecycleResult struct {
	Pause, Resume []time.Duration
	Migrate       map[int][]time.Duration
}

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
	return res, nil
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
	return rows
}
