package bench

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Median returns the median of xs (0 for none). xs is not modified.
func Median(xs []float64) float64 { return Percentile(xs, 50) }

// Percentile returns the p-th percentile (0..100) of xs by the
// nearest-rank method: the smallest sample with at least p% of the samples
// at or below it. xs is not modified.
func Percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if p <= 0 {
		return s[0]
	}
	rank := int(float64(len(s))*p/100 + 0.999999999)
	rank = max(1, min(rank, len(s)))
	return s[rank-1]
}

// ms converts durations to float milliseconds.
func ms(ds []time.Duration) []float64 {
	out := make([]float64, len(ds))
	for i, d := range ds {
		out[i] = float64(d) / float64(time.Millisecond)
	}
	return out
}

// Verdict says whether a figure meets its target.
type Verdict int

// Verdicts.
const (
	NotJudged Verdict = iota
	Meets
	Misses
)

func (v Verdict) String() string {
	switch v {
	case Meets:
		return "meets"
	case Misses:
		return "MISSES"
	}
	return "-"
}

// Row is one line of the report table.
type Row struct {
	Figure   string
	Value    string
	Baseline string
	Ratio    string
	Target   string
	Verdict  Verdict
}

// atMost judges value <= target.
func atMost(value, target float64) Verdict {
	if value <= target {
		return Meets
	}
	return Misses
}

// atLeast judges value >= target.
func atLeast(value, target float64) Verdict {
	if value >= target {
		return Meets
	}
	return Misses
}

func ratio(a, b float64) string {
	if b == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", a/b)
}

// WriteTable prints rows as an aligned table.
func WriteTable(w io.Writer, rows []Row) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "figure\tvalue\tbaseline\tratio\ttarget\tverdict")
	fmt.Fprintln(tw, "------\t-----\t--------\t-----\t------\t-------")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", r.Figure, dash(r.Value), dash(r.Baseline), dash(r.Ratio), dash(r.Target), r.Verdict)
	}
	return tw.Flush()
}

func dash(s string) string {
	if strings.TrimSpace(s) == "" {
		return "-"
	}
	return s
}
