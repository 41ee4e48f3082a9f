package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/spacesbx/space/internal/netsim"
	"github.com/spacesbx/space/internal/node"
	"github.com/spacesbx/space/internal/up"
	"github.com/spacesbx/space/sdk"
)

// EgressResult is the same client (internal/bench/netprobe) run inside a
// sandbox, whose connections go through its link, the nftables redirect
// and the worker's egress proxy, and on the host, both against the same
// simulated-internet server (package netsim), alternating round by round.
type EgressResult struct {
	Rounds int
	// Connect: a new TCP connection and a 1-byte echo, sequential (p50 µs
	// and connections per second per round).
	ConnectIn, ConnectHost       []float64
	ConnectCPSIn, ConnectCPSHost []float64
	// HTTP: a GET on a new connection each time (p50 µs per round).
	HTTPIn, HTTPHost []float64
	// Read: bytes/s read from a chargen source for ReadFor.
	ReadIn, ReadHost []float64
	Errors           int
}

// netprobeResult is netprobe's JSON line.
type netprobeResult struct {
	P50us       float64 `json:"p50_us"`
	PerSec      float64 `json:"per_sec"`
	BytesPerSec float64 `json:"bytes_per_sec"`
	Errors      int     `json:"errors"`
}

// MeasureEgress starts a simulated internet and a one-worker platform
// whose sandboxes reach it, and compares netprobe in a sandbox with
// netprobe on the host.
func MeasureEgress(ctx context.Context, binDir, dir string, rounds int, log *slog.Logger) (EgressResult, error) {
	res := EgressResult{Rounds: rounds}
	inet, err := netsim.Start(netsim.Options{Hosts: 1})
	if err != nil {
		return res, fmt.Errorf("egress bench: simulated internet: %w", err)
	}
	defer inet.Close()
	p, err := StartPlatformConfig(ctx, up.Config{DataDir: dir, Workers: 1, BinDir: binDir, Logger: log,
		Egress: node.EgressConfig{Mode: node.EgressDeny, Upstreams: []netip.AddrPort{inet.DNS()}}})
	if err != nil {
		return res, fmt.Errorf("egress bench: platform: %w", err)
	}
	defer p.Close()
	probe := filepath.Join(dir, "netprobe")
	build := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", probe, "github.com/spacesbx/space/internal/bench/netprobe")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return res, fmt.Errorf("egress bench: build netprobe: %v: %s", err, bytes.TrimSpace(out))
	}
	bin, err := os.ReadFile(probe)
	if err != nil {
		return res, err
	}
	open := true
	sbx, err := p.Client.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 30 * time.Minute, AllowInternetAccess: &open})
	if err != nil {
		return res, fmt.Errorf("egress bench: create: %w", err)
	}
	defer sbx.Kill(context.WithoutCancel(ctx))
	if _, err := sbx.WriteFile(ctx, "/tmp/netprobe", bin); err != nil {
		return res, fmt.Errorf("egress bench: upload netprobe: %w", err)
	}
	if code, err := sbx.Exec(ctx, []string{"chmod", "755", "/tmp/netprobe"}, sdk.RunOptions{User: "root"}); err != nil || code != 0 {
		return res, fmt.Errorf("egress bench: chmod netprobe: %d %v", code, err)
	}
	h := inet.Host(0).String()
	in := func(args ...string) (netprobeResult, error) {
		var out bytes.Buffer
		code, err := sbx.Exec(ctx, append([]string{"/tmp/netprobe"}, args...), sdk.RunOptions{User: "user", Stdout: &out})
		if err != nil || code != 0 {
			return netprobeResult{}, fmt.Errorf("netprobe %v in the sandbox: %d %v", args, code, err)
		}
		var r netprobeResult
		return r, json.Unmarshal(out.Bytes(), &r)
	}
	host := func(args ...string) (netprobeResult, error) {
		out, err := exec.CommandContext(ctx, probe, args...).Output()
		if err != nil {
			return netprobeResult{}, fmt.Errorf("netprobe %v on the host: %v", args, err)
		}
		var r netprobeResult
		return r, json.Unmarshal(out, &r)
	}
	connect := []string{"connect", "-addr", h + ":7", "-n", "300"}
	httpArgs := []string{"http", "-url", "http://" + h + "/", "-n", "200"}
	read := []string{"read", "-addr", h + ":19", "-seconds", "2"}
	// Warm-up: the proxy's and the host's first connections.
	if _, err := in(connect[0], connect[1], connect[2], "-n", "20"); err != nil {
		return res, err
	}
	for i := 0; i < rounds && ctx.Err() == nil; i++ {
		for _, side := range []struct {
			run                     func(...string) (netprobeResult, error)
			conn, cps, httpP, reads *[]float64
		}{
			{in, &res.ConnectIn, &res.ConnectCPSIn, &res.HTTPIn, &res.ReadIn},
			{host, &res.ConnectHost, &res.ConnectCPSHost, &res.HTTPHost, &res.ReadHost},
		} {
			c, err := side.run(connect...)
			if err != nil {
				return res, err
			}
			hr, err := side.run(httpArgs...)
			if err != nil {
				return res, err
			}
			rr, err := side.run(read...)
			if err != nil {
				return res, err
			}
			res.Errors += c.Errors + hr.Errors + rr.Errors
			*side.conn, *side.cps = append(*side.conn, c.P50us), append(*side.cps, c.PerSec)
			*side.httpP, *side.reads = append(*side.httpP, hr.P50us), append(*side.reads, rr.BytesPerSec)
		}
	}
	return res, ctx.Err()
}

// Rows renders the result: medians over rounds, each beside the host's.
func (r EgressResult) Rows() []Row {
	ci, ch := Median(r.ConnectIn), Median(r.ConnectHost)
	added := (ci - ch) / 1000
	ri, rh := Median(r.ReadIn), Median(r.ReadHost)
	hi, hh := Median(r.HTTPIn), Median(r.HTTPHost)
	pi, ph := Median(r.ConnectCPSIn), Median(r.ConnectCPSHost)
	return []Row{
		{Figure: "egress TCP connect+echo p50 (sandbox via proxy vs host)", Value: fmt.Sprintf("%.0f µs", ci), Baseline: fmt.Sprintf("%.0f µs", ch), Ratio: ratio(ci, ch),
			Target: "added < 1 ms", Verdict: atMost(added, 1)},
		{Figure: "egress TCP added latency p50 (ms)", Value: fmt.Sprintf("%.3f", added), Baseline: "0", Target: "< 1 ms", Verdict: atMost(added, 1)},
		{Figure: "egress new connections/s (sandbox vs host)", Value: fmt.Sprintf("%.0f/s", pi), Baseline: fmt.Sprintf("%.0f/s", ph), Ratio: ratio(pi, ph)},
		{Figure: "egress HTTP GET new-connection p50 (sandbox vs host)", Value: fmt.Sprintf("%.0f µs", hi), Baseline: fmt.Sprintf("%.0f µs", hh), Ratio: ratio(hi, hh)},
		{Figure: "egress TCP throughput (sandbox vs host)", Value: fmt.Sprintf("%.0f MB/s", ri/1e6), Baseline: fmt.Sprintf("%.0f MB/s", rh/1e6), Ratio: ratio(ri, rh),
			Target: ">= 0.8x", Verdict: atLeast(ri/rh, 0.8)},
	}
}
