package controlplane

// Team metrics (E2B's GET /teams/{teamID}/metrics and /metrics/max): the
// control plane samples its own store every TeamMetricsInterval into a
// bounded ring per team (TeamMetricsRetention): concurrentSandboxes is the
// number of the team's sandboxes that hold a running execution at the
// sample (running, creating, or in a lifecycle operation; not paused, not
// killed), sandboxStartRate the sandboxes created since the previous
// sample per second. The rings live in this control plane's memory: a
// restarted control plane starts them afresh, and with several control
// planes each answers from its own samples (all of them read the same
// store, so their series agree up to sampling instants).

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// Team metrics defaults (Config.TeamMetricsInterval, TeamMetricsRetention).
const (
	DefaultTeamMetricsInterval  = 5 * time.Second
	DefaultTeamMetricsRetention = 24 * time.Hour
)

// teamSample is one sample of one team (24 bytes: a day at 5 s is 405 KiB).
type teamSample struct {
	unix       int64
	concurrent int32
	started    int32
	// rate is started per second over the interval before the sample.
	rate float64
}

type teamRing struct {
	buf  []teamSample
	next int
	full bool
	// busy is when the team last had a sandbox or a start: a ring idle
	// for the retention holds only zeros and is dropped.
	busy time.Time
}

func (r *teamRing) add(s teamSample) {
	r.buf[r.next] = s
	r.next++
	if r.next == len(r.buf) {
		r.next, r.full = 0, true
	}
}

// window returns the samples in w, oldest first.
func (r *teamRing) window(w window) []teamSample {
	n, first := r.next, 0
	if r.full {
		n, first = len(r.buf), r.next
	}
	out := make([]teamSample, 0, n)
	for i := range n {
		s := r.buf[(first+i)%len(r.buf)]
		if (w.start == 0 || s.unix >= w.start) && (w.end == 0 || s.unix <= w.end) {
			out = append(out, s)
		}
	}
	return out
}

// teamMetrics holds the rings of every team.
type teamMetrics struct {
	interval, retention time.Duration

	mu    sync.Mutex
	rings map[string]*teamRing
	last  time.Time // the previous sample's time
}

// startTeamMetrics starts the sampler (owned by s.wg, ended by Close).
func (s *Server) startTeamMetrics() {
	s.teamMetrics = &teamMetrics{interval: s.cfg.TeamMetricsInterval, retention: s.cfg.TeamMetricsRetention, rings: map[string]*teamRing{}}
	if s.cfg.TeamMetricsInterval < 0 {
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		t := time.NewTicker(s.cfg.TeamMetricsInterval)
		defer t.Stop()
		for {
			s.sampleTeams()
			select {
			case <-s.ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
}

// sampleTeams counts every team's sandboxes now.
func (s *Server) sampleTeams() {
	ctx, cancel := context.WithTimeout(s.ctx, 30*time.Second)
	defer cancel()
	entries, err := s.st.ListSandboxes(ctx)
	if err != nil {
		if s.ctx.Err() == nil {
			s.log.Warn("team metrics: listing sandboxes failed", "err", err)
		}
		return
	}
	// Wall time, not s.now: the samples are a time series of their own
	// (and the server's clock may be a test's frozen one).
	s.teamMetrics.sample(time.Now(), entries)
}

// sample adds one sample per team from the store's records at now.
func (tm *teamMetrics) sample(now time.Time, entries []store.SandboxEntry) {
	tm.mu.Lock()
	defer tm.mu.Unlock()
	since := tm.last
	if since.IsZero() {
		since = now.Add(-tm.interval)
	}
	elapsed := now.Sub(since).Seconds()
	if elapsed <= 0 {
		return
	}
	tm.last = now
	counts := map[string]*teamSample{}
	for _, e := range entries {
		rec := e.Record
		c := counts[rec.TeamID]
		if c == nil {
			c = &teamSample{unix: now.Unix()}
			counts[rec.TeamID] = c
		}
		if holdsExecution(rec.State) {
			c.concurrent++
		}
		if rec.CreatedAt.After(since) && !rec.CreatedAt.After(now) {
			c.started++
		}
	}
	size := max(1, int(tm.retention/tm.interval))
	for team := range counts {
		if tm.rings[team] == nil {
			tm.rings[team] = &teamRing{buf: make([]teamSample, size)}
		}
	}
	for team, r := range tm.rings {
		c := counts[team]
		if c == nil {
			c = &teamSample{unix: now.Unix()}
		}
		c.rate = float64(c.started) / elapsed
		if c.concurrent > 0 || c.started > 0 {
			r.busy = now
		}
		if now.Sub(r.busy) > tm.retention {
			delete(tm.rings, team)
			continue
		}
		r.add(*c)
	}
}

// holdsExecution reports whether a sandbox in state st counts as running
// for concurrentSandboxes.
func holdsExecution(st store.SandboxState) bool {
	switch st {
	case store.StateRunning, store.StateCreating, store.StatePausing, store.StateResuming, store.StateMigrating, store.StateSnapshotting:
		return true
	}
	return false
}

func (tm *teamMetrics) window(team string, w window) []teamSample {
	tm.mu.Lock()
	defer tm.mu.Unlock()
	r := tm.rings[team]
	if r == nil {
		return nil
	}
	return r.window(w)
}

// pathTeam checks the path's team against the caller's: another team's
// metrics are 404 (no existence oracle), as everything of another team.
func pathTeam(r *http.Request, c caller) (string, error) {
	team := r.PathValue("teamID")
	if team == "" || team != c.TeamID {
		return "", fmt.Errorf("%w: team %s", errdefs.ErrNotFound, truncate(team, 64))
	}
	return team, nil
}

// handleTeamMetrics serves GET /teams/{teamID}/metrics?start=&end=: the
// team's samples in the window (Unix seconds, inclusive), oldest first.
func (s *Server) handleTeamMetrics(w http.ResponseWriter, r *http.Request, c caller) {
	team, err := pathTeam(r, c)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	win, err := parseWindow(r.URL.Query())
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	samples := s.teamMetrics.window(team, win)
	out := make([]e2bapi.TeamMetric, 0, len(samples))
	for _, sm := range samples {
		at := time.Unix(sm.unix, 0).UTC()
		out = append(out, e2bapi.TeamMetric{Timestamp: at, TimestampUnix: sm.unix,
			ConcurrentSandboxes: int(sm.concurrent), SandboxStartRate: sm.rate})
	}
	writeJSON(w, http.StatusOK, out)
}

// handleTeamMetricsMax serves GET /teams/{teamID}/metrics/max?metric=
// concurrent_sandboxes|sandbox_start_rate&start=&end=: the largest value
// in the window and when it was first reached (value 0 at the window's
// end, or now, when there is no sample).
func (s *Server) handleTeamMetricsMax(w http.ResponseWriter, r *http.Request, c caller) {
	team, err := pathTeam(r, c)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	win, err := parseWindow(r.URL.Query())
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var value func(teamSample) float64
	switch m := r.URL.Query().Get("metric"); m {
	case e2bapi.MetricConcurrentSandboxes:
		value = func(s teamSample) float64 { return float64(s.concurrent) }
	case e2bapi.MetricSandboxStartRate:
		value = func(s teamSample) float64 { return s.rate }
	default:
		s.writeError(w, r, fmt.Errorf("%w: metric must be %s or %s", errdefs.ErrInvalid, e2bapi.MetricConcurrentSandboxes, e2bapi.MetricSandboxStartRate))
		return
	}
	at := s.now().Unix()
	if win.end != 0 && win.end < at {
		at = win.end
	}
	best := e2bapi.MaxTeamMetric{TimestampUnix: at}
	for i, sm := range s.teamMetrics.window(team, win) {
		if v := value(sm); i == 0 || v > best.Value {
			best.Value, best.TimestampUnix = v, sm.unix
		}
	}
	best.Timestamp = time.Unix(best.TimestampUnix, 0).UTC()
	writeJSON(w, http.StatusOK, best)
}
