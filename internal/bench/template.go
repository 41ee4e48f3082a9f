package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
)

// TemplateResult is the build time of a 3-step template (RUN, ENV, RUN)
// built from scratch and again from the cache, Rounds times each (a fresh
// template name per round, so each cold build is really cold).
type TemplateResult struct {
	Cold, Cached []time.Duration
}

// MeasureTemplateBuild builds a 3-step template through the E2B template
// API rounds times, each cold then cached.
func MeasureTemplateBuild(ctx context.Context, p *Platform, rounds int) (TemplateResult, error) {
	var res TemplateResult
	for i := range rounds {
		name := fmt.Sprintf("bench-%d-%d", time.Now().UnixNano()%1e9, i)
		steps := []e2bapi.TemplateStep{
			// The name in the command: the cache keys steps by content, so
			// each round's cold build must differ from the last.
			{Type: "RUN", Args: []string{"mkdir -p /opt/app && seq 1 10000 > /opt/app/data && echo " + name + " > /opt/app/name"}},
			{Type: "ENV", Args: []string{"APP_HOME", "/opt/app"}},
			{Type: "RUN", Args: []string{"wc -l /opt/app/data > /opt/app/count"}},
		}
		for _, cached := range []bool{false, true} {
			d, err := buildTemplate(ctx, p, name, steps)
			if err != nil {
				return res, err
			}
			if cached {
				res.Cached = append(res.Cached, d)
			} else {
				res.Cold = append(res.Cold, d)
			}
		}
	}
	return res, nil
}

// buildTemplate runs one build as the SDK does (request, start, poll) and
// returns its wall time.
func buildTemplate(ctx context.Context, p *Platform, name string, steps []e2bapi.TemplateStep) (time.Duration, error) {
	t0 := time.Now()
	var req e2bapi.TemplateRequestResponseV3
	if err := apiCall(ctx, p, "POST", "/v3/templates", e2bapi.TemplateBuildRequestV3{Name: name}, &req); err != nil {
		return 0, err
	}
	start := e2bapi.TemplateBuildStartV2{FromTemplate: "base", Steps: steps}
	if err := apiCall(ctx, p, "POST", "/v2/templates/"+req.TemplateID+"/builds/"+req.BuildID, start, nil); err != nil {
		return 0, err
	}
	for {
		var st e2bapi.TemplateBuildInfo
		if err := apiCall(ctx, p, "GET", "/templates/"+req.TemplateID+"/builds/"+req.BuildID+"/status", nil, &st); err != nil {
			return 0, err
		}
		switch st.Status {
		case e2bapi.BuildReady:
			return time.Since(t0), nil
		case e2bapi.BuildError:
			msg := ""
			if st.Reason != nil {
				msg = st.Reason.Message
			}
			return 0, fmt.Errorf("bench: template build failed: %s", msg)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func apiCall(ctx context.Context, p *Platform, method, path string, in, out any) error {
	var body bytes.Buffer
	if in != nil {
		if err := json.NewEncoder(&body).Encode(in); err != nil {
			return err
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, p.APIURL+path, &body)
	if err != nil {
		return err
	}
	req.Header.Set("X-API-Key", p.APIKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		var e e2bapi.Error
		json.NewDecoder(resp.Body).Decode(&e)
		return fmt.Errorf("bench: %s %s: %d %s", method, path, resp.StatusCode, e.Message)
	}
	if out != nil {
		return json.NewDecoder(resp.Body).Decode(out)
	}
	return nil
}

// Rows reports the medians, cached against cold.
func (r TemplateResult) Rows() []Row {
	c, w := Median(ms(r.Cached)), Median(ms(r.Cold))
	return []Row{
		{Figure: fmt.Sprintf("template build, 3 steps, cached vs cold (median of %d)", len(r.Cold)), Value: fmt.Sprintf("%.0f ms", c), Baseline: fmt.Sprintf("%.0f ms", w), Ratio: ratio(c, w)},
	}
}

// runTemplateOnly measures only template builds (-only template).
func runTemplateOnly(ctx context.Context, cfg Config, out io.Writer, progress func(string, ...any), t0 time.Time) error {
	root, err := os.MkdirTemp("", "space-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	progress("starting a platform")
	p, err := StartPlatform(ctx, cfg.BinDir, platformDir(root, "tpl"), 1, false, discardLogger(cfg.Log))
	if err != nil {
		return err
	}
	defer p.Close()
	progress("template builds: 3 rounds, cold then cached")
	res, err := MeasureTemplateBuild(ctx, p, 3)
	progress("done in %s", time.Since(t0).Round(time.Second))
	if err != nil {
		return err
	}
	fmt.Fprintln(out)
	return WriteTable(out, res.Rows())
}
