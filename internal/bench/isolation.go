package bench

// The cost of the ns substrate's isolation added for hostile workloads:
// user namespaces (each sandbox its own host uid range, idmapped mounts)
// and the layer disk (a disk quota per sandbox). Bare substrates, so the
// figures are the substrate's own and not diluted by the control plane:
// three at once in one process, started in turn, sample by sample, so
// the machine's noise falls on all alike.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/spacesbx/space/internal/node"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/substrate/ns"
	"github.com/spacesbx/space/internal/up"
)

// Isolation modes measured against each other.
const (
	IsoAll    = iota // user namespace + disk quota (the default)
	IsoNoUser        // disk quota, no user namespace
	IsoNone          // neither (the substrate before them)
	isoModes
)

var isoNames = [isoModes]string{"userns+quota", "quota only", "neither"}

// IsolationResult holds, per mode, raw start latencies and the memory of
// idle sandboxes (the agent's PSS plus its cgroup's charge, kernel
// memory included); and through the control plane, creates and the PSS
// of spaced-host and agent per sandbox on two platforms, user namespaces
// on and off (both with the disk quota).
type IsolationResult struct {
	Start  [isoModes][]time.Duration
	MemPSS [isoModes][]int64
	MemCg  [isoModes][]int64
	// Platform figures: index 0 user namespaces on, 1 off.
	Create [2][]time.Duration
	PSS    [2][]int64
}

// measurePlatformUserNS starts two one-worker platforms, user namespaces
// on and off, creates n sandboxes on each in turn (each killed right
// after, untimed), then holds idle sandboxes on each for their memory.
func measurePlatformUserNS(ctx context.Context, root, binDir string, log *slog.Logger, n, idle int, settle time.Duration, res *IsolationResult) error {
	var plats [2]*Platform
	defer func() {
		for _, p := range plats {
			if p != nil {
				p.Close()
			}
		}
	}()
	for i := range plats {
		p, err := StartPlatformConfig(ctx, up.Config{DataDir: filepath.Join(root, fmt.Sprintf("plat%d", i)), Workers: 1, BinDir: binDir,
			Logger: log, NSNoUserNamespaces: i == 1})
		if err != nil {
			return err
		}
		plats[i] = p
	}
	for i := 0; i < n+2; i++ { // two warm-up rounds
		for k := range plats {
			m := (i + k) % 2
			r, err := MeasureCreate(ctx, plats[m], nil, 0, 1, 0)
			if err != nil {
				return err
			}
			if i >= 2 {
				res.Create[m] = append(res.Create[m], r.Create...)
			}
		}
	}
	for m, p := range plats {
		mr, err := MeasureMemory(ctx, p, idle, settle)
		if err != nil {
			return err
		}
		for _, s := range mr.Sum {
			res.PSS[m] = append(res.PSS[m], s.PSS<<10)
		}
	}
	return nil
}

// MeasureIsolation starts n sandboxes per mode in turn (each stopped
// right away), then keeps idle sandboxes per mode for the memory
// figures, settled for settle.
func MeasureIsolation(ctx context.Context, root, binDir string, log *slog.Logger, n, idle int, settle time.Duration) (IsolationResult, error) {
	var res IsolationResult
	var subs [isoModes]*RawSubstrate
	defer func() {
		for _, s := range subs {
			if s != nil {
				s.Close()
			}
		}
	}()
	for m := range isoModes {
		cfg := ns.Config{StateDir: filepath.Join(root, fmt.Sprintf("iso%d", m), "state"), CgroupParent: "space-bench",
			InitPath: node.NSInitPath(binDir), Logger: log,
			NoUserNamespaces: m != IsoAll, NoDiskQuota: m == IsoNone}
		sub, err := ns.New(cfg)
		if err != nil {
			return res, err
		}
		subs[m] = &RawSubstrate{sub: sub, dir: filepath.Join(root, fmt.Sprintf("iso%d", m)), agent: filepath.Join(binDir, "spaced-guest")}
	}
	// A warm-up start each (templates, golden disk images).
	for _, s := range subs {
		if _, err := s.StartStop(ctx); err != nil {
			return res, err
		}
	}
	for i := 0; i < n; i++ {
		for k := range isoModes {
			m := (i + k) % isoModes // rotate who goes first
			d, err := subs[m].StartStop(ctx)
			if err != nil {
				return res, fmt.Errorf("%s: %w", isoNames[m], err)
			}
			res.Start[m] = append(res.Start[m], d)
		}
	}
	// Through the control plane too, before the idle raw sandboxes exist.
	if err := measurePlatformUserNS(ctx, root, binDir, log, n, idle, settle, &res); err != nil {
		return res, fmt.Errorf("platforms with user namespaces on and off: %w", err)
	}
	var running []substrate.Instance
	defer func() {
		for _, inst := range running {
			_ = stopRaw(ctx, inst)
		}
	}()
	mode := map[substrate.Instance]int{}
	for i := 0; i < idle; i++ {
		for m := range isoModes {
			_, inst, err := subs[m].start(ctx)
			if err != nil {
				return res, fmt.Errorf("%s: %w", isoNames[m], err)
			}
			running = append(running, inst)
			mode[inst] = m
		}
	}
	select {
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(settle):
	}
	var errs []error
	for _, inst := range running {
		m := mode[inst]
		pm, err := ReadProcMem(inst.InitPID())
		if err != nil {
			errs = append(errs, err)
			continue
		}
		st, err := inst.(substrate.StatsReporter).Stats(ctx)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		res.MemPSS[m] = append(res.MemPSS[m], pm.PSS<<10)
		res.MemCg[m] = append(res.MemCg[m], st.MemUsed)
	}
	return res, errors.Join(errs...)
}

func int64s(xs []int64) []float64 {
	out := make([]float64, len(xs))
	for i, x := range xs {
		out[i] = float64(x)
	}
	return out
}

// isolationRows: user namespaces judged against none (at most 10% worse
// on create p50 and memory per sandbox), the whole of it against neither.
func (r IsolationResult) rows() []Row {
	p50 := func(m int) float64 { return Median(ms(r.Start[m])) }
	mem := func(m int) float64 { return Median(int64s(r.MemPSS[m])) + Median(int64s(r.MemCg[m])) }
	n := len(r.Start[IsoAll])
	rows := []Row{}
	if c := len(r.Create[0]); c > 0 {
		on, off := Median(ms(r.Create[0])), Median(ms(r.Create[1]))
		pon, poff := Median(int64s(r.PSS[0])), Median(int64s(r.PSS[1]))
		rows = append(rows,
			Row{fmt.Sprintf("sandbox create p50, user namespaces on, n=%d (ms)", c), fmt.Sprintf("%.1f", on), fmt.Sprintf("%.1f off", off),
				ratio(on, off), "on/off <= 1.10", atMost(on/off, 1.10)},
			Row{fmt.Sprintf("memory/sandbox PSS host+agent, user namespaces on, n=%d (MiB)", len(r.PSS[0])), fmt.Sprintf("%.2f", pon/(1<<20)),
				fmt.Sprintf("%.2f off", poff/(1<<20)), ratio(pon, poff), "on/off <= 1.10", atMost(pon/poff, 1.10)})
	}
	return append(rows, []Row{
		{fmt.Sprintf("ns start p50, user namespaces on, n=%d (ms)", n), fmt.Sprintf("%.1f", p50(IsoAll)), fmt.Sprintf("%.1f off", p50(IsoNoUser)),
			ratio(p50(IsoAll), p50(IsoNoUser)), "on/off <= 1.10", atMost(p50(IsoAll)/p50(IsoNoUser), 1.10)},
		{fmt.Sprintf("ns start p50, userns + disk quota, n=%d (ms)", n), fmt.Sprintf("%.1f", p50(IsoAll)), fmt.Sprintf("%.1f neither", p50(IsoNone)),
			ratio(p50(IsoAll), p50(IsoNone)), "", NotJudged},
		{fmt.Sprintf("memory/idle sandbox, agent PSS + cgroup, userns on, n=%d (MiB)", len(r.MemPSS[IsoAll])), fmt.Sprintf("%.2f", mem(IsoAll)/(1<<20)),
			fmt.Sprintf("%.2f off", mem(IsoNoUser)/(1<<20)), ratio(mem(IsoAll), mem(IsoNoUser)), "on/off <= 1.10", atMost(mem(IsoAll)/mem(IsoNoUser), 1.10)},
		{fmt.Sprintf("memory/idle sandbox, userns + disk quota, n=%d (MiB)", len(r.MemPSS[IsoAll])), fmt.Sprintf("%.2f", mem(IsoAll)/(1<<20)),
			fmt.Sprintf("%.2f neither", mem(IsoNone)/(1<<20)), ratio(mem(IsoAll), mem(IsoNone)), "", NotJudged},
	}...)
}
