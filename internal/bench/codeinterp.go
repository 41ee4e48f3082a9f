package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/spacesbx/space/internal/codeinterp"
	"github.com/spacesbx/space/sdk"
)

// CodeInterpResult is the code interpreter seen as @e2b/code-interpreter
// sees it: runCode('1+1') (POST /execute to port 49999 through the edge,
// read to its end) on a warm sandbox beside commands.run('python3 -c 1')
// on the same sandbox in the same run, and the time from a create of
// code-interpreter-v1 to the first result of its first runCode.
type CodeInterpResult struct {
	RunCode, Command []time.Duration
	// FirstResult: create request to the first result line (or, from a
	// server that sends none, the end of the response) of the first
	// runCode('1+1'), Creates times.
	FirstResult []time.Duration
	// Template is what was measured (code-interpreter-v1).
	Template string
	// Errors counts measured runCode calls that failed (a broken stream
	// or a 5xx); they are left out of RunCode.
	Errors int
}

// MeasureCodeInterp creates creates sandboxes of template (each timed to
// its first result), then measures n interleaved runCode('1+1') and
// commands.run('python3 -c 1') pairs on the last one.
func MeasureCodeInterp(ctx context.Context, p *Platform, template string, creates, n int) (CodeInterpResult, error) {
	res := CodeInterpResult{Template: template}
	hc := &http.Client{Timeout: 2 * time.Minute}
	defer hc.CloseIdleConnections()
	var sbx *sdk.Sandbox
	kill := func(s *sdk.Sandbox) {
		kctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		_ = p.Client.KillSandbox(kctx, s.ID)
	}
	for i := 0; i < max(creates, 1); i++ {
		t0 := time.Now()
		s, err := p.Client.CreateSandbox(ctx, sdk.CreateOptions{Template: template, Timeout: 10 * time.Minute})
		if err != nil {
			return res, fmt.Errorf("code interpreter bench: create %s: %w", template, err)
		}
		if sbx != nil {
			kill(sbx)
		}
		sbx = s
		if _, err := runCode(ctx, hc, p.SandboxURL, s, "1+1"); err != nil {
			kill(s)
			return res, fmt.Errorf("code interpreter bench: first runCode: %w", err)
		}
		res.FirstResult = append(res.FirstResult, time.Since(t0))
	}
	defer kill(sbx)
	for range 5 { // warm-up: the edge's capability cache, keep-alive pools
		_, _ = runCode(ctx, hc, p.SandboxURL, sbx, "1+1")
	}
	for i := 0; i < n && ctx.Err() == nil; i++ {
		t0 := time.Now()
		if _, err := runCode(ctx, hc, p.SandboxURL, sbx, "1+1"); err != nil {
			res.Errors++
			if res.Errors > n/10 {
				return res, fmt.Errorf("code interpreter bench: %d of %d runCode calls failed, the last: %w", res.Errors, i+1, err)
			}
		} else {
			res.RunCode = append(res.RunCode, time.Since(t0))
		}
		t0 = time.Now()
		code, err := sbx.Run(ctx, "python3 -c 1", sdk.RunOptions{})
		if err != nil || code != 0 {
			return res, fmt.Errorf("code interpreter bench: commands.run: code %d: %v", code, err)
		}
		res.Command = append(res.Command, time.Since(t0))
	}
	return res, nil
}

// runCode is the SDK's runCode: POST /execute to the sandbox's port 49999
// through the edge (E2B_SANDBOX_URL with the sandbox and port headers),
// the NDJSON body read to its end. It returns when the first result line
// came (0 when none did).
func runCode(ctx context.Context, hc *http.Client, sandboxURL string, sbx *sdk.Sandbox, code string) (time.Duration, error) {
	t0 := time.Now()
	body, _ := json.Marshal(map[string]string{"code": code})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, sandboxURL+"/execute", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("E2b-Sandbox-Id", sbx.ID)
	req.Header.Set("E2b-Sandbox-Port", strconv.Itoa(codeinterp.Port))
	if sbx.AccessToken != "" {
		req.Header.Set(sdk.HeaderAccessToken, sbx.AccessToken)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, fmt.Errorf("runCode: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return 0, fmt.Errorf("runCode: %s: %s", resp.Status, b)
	}
	var first time.Duration
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		var m struct {
			Type string `json:"type"`
		}
		if json.Unmarshal(sc.Bytes(), &m) == nil && m.Type == "result" && first == 0 {
			first = time.Since(t0)
		}
	}
	return first, sc.Err()
}

// Rows are the code interpreter's figures.
func (r CodeInterpResult) Rows() []Row {
	rc, cmd := Median(ms(r.RunCode)), Median(ms(r.Command))
	first := Median(ms(r.FirstResult))
	return []Row{
		{Figure: fmt.Sprintf("runCode('1+1') p50, warm %s (vs commands.run('python3 -c 1'); %d of %d failed)", r.Template, r.Errors, r.Errors+len(r.RunCode)), Value: fmt.Sprintf("%.1f ms", rc), Baseline: fmt.Sprintf("%.1f ms", cmd), Ratio: ratio(rc, cmd)},
		{Figure: fmt.Sprintf("create %s to the first runCode result (median of %d; vs the same commands.run)", r.Template, len(r.FirstResult)), Value: fmt.Sprintf("%.0f ms", first), Baseline: fmt.Sprintf("%.1f ms", cmd), Ratio: ratio(first, cmd)},
	}
}

// runCodeInterpOnly measures only the code interpreter (-only codeinterp)
// on a platform of its own.
func runCodeInterpOnly(ctx context.Context, cfg Config, out io.Writer, progress func(string, ...any), t0 time.Time) error {
	root, err := os.MkdirTemp("", "space-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	progress("starting a platform")
	p, err := StartPlatform(ctx, cfg.BinDir, platformDir(root, "ci"), 1, false, discardLogger(cfg.Log))
	if err != nil {
		return err
	}
	defer p.Close()
	progress("code interpreter: 3 creates to the first result, then 100 runCode('1+1') / commands.run('python3 -c 1') pairs")
	res, err := MeasureCodeInterp(ctx, p, "code-interpreter-v1", 3, 100)
	progress("done in %s", time.Since(t0).Round(time.Second))
	if err != nil {
		return err
	}
	fmt.Fprintln(out)
	return WriteTable(out, res.Rows())
}
