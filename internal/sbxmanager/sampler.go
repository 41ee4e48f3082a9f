package sbxmanager

// Resource samples over time: the sampler reads every running (or paused)
// activation's usage every Config.SampleInterval and keeps the samples of
// each execution in a ring of Config.SampleRetention, which MetricsRange
// answers from (the control plane's GET /sandboxes/{id}/metrics?start&end).
//
// CPU: substrate Stats computes cpuUsedPct from two readings of the
// execution's CPU time (the ns substrate its cgroups' usage, the microvm
// substrate QEMU's /proc times); the first Stats of an execution takes its
// two readings ~100 ms apart, each later one reuses the previous sample's
// reading, so every sample, the first included, is a real delta over the
// time before it. The ring belongs to one execution: a new execution of the
// sandbox (resume elsewhere, move) starts an empty one, and the ring goes
// when the execution stops on this worker.

import (
	"context"
	"fmt"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

// Sampler defaults (Config.SampleInterval, Config.SampleRetention).
const (
	DefaultSampleInterval  = 5 * time.Second
	DefaultSampleRetention = time.Hour
	// sampleTimeout bounds one execution's Stats (a large writable layer
	// takes a while to walk): a slow one is skipped, not waited for.
	sampleTimeout = 3 * time.Second
)

// sampleRing holds one execution's samples, oldest first once unrolled.
type sampleRing struct {
	route identity.Route
	buf   []spacev1.MetricsResponse
	next  int // where the next sample goes
	full  bool
}

func (r *sampleRing) add(s spacev1.MetricsResponse) {
	if n := r.len(); n > 0 && !s.Timestamp.After(r.at(n-1).Timestamp) {
		return // out of order (a live sample raced the tick): keep the series monotonic
	}
	r.buf[r.next] = s
	r.next++
	if r.next == len(r.buf) {
		r.next, r.full = 0, true
	}
}

func (r *sampleRing) len() int {
	if r.full {
		return len(r.buf)
	}
	return r.next
}

// at is the i-th oldest sample.
func (r *sampleRing) at(i int) spacev1.MetricsResponse {
	if r.full {
		return r.buf[(r.next+i)%len(r.buf)]
	}
	return r.buf[i]
}

// window returns the samples in [start, end] (zero: open), oldest first.
func (r *sampleRing) window(start, end time.Time) []spacev1.MetricsResponse {
	out := []spacev1.MetricsResponse{}
	for i := range r.len() {
		s := r.at(i)
		if (!start.IsZero() && s.Timestamp.Before(start)) || (!end.IsZero() && s.Timestamp.After(end)) {
			continue
		}
		out = append(out, s)
	}
	return out
}

// samplerCap is the ring size for the configured interval and retention.
func (m *Manager) samplerCap() int {
	return max(1, int(m.cfg.SampleRetention/m.cfg.SampleInterval))
}

// record adds s to route's ring, replacing a ring of another execution.
func (m *Manager) record(route identity.Route, s spacev1.MetricsResponse) {
	m.sampleMu.Lock()
	defer m.sampleMu.Unlock()
	r := m.samples[route.SandboxID]
	if r == nil || r.route != route {
		r = &sampleRing{route: route, buf: make([]spacev1.MetricsResponse, m.samplerCap())}
		m.samples[route.SandboxID] = r
	}
	r.add(s)
}

// runSampler samples every activation each SampleInterval until stop is
// closed. Close waits for it (m.watchers).
func (m *Manager) runSampler(stop <-chan struct{}) {
	defer m.watchers.Done()
	t := time.NewTicker(m.cfg.SampleInterval)
	defer t.Stop()
	for {
		m.sampleAll(stop)
		select {
		case <-stop:
			return
		case <-t.C:
		}
	}
}

// sampleAll takes one sample of every activation and drops the rings of
// executions no longer served here.
func (m *Manager) sampleAll(stop <-chan struct{}) {
	m.mu.RLock()
	acts := make([]*activation, 0, len(m.active))
	for _, a := range m.active {
		acts = append(acts, a)
	}
	m.mu.RUnlock()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	live := make(map[string]identity.Route, len(acts))
	for _, a := range acts {
		live[a.route.SandboxID] = a.route
		if ctx.Err() != nil {
			break
		}
		s, err := sampleActivation(ctx, a)
		if err != nil {
			m.log.Debug("metrics sample skipped", "sandbox", a.route.SandboxID, "err", err)
			continue
		}
		m.record(a.route, s)
	}
	m.sampleMu.Lock()
	for id, r := range m.samples {
		if live[id] != r.route {
			delete(m.samples, id)
		}
	}
	m.sampleMu.Unlock()
}

// sampleActivation reads a's usage now.
func sampleActivation(ctx context.Context, a *activation) (spacev1.MetricsResponse, error) {
	sr, ok := a.inst.(substrate.StatsReporter)
	if !ok {
		return spacev1.MetricsResponse{}, fmt.Errorf("metrics %s: %w: substrate %s reports no metrics", a.route.SandboxID, errdefs.ErrUnavailable, a.route.Substrate)
	}
	ctx, cancel := context.WithTimeout(ctx, sampleTimeout)
	defer cancel()
	st, err := sr.Stats(ctx)
	if err != nil {
		return spacev1.MetricsResponse{}, fmt.Errorf("metrics %s: %w: %v", a.route.SandboxID, errdefs.ErrUnavailable, err)
	}
	if st.Timestamp.IsZero() {
		st.Timestamp = time.Now()
	}
	return spacev1.MetricsResponse{
		Timestamp: st.Timestamp.UTC(), CPUCount: st.CPUCount, CPUUsedPct: st.CPUUsedPct,
		MemUsed: st.MemUsed, MemTotal: st.MemTotal, MemCache: st.MemCache,
		DiskUsed: st.DiskUsed, DiskTotal: st.DiskTotal,
	}, nil
}

// MetricsRange returns the samples of the execution named by route taken
// in [start, end] (zero: open), oldest first. An execution not sampled yet
// is sampled now (that sample is kept), so a running one never answers an
// empty series for an open window.
func (m *Manager) MetricsRange(ctx context.Context, route identity.Route, start, end time.Time) ([]spacev1.MetricsResponse, error) {
	if err := validRoute("metrics", route); err != nil {
		return nil, err
	}
	if !start.IsZero() && !end.IsZero() && end.Before(start) {
		return nil, fmt.Errorf("metrics %s: %w: end before start", route.SandboxID, errdefs.ErrInvalid)
	}
	act, err := m.liveActivation("metrics", route)
	if err != nil {
		return nil, err
	}
	m.sampleMu.Lock()
	r := m.samples[route.SandboxID]
	var out []spacev1.MetricsResponse
	if r != nil && r.route == route && r.len() > 0 && m.cfg.SampleInterval > 0 {
		out = r.window(start, end)
	}
	m.sampleMu.Unlock()
	if out != nil {
		return out, nil
	}
	s, err := sampleActivation(ctx, act)
	if err != nil {
		return nil, err
	}
	m.record(route, s)
	if (!start.IsZero() && s.Timestamp.Before(start)) || (!end.IsZero() && s.Timestamp.After(end)) {
		return []spacev1.MetricsResponse{}, nil
	}
	return []spacev1.MetricsResponse{s}, nil
}
