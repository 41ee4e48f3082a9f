package cluster

import (
	"fmt"
	"strings"
	"text/tabwriter"
	"time"
)

// renderReport is the run's table: per fault, then overall.
func renderReport(c *cluster, l *load, faults []*fault, v verdict, loadStart, loadEnd time.Time) string {
	var b strings.Builder
	fmt.Fprintf(&b, "SPACE cluster fault test: 3 etcd members, 2 control planes, 2 edges, 3 workers, each on its own host (%s)\n", c.net.Prefix())
	fmt.Fprintf(&b, "edges fail over across control planes: %t; client: every operation through one (control plane, edge) pair, once more through the other when it fails\n", c.edgeFailover)
	base := l.window(loadStart, faults[0].start)
	fmt.Fprintf(&b, "load: %v, %d operations (%d in the baseline before the first fault, %d failed there)\n\n",
		loadEnd.Sub(loadStart).Round(time.Second), len(l.results), base.ops, base.errs)

	tw := tabwriter.NewWriter(&b, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "fault\trecovered\trecovery\tback after restore\tops\tfailed 1st attempt\tfailed after retry\terror rate (1st / retry)\tslow (>5s) / max latency\ttop errors")
	for _, f := range faults {
		back := "-"
		if f.back >= 0 {
			back = f.back.Round(10 * time.Millisecond).String()
		}
		rec := "yes"
		if !f.recovered {
			rec = "NO"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%d\t%s / %s\t%d / %s\t%s\n", f.name, rec, f.recovery.Round(10*time.Millisecond), back,
			f.stats.ops, f.stats.firstErrs, f.stats.errs, pct(f.stats.firstErrs, f.stats.ops), pct(f.stats.errs, f.stats.ops),
			f.stats.slow, f.stats.maxLatency.Round(10*time.Millisecond), topClasses(f.stats.classes, 2))
	}
	tw.Flush()

	for i, f := range faults {
		if i == 1 {
			fmt.Fprintf(&b, "control plane api1 down: data-plane requests through edge1 that failed on the first attempt: %d (through edge2: %d)\n",
				f.stats.dataFirstErrsVia[0], f.stats.dataFirstErrsVia[1])
		}
		if f.worker != "" {
			fmt.Fprintf(&b, "%s: sandboxes running on %s at the fault: %d; served by another worker before it was restored: %d\n",
				f.name, f.worker, len(f.onWorker), f.movedBefore)
		}
	}
	all := l.window(loadStart, loadEnd.Add(time.Second))
	fmt.Fprintf(&b, "\noverall: %d operations, %d failed on the first attempt (%s), %d after the retry (%s)\n",
		all.ops, all.firstErrs, pct(all.firstErrs, all.ops), all.errs, pct(all.errs, all.ops))
	tw = tabwriter.NewWriter(&b, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "invariant\tcount\twant")
	fmt.Fprintf(tw, "misroutes (answered by an execution the control plane did not route to)\t%d\t0\n", v.misroutes)
	fmt.Fprintf(tw, "requests served by a replaced execution\t%d\t0\n", v.replaced)
	fmt.Fprintf(tw, "acknowledged writes lost (of %d)\t%d\t0\n", v.acked, v.lostWrites)
	fmt.Fprintf(tw, "sandboxes lost (of %d acknowledged creates)\t%d\t0\n", v.sandboxes, v.lostSbx)
	tw.Flush()
	fmt.Fprintf(&b, "recovery: from the fault to the end of the last operation that failed after the retry or took over %v (data plane); back after restore: the restarted or healed component serving again\n", slowOp)
	fmt.Fprintf(&b, "answers checked for Space-Execution: %d (%d executions in the records)\n", v.answers, v.executions)
	if v.lostBySemantics > 0 {
		fmt.Fprintf(&b, "writes gone with a lost worker's execution (sandbox recovered elsewhere from an earlier snapshot; not counted above): %d\n", v.lostBySemantics)
	}
	for _, s := range v.samples {
		fmt.Fprintf(&b, "  routing: %s\n", s)
	}
	for _, s := range v.lostSamples {
		fmt.Fprintf(&b, "  write: %s\n", s)
	}
	for _, s := range v.lostIDs {
		fmt.Fprintf(&b, "  sandbox: %s\n", s)
	}
	for _, f := range faults {
		for _, e := range f.injectErrs {
			fmt.Fprintf(&b, "  fault %s: %s\n", f.name, e)
		}
	}
	return b.String()
}

func pct(n, of int) string {
	if of == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f%%", 100*float64(n)/float64(of))
}
