package bench

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"
)

// PhaseCollector is a slog.Handler that collects the duration attributes
// of the records whose message it was told to collect (the control plane's
// and the worker's create and install timings, logged at Debug) and passes
// every other record at or above Level to next.
type PhaseCollector struct {
	c     *phaseStore
	next  slog.Handler
	level slog.Level
	msgs  map[string]string // message -> phase name prefix
}

type phaseStore struct {
	mu     sync.Mutex
	phases map[string][]time.Duration
	on     bool
}

// NewPhaseCollector collects the durations of records with the messages
// in msgs (message -> prefix of the phase names, e.g. "api"), and passes
// records at or above level to next.
func NewPhaseCollector(next slog.Handler, level slog.Level, msgs map[string]string) *PhaseCollector {
	return &PhaseCollector{c: &phaseStore{phases: map[string][]time.Duration{}}, next: next, level: level, msgs: msgs}
}

// Collect turns collection on or off and, when turning it on, forgets
// what was collected before.
func (p *PhaseCollector) Collect(on bool) {
	p.c.mu.Lock()
	defer p.c.mu.Unlock()
	if on {
		clear(p.c.phases)
	}
	p.c.on = on
}

// Phases returns what was collected: phase name -> durations.
func (p *PhaseCollector) Phases() map[string][]time.Duration {
	p.c.mu.Lock()
	defer p.c.mu.Unlock()
	out := make(map[string][]time.Duration, len(p.c.phases))
	for k, v := range p.c.phases {
		out[k] = append([]time.Duration(nil), v...)
	}
	return out
}

// Enabled implements slog.Handler.
func (p *PhaseCollector) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= p.level || l >= slog.LevelDebug
}

// Handle implements slog.Handler.
func (p *PhaseCollector) Handle(ctx context.Context, r slog.Record) error {
	if prefix, ok := p.msgs[r.Message]; ok {
		p.c.mu.Lock()
		if p.c.on {
			r.Attrs(func(a slog.Attr) bool {
				if a.Value.Kind() == slog.KindDuration {
					k := prefix + "." + a.Key
					p.c.phases[k] = append(p.c.phases[k], a.Value.Duration())
				}
				return true
			})
		}
		p.c.mu.Unlock()
		return nil
	}
	if r.Level < p.level {
		return nil
	}
	return p.next.Handle(ctx, r)
}

// WithAttrs implements slog.Handler.
func (p *PhaseCollector) WithAttrs(attrs []slog.Attr) slog.Handler {
	q := *p
	q.next = p.next.WithAttrs(attrs)
	return &q
}

// WithGroup implements slog.Handler.
func (p *PhaseCollector) WithGroup(name string) slog.Handler {
	q := *p
	q.next = p.next.WithGroup(name)
	return &q
}

// formatPhases renders phase medians in ms, in the order of names (others
// after, sorted).
func formatPhases(phases map[string][]time.Duration, names []string) string {
	seen := map[string]bool{}
	var parts []string
	add := func(k string) {
		if ds, ok := phases[k]; ok && !seen[k] {
			seen[k] = true
			parts = append(parts, fmt.Sprintf("%s %.1f", k, Median(ms(ds))))
		}
	}
	for _, k := range names {
		add(k)
	}
	var rest []string
	for k := range phases {
		if !seen[k] {
			rest = append(rest, k)
		}
	}
	sort.Strings(rest)
	for _, k := range rest {
		add(k)
	}
	return strings.Join(parts, ", ")
}
