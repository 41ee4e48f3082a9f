package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/spacesbx/space/internal/gateway"
	"github.com/spacesbx/space/sdk"
)

// ServicePortResult compares a service-port HTTP request through the edge
// and netgtw (edge -> node-api -> sbx-manager -> netgtw -> port) with a
// direct connection to the same port inside the sandbox's network
// namespace, measured interleaved in the same run.
type ServicePortResult struct {
	// Edge and Direct are per-request latencies over kept-alive client
	// connections (the guest server, python3 -m http.server, closes its
	// connection after every response, so each request opens a new guest
	// connection on both paths).
	Edge, Direct []time.Duration
	// EdgeCPS and DirectCPS are requests per second with a new client
	// connection for every request (sequential, one client).
	EdgeCPS, DirectCPS float64
	Errors             int
}

// MeasureServicePort starts `python3 -m http.server 8000` in a new sandbox
// of p and measures n interleaved request pairs, then connections per
// second over cpsFor on each path. It needs root (the direct baseline dials
// from inside the sandbox's network namespace) and netgtw next to
// spaced-host (make build).
//
// Call it from Run with a started platform, e.g.
//
//	sp, err := MeasureServicePort(ctx, p, 300, 3*time.Second)
//	rows = append(rows, sp.Rows()...)
func MeasureServicePort(ctx context.Context, p *Platform, n int, cpsFor time.Duration) (ServicePortResult, error) {
	var res ServicePortResult
	sbx, err := p.Client.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 10 * time.Minute})
	if err != nil {
		return res, fmt.Errorf("service-port bench: create: %w", err)
	}
	defer func() {
		kctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		_ = p.Client.KillSandbox(kctx, sbx.ID)
	}()
	var out bytes.Buffer
	code, err := sbx.Run(ctx, `mkdir -p /tmp/sp && cd /tmp/sp && head -c 1024 /dev/zero | tr '\0' x > index.html && `+
		`(setsid nohup python3 -m http.server 8000 >/tmp/sp.log 2>&1 </dev/null &) && `+
		`for i in $(seq 1 100); do python3 -c 'import socket; socket.create_connection(("127.0.0.1", 8000), 1).close()' 2>/dev/null && exit 0; sleep 0.1; done; cat /tmp/sp.log; exit 1`,
		sdk.RunOptions{Stdout: &out, Stderr: &out})
	if err != nil || code != 0 {
		return res, fmt.Errorf("service-port bench: start http.server: code %d err %v: %s", code, err, out.String())
	}
	_, initPID, ok := p.BridgePID(sbx.ID)
	if !ok {
		return res, fmt.Errorf("service-port bench: sandbox %s not active", sbx.ID)
	}
	_, ino, start, err := gateway.NetnsIdentity(initPID)
	if err != nil {
		return res, err
	}
	nd, err := gateway.OpenNetns(initPID, ino, start)
	if err != nil {
		return res, err
	}
	defer nd.Close()

	host := fmt.Sprintf("8000-%s.localhost", sbx.ID)
	edgeReq := func(c *http.Client) error {
		req, _ := http.NewRequestWithContext(ctx, "GET", p.SandboxURL+"/index.html", nil)
		req.Host = host
		return get(c, req)
	}
	directReq := func(c *http.Client) error {
		req, _ := http.NewRequestWithContext(ctx, "GET", "http://127.0.0.1:8000/index.html", nil)
		return get(c, req)
	}
	newEdge := func(keep bool) *http.Client {
		return &http.Client{Transport: &http.Transport{DisableKeepAlives: !keep, MaxIdleConnsPerHost: 4}}
	}
	newDirect := func(keep bool) *http.Client {
		return &http.Client{Transport: &http.Transport{DisableKeepAlives: !keep, MaxIdleConnsPerHost: 4,
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return nd.DialPort(ctx, 8000) }}}
	}
	ec, dc := newEdge(true), newDirect(true)
	defer ec.CloseIdleConnections()
	defer dc.CloseIdleConnections()
	for i := 0; i < 20; i++ { // warm-up: capability cache, keep-alive pools
		if err := edgeReq(ec); err != nil {
			return res, fmt.Errorf("service-port bench: edge warm-up: %w", err)
		}
		if err := directReq(dc); err != nil {
			return res, fmt.Errorf("service-port bench: direct warm-up: %w", err)
		}
	}
	for i := 0; i < n && ctx.Err() == nil; i++ {
		t0 := time.Now()
		if err := edgeReq(ec); err != nil {
			res.Errors++
		} else {
			res.Edge = append(res.Edge, time.Since(t0))
		}
		t0 = time.Now()
		if err := directReq(dc); err != nil {
			res.Errors++
		} else {
			res.Direct = append(res.Direct, time.Since(t0))
		}
	}
	cps := func(do func(*http.Client) error, mk func(bool) *http.Client) float64 {
		c := mk(false)
		defer c.CloseIdleConnections()
		okN := 0
		t0 := time.Now()
		for time.Since(t0) < cpsFor && ctx.Err() == nil {
			if do(c) == nil {
				okN++
			} else {
				res.Errors++
			}
		}
		return float64(okN) / time.Since(t0).Seconds()
	}
	res.EdgeCPS = cps(edgeReq, newEdge)
	res.DirectCPS = cps(directReq, newDirect)
	return res, ctx.Err()
}

func get(c *http.Client, req *http.Request) error {
	r, err := c.Do(req)
	if err != nil {
		return err
	}
	defer r.Body.Close()
	n, _ := io.Copy(io.Discard, r.Body)
	if r.StatusCode != 200 || n != 1024 {
		return fmt.Errorf("status %d, %d bytes", r.StatusCode, n)
	}
	return nil
}

// Rows renders the result for the report table, each figure beside its
// same-run baseline; the targets are issue 14's (p50 at most 1.2x direct,
// new connections at least 0.8x).
func (r ServicePortResult) Rows() []Row {
	e, d := Median(ms(r.Edge)), Median(ms(r.Direct))
	e99, d99 := Percentile(ms(r.Edge), 99), Percentile(ms(r.Direct), 99)
	return []Row{
		{Figure: "service-port HTTP p50 (edge+netgtw vs direct)", Value: fmt.Sprintf("%.3f ms", e), Baseline: fmt.Sprintf("%.3f ms", d), Ratio: ratio(e, d),
			Target: "<= 1.2x", Verdict: atMost(e/d, 1.2)},
		{Figure: "service-port HTTP p99 (edge+netgtw vs direct)", Value: fmt.Sprintf("%.3f ms", e99), Baseline: fmt.Sprintf("%.3f ms", d99), Ratio: ratio(e99, d99)},
		{Figure: "service-port new connections/s (edge+netgtw vs direct)", Value: fmt.Sprintf("%.0f/s", r.EdgeCPS), Baseline: fmt.Sprintf("%.0f/s", r.DirectCPS), Ratio: ratio(r.EdgeCPS, r.DirectCPS),
			Target: ">= 0.8x", Verdict: atLeast(r.EdgeCPS/r.DirectCPS, 0.8)},
	}
}
