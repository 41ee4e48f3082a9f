package bench

// -only tracing: what tracing costs on the request path. One platform, the
// same 4 KiB read through edge -> node-api -> sbx-manager -> spaced-host ->
// guest, alternating tracing off (the default: no provider) and on (every
// request sampled and recorded by the SDK, no exporter) per read. The
// in-process hops (edge, node-api, sbx-manager, control plane) are what it
// toggles: spaced-host traces only when given an OTLP endpoint, so the
// guest's span report is not in either side.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spacesbx/space/internal/telemetry"
)

// TracingResult is the read latency with tracing off and on.
type TracingResult struct {
	Off, On     []time.Duration
	RoundRatios []float64
}

// MeasureTracing reads through p warmup times, then rounds of perRound
// off/on pairs (alternating which goes first).
func MeasureTracing(ctx context.Context, p *Platform, warmup, rounds, perRound int) (TracingResult, error) {
	var res TracingResult
	s, err := prepareRead(ctx, p)
	if err != nil {
		return res, err
	}
	defer s.sbx.Kill(context.WithoutCancel(ctx))
	var buf bytes.Buffer
	set := func(on bool) (*telemetry.Provider, error) {
		if !on {
			return nil, nil
		}
		return telemetry.Setup(ctx, telemetry.Config{Record: true, ServiceName: "space-bench"})
	}
	for range warmup {
		if _, err := s.read(ctx, &buf); err != nil {
			return res, err
		}
	}
	for r := range rounds {
		var rOn, rOff []time.Duration
		for i := range perRound {
			order := [2]bool{true, false}
			if (r+i)%2 == 1 {
				order = [2]bool{false, true}
			}
			for _, on := range order {
				tp, err := set(on)
				if err != nil {
					return res, err
				}
				d, err := s.read(ctx, &buf)
				tp.Shutdown(context.Background())
				if err != nil {
					return res, fmt.Errorf("read (tracing on=%v): %w", on, err)
				}
				if on {
					rOn = append(rOn, d)
				} else {
					rOff = append(rOff, d)
				}
			}
		}
		res.On, res.Off = append(res.On, rOn...), append(res.Off, rOff...)
		res.RoundRatios = append(res.RoundRatios, Median(ms(rOn))/Median(ms(rOff)))
	}
	return res, nil
}

func runTracingOnly(ctx context.Context, cfg Config, out io.Writer, progress func(string, ...any), t0 time.Time) error {
	root, err := os.MkdirTemp("", "space-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	progress("starting a platform")
	p, err := StartPlatform(ctx, cfg.BinDir, platformDir(root, "tracing"), 1, false, discardLogger(cfg.Log))
	if err != nil {
		return err
	}
	defer p.Close()
	progress("4 KiB read: %d warm-up + %d rounds x %d off/on pairs", cfg.ReadWarmup, cfg.ReadRounds, cfg.ReadPerRound)
	res, err := MeasureTracing(ctx, p, cfg.ReadWarmup, cfg.ReadRounds, cfg.ReadPerRound)
	if err != nil {
		return err
	}
	off, on := ms(res.Off), ms(res.On)
	fmt.Fprintf(out, "tracing on the request path (4 KiB read, %d reads each side, %.0fs)\n", len(off), time.Since(t0).Seconds())
	fmt.Fprintf(out, "  off: p50 %.3f ms  p90 %.3f ms\n", Median(off), Percentile(off, 90))
	fmt.Fprintf(out, "  on:  p50 %.3f ms  p90 %.3f ms (recorded, no exporter)\n", Median(on), Percentile(on, 90))
	fmt.Fprintf(out, "  on/off p50 ratio %.3f (per-round ratios: median %.3f, min %.3f, max %.3f)\n",
		Median(on)/Median(off), Median(res.RoundRatios), Percentile(res.RoundRatios, 0), Percentile(res.RoundRatios, 100))
	return nil
}
