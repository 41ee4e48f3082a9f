package bench

// The report: each figure as a row beside its baseline, and the notes
// that say how it was measured.

import (
	"fmt"
	"os"
	"runtime"
	"strings"
)

// Rows renders the report as table rows.
func (r *Report) Rows() []Row {
	var rows []Row
	fail := func(fig string, err error) { rows = append(rows, Row{Figure: fig, Value: "error: " + errString(err)}) }

	if r.CapErr != nil {
		fail("capability verify", r.CapErr)
	} else {
		c := r.Cap
		base := fmt.Sprintf("%.2f µs raw ed25519", c.RawEd25519US)
		rows = append(rows,
			Row{"capability verify cached (µs/op)", fmt.Sprintf("%.2f", c.CachedUS), base, ratio(c.CachedUS, c.RawEd25519US), "<= 2 µs", atMost(c.CachedUS, 2)},
			Row{"capability verify cold (µs/op)", fmt.Sprintf("%.1f", c.ColdUS), base, ratio(c.ColdUS, c.RawEd25519US), "<= 60 µs *", atMost(c.ColdUS, 60)},
		)
	}

	if r.ReadErr != nil {
		fail("4 KiB read on/off", r.ReadErr)
	} else {
		on, off := ms(r.Read.On), ms(r.Read.Off)
		mOn, mOff := Median(on), Median(off)
		pOn, pOff := Percentile(on, 99), Percentile(off, 99)
		rows = append(rows,
			Row{"4 KiB read, checks on, median (ms)", fmt.Sprintf("%.3f", mOn), fmt.Sprintf("%.3f checks off", mOff), ratio(mOn, mOff), "on/off <= 1.10", atMost(mOn/mOff, 1.10)},
			Row{"4 KiB read, checks on, p99 (ms)", fmt.Sprintf("%.3f", pOn), fmt.Sprintf("%.3f checks off", pOff), ratio(pOn, pOff), "", NotJudged},
		)
	}

	rows = append(rows, r.createRows()...)

	if r.MemErr != nil {
		fail("memory per sandbox", r.MemErr)
	} else {
		s := medianMem(r.Mem.Sum)
		bRSS, bPSS := "-", "-"
		if r.Mem.IdleErr == nil {
			bRSS = fmt.Sprintf("%.1f idle Go x2", 2*mib(r.Mem.Idle.RSS))
			bPSS = fmt.Sprintf("%.1f idle Go x2", 2*mib(r.Mem.Idle.PSS))
		}
		rows = append(rows,
			Row{fmt.Sprintf("memory/sandbox RSS host+agent, n=%d (MiB)", len(r.Mem.Sum)), fmt.Sprintf("%.1f", mib(s.RSS)), bRSS, ratio(float64(s.RSS), float64(2*r.Mem.Idle.RSS)), "<= 20 MiB", atMost(mib(s.RSS), 20)},
			Row{fmt.Sprintf("memory/sandbox PSS host+agent, n=%d (MiB)", len(r.Mem.Sum)), fmt.Sprintf("%.1f", mib(s.PSS)), bPSS, ratio(float64(s.PSS), float64(2*r.Mem.Idle.PSS)), "<= 20 MiB", atMost(mib(s.PSS), 20)},
		)
		bT := "-"
		if r.Mem.IdleErr == nil {
			bT = fmt.Sprintf("%d idle Go x2", 2*r.Mem.IdleThreads)
		}
		rows = append(rows,
			Row{fmt.Sprintf("threads/idle sandbox (all its processes), n=%d", len(r.Mem.Tasks)), fmt.Sprintf("%.0f", Median(r.Mem.Tasks)), bT, ratio(Median(r.Mem.Tasks), float64(2*r.Mem.IdleThreads)), "", NotJudged},
			Row{fmt.Sprintf("processes/idle sandbox, n=%d", len(r.Mem.Procs)), fmt.Sprintf("%.0f", Median(r.Mem.Procs)), "2 host+agent", ratio(Median(r.Mem.Procs), 2), "", NotJudged},
		)
	}
	if r.SPErr != nil {
		fail("service port", r.SPErr)
	} else {
		rows = append(rows, r.SP.Rows()...)
	}
	if r.LifeErr != nil {
		fail("lifecycle", r.LifeErr)
	} else {
		rows = append(rows, r.Life.Rows(lifecycleLayers)...)
	}
	if r.ReadoptErr != nil {
		fail("worker start to serving again (re-adoption)", r.ReadoptErr)
	} else if r.Readopt.N > 0 {
		rows = append(rows, r.Readopt.Rows()...)
	}
	if r.TplErr != nil {
		fail("template build", r.TplErr)
	} else if len(r.Tpl.Cold) > 0 {
		rows = append(rows, r.Tpl.Rows()...)
	}
	if r.CIErr != nil {
		fail("code interpreter", r.CIErr)
	} else if len(r.CI.RunCode) > 0 {
		rows = append(rows, r.CI.Rows()...)
	}
	if r.EgressErr != nil {
		fail("egress", r.EgressErr)
	} else if r.Egress.Rounds > 0 {
		rows = append(rows, r.Egress.Rows()...)
	}
	if r.VMErr != nil {
		fail("microvm (base-vm) vs ns (base)", r.VMErr)
	} else {
		rows = append(rows, r.VM.Rows()...)
	}
	if r.VMIdleErr != nil {
		fail("microvm idle base-vm memory", r.VMIdleErr)
	} else if r.VMIdle.N > 0 {
		rows = append(rows, r.VMIdle.Rows()...)
	}
	if r.IsoErr != nil {
		fail("isolation (user namespaces, disk quota)", r.IsoErr)
	} else if len(r.Iso.Start[IsoAll]) > 0 {
		rows = append(rows, r.Iso.rows()...)
	}
	rows = append(rows, fleetRows(r.Fleet)...)
	if r.FleetErr != nil {
		fail("fleet (simulated workers)", r.FleetErr)
	}
	return rows
}

// Notes explains the figures: sample sizes, breakdowns and caveats.
func (r *Report) Notes() string {
	var b strings.Builder
	load, _ := os.ReadFile("/proc/loadavg")
	fmt.Fprintf(&b, "machine: %d CPUs (GOMAXPROCS %d), load %s; run took %.0fs\n",
		runtime.NumCPU(), runtime.GOMAXPROCS(0), strings.Join(strings.Fields(string(load))[:min(3, len(strings.Fields(string(load))))], " "), r.Took.Seconds())
	if r.CapErr == nil {
		c := r.Cap
		fmt.Fprintf(&b, "capability: median of %d rounds; cold = %d distinct tokens per round, each verified once (signature, claims decode, checks, cache insert);\n"+
			"  cached = one token re-verified (SHA-256, lookup, purpose/key/time checks). Token %d bytes, Ed25519 message (PAE) %d bytes.\n"+
			"  * cold is bounded below by the CPU's Ed25519 verify (baseline column): non-signature work = %.1f µs/op (cold - raw).\n",
			c.Rounds, c.ColdPerRound, c.TokenBytes, c.SignedBytes, c.ColdUS-c.RawEd25519US)
		if c.RawEd25519US > 60 {
			fmt.Fprintf(&b, "  The raw Ed25519 verify alone (%.1f µs) exceeds the 60 µs cold target: it cannot be met on this CPU by any verifier.\n", c.RawEd25519US)
		}
	}
	if r.ReadErr == nil {
		rr := r.Read.RoundRatios
		fmt.Fprintf(&b, "read: %d reads per side after warm-up, in on/off pairs alternating which goes first (%d rounds); sequential, keep-alive; content checked.\n"+
			"  per-round on/off ratio of medians: median %.2fx, range %.2fx..%.2fx (drift-cancelled cross-check of the ratio column).\n"+
			"  off = platform with UnsafeSkipIdentityChecks (no verify, no identity comparison, no audit record).\n",
			len(r.Read.On), len(rr), Median(rr), Percentile(rr, 0), Percentile(rr, 100))
	}
	b.WriteString(r.createNotes())
	if r.MemErr == nil && len(r.Mem.Sum) > 0 {
		h, g := medianMem(r.Mem.Host), medianMem(r.Mem.Guest)
		fmt.Fprintf(&b, "memory: each sandbox used once (4 KiB write+read, `echo`), then idle; medians in MiB:\n"+
			"  spaced-host RSS %.1f (anon %.1f, file %.1f) PSS %.1f | agent RSS %.1f (anon %.1f, file %.1f) PSS %.1f\n",
			mib(h.RSS), mib(h.RSSAnon), mib(h.RSSFile), mib(h.PSS), mib(g.RSS), mib(g.RSSAnon), mib(g.RSSFile), mib(g.PSS))
		if r.Mem.IdleErr != nil {
			fmt.Fprintf(&b, "  idle Go baseline unavailable: %v\n", r.Mem.IdleErr)
		} else {
			i := r.Mem.Idle
			fmt.Fprintf(&b, "  baseline: an idle minimal Go process (internal/bench/idleproc, built like spaced-guest): RSS %.1f (anon %.1f, file %.1f) PSS %.1f\n",
				mib(i.RSS), mib(i.RSSAnon), mib(i.RSSFile), mib(i.PSS))
		}
	}
	if r.VMErr == nil {
		b.WriteString(r.VM.Notes())
	}
	if r.VMIdleErr == nil && r.VMIdle.N > 0 {
		b.WriteString(r.VMIdle.Notes())
	}
	if len(r.Fleet) > 0 {
		b.WriteString(fleetNotes(r.Fleet))
	}
	return b.String()
}

func slicesMin(xs []float64) float64 { return Percentile(xs, 0) }
func slicesMax(xs []float64) float64 { return Percentile(xs, 100) }

// createRows are the sandbox create figures.
func (r *Report) createRows() []Row {
	if r.CreateErr != nil {
		return []Row{{Figure: "sandbox create", Value: "error: " + errString(r.CreateErr)}}
	}
	c, raw := ms(r.Create.Create), ms(r.Create.RawStart)
	b50, b99 := "-", "-"
	if len(raw) > 0 {
		b50 = fmt.Sprintf("%.1f raw ns start", Median(raw))
		b99 = fmt.Sprintf("%.1f raw ns start", Percentile(raw, 99))
	}
	rows := []Row{
		{fmt.Sprintf("sandbox create p50, n=%d (ms)", len(c)), fmt.Sprintf("%.1f", Median(c)), b50, ratio(Median(c), Median(raw)), "<= 25 ms", atMost(Median(c), 25)},
		{fmt.Sprintf("sandbox create p99, n=%d (ms)", len(c)), fmt.Sprintf("%.1f", Percentile(c, 99)), b99, ratio(Percentile(c, 99), Percentile(raw, 99)), "", NotJudged},
	}
	if h := ms(r.Create.HostBase); len(h) > 0 {
		rows = append(rows, Row{fmt.Sprintf("create p50, base (Debian image) vs base-host (host /usr), n=%d (ms)", len(c)),
			fmt.Sprintf("%.1f", Median(c)), fmt.Sprintf("%.1f base-host", Median(h)), ratio(Median(c), Median(h)), "<= 1.2x",
			atMost(Median(c)/Median(h), 1.2)})
	} else {
		rows = append(rows, Row{Figure: "create p50, base (Debian image) vs base-host", Value: "not measured: the Debian base image is not built (make base-image)"})
	}
	cc := r.Create.Conc
	fig := fmt.Sprintf("create throughput, %d clients, n=%d (creates/s)", cc.Clients, cc.Clients*max(1, cc.Creates/max(1, cc.Clients)))
	switch {
	case r.Create.ConcErr != nil:
		rows = append(rows, Row{Figure: "create throughput", Value: "error: " + errString(r.Create.ConcErr)})
	case cc.Clients > 0:
		base := "-"
		if cc.RawStarts > 0 {
			base = fmt.Sprintf("%.1f raw ns starts/s", cc.RawPerSecond())
		}
		rows = append(rows,
			Row{fig, fmt.Sprintf("%.1f", cc.PerSecond()), base, ratio(cc.PerSecond(), cc.RawPerSecond()), ">= 40/s", atLeast(cc.PerSecond(), 40)},
			Row{fmt.Sprintf("create p50 under %d clients (ms)", cc.Clients), fmt.Sprintf("%.1f", Median(ms(cc.Latency))), fmt.Sprintf("%.1f sequential", Median(c)),
				ratio(Median(ms(cc.Latency)), Median(c)), "", NotJudged},
		)
	}
	return rows
}

// createPhaseOrder lists the create phases in the order they happen.
var createPhaseOrder = []string{"api.place", "api.record", "api.install", "worker.total", "worker.substrate", "worker.bridge", "worker.gateway", "worker.persist", "api.commit"}

// createNotes explains the create figures and gives the per-phase medians.
func (r *Report) createNotes() string {
	if r.CreateErr != nil || len(r.Create.Create) == 0 {
		return ""
	}
	var b strings.Builder
	c := ms(r.Create.Create)
	fmt.Fprintf(&b, "create: sdk CreateSandbox (POST /sandboxes) wall time, each killed right after (untimed); min %.1f max %.1f ms.\n"+
		"  baseline: ns substrate Start alone (namespaces, overlay, cgroups, agent listening) n=%d, interleaved with the creates,\n"+
		"  configured like the workers' (space-nsinit as the init, the next init started ahead of time: sequential starts find it warm);\n"+
		"  the difference is control plane + etcd + sbx-manager record (bbolt fsync) + spaced-host bridge start and verification.\n",
		slicesMin(c), slicesMax(c), len(r.Create.RawStart))
	if len(r.Create.HostBase) > 0 {
		fmt.Fprintf(&b, "  base ran the Debian base image %s (overlay of its one layer, no host /usr); each base create was\n"+
			"  followed by one of base-host (the generated /etc over the host's /usr, the base before it) on the same worker.\n", r.Create.BaseImage)
	}
	if len(r.Create.Phases) > 0 {
		fmt.Fprintf(&b, "  phases, sequential (median ms; api.* in space-api, worker.* inside api.install): %s\n", formatPhases(r.Create.Phases, createPhaseOrder))
	}
	if cc := r.Create.Conc; cc.Clients > 0 && r.Create.ConcErr == nil {
		fmt.Fprintf(&b, "  throughput: %d clients created %d sandboxes in %.2fs (kept until the end, then killed untimed); baseline: %d raw ns starts, %d at once, in %.2fs.\n",
			cc.Clients, cc.Creates, cc.Wall.Seconds(), cc.RawStarts, cc.Clients, cc.RawWall.Seconds())
		if len(cc.Phases) > 0 {
			fmt.Fprintf(&b, "  phases, %d clients (median ms): %s\n", cc.Clients, formatPhases(cc.Phases, createPhaseOrder))
		}
	}
	return b.String()
}
