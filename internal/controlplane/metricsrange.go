package controlplane

// Metrics over time: the window of a metrics read, the node call that
// returns a worker's samples of one execution, and GET /sandboxes/metrics
// (the latest sample of several sandboxes).

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/store"
)

// apiMetricsRoutes adds the routes of metrics over time, team metrics and
// refreshes (metricsrange.go, teammetrics.go, refresh.go).
func (s *Server) apiMetricsRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET /sandboxes/metrics", s.withKey(s.handleSandboxesMetrics))
	mux.HandleFunc("GET /teams/{teamID}/metrics", s.withKey(s.handleTeamMetrics))
	mux.HandleFunc("GET /teams/{teamID}/metrics/max", s.withKey(s.handleTeamMetricsMax))
	mux.HandleFunc("POST /sandboxes/{id}/refreshes", s.withKey(s.handleRefresh))
}

// window is a metrics read's [start, end] in Unix seconds, inclusive; a
// zero bound is open.
type window struct{ start, end int64 }

// maxUnixSeconds bounds start and end (year 9999), so that converting
// them to times cannot overflow.
const maxUnixSeconds = 253402300799

// parseWindow reads start and end (Unix seconds) from q: absent is open;
// negative, non-numeric, absurdly large or end before start is invalid.
func parseWindow(q url.Values) (window, error) {
	var w window
	for _, f := range []struct {
		k string
		v *int64
	}{{"start", &w.start}, {"end", &w.end}} {
		v := q.Get(f.k)
		if v == "" {
			continue
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 || n > maxUnixSeconds {
			return w, fmt.Errorf("%w: %s must be Unix seconds", errdefs.ErrInvalid, f.k)
		}
		*f.v = n
	}
	if w.start != 0 && w.end != 0 && w.end < w.start {
		return w, fmt.Errorf("%w: end is before start", errdefs.ErrInvalid)
	}
	return w, nil
}

func (w window) contains(t time.Time) bool {
	ts := t.Unix()
	return (w.start == 0 || ts >= w.start) && (w.end == 0 || ts <= w.end)
}

// times is the window as the node call's inclusive time bounds.
func (w window) times() (start, end time.Time) {
	if w.start != 0 {
		start = time.Unix(w.start, 0)
	}
	if w.end != 0 {
		end = time.Unix(w.end+1, 0).Add(-time.Nanosecond)
	}
	return start, end
}

// metricsRange asks the worker for its samples of route in w (at most
// the last ones when last > 0), oldest first.
func (n *nodeClient) metricsRange(ctx context.Context, nodeURL string, route identity.Route, w window, last int) ([]spacev1.MetricsResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, n.callTimeout)
	defer cancel()
	start, end := w.times()
	var resp spacev1.MetricsRangeResponse
	err := n.call(ctx, nodeURL, spacev1.NodePathMetricsRange, route,
		spacev1.MetricsRangeRequest{Route: route, Start: start, End: end, Last: last}, &resp)
	return resp.Samples, err
}

// maxMetricsSandboxes bounds the ids of one GET /sandboxes/metrics.
const maxMetricsSandboxes = 100

// metricsFanout bounds the worker calls one GET /sandboxes/metrics makes
// at once.
const metricsFanout = 8

// handleSandboxesMetrics serves GET /sandboxes/metrics?sandbox_ids=a,b
// (E2B's SandboxesWithMetrics): the latest sample of each listed sandbox
// of the caller's team. Ids may be comma-separated or repeated. Unknown,
// killed and other teams' ids, and sandboxes whose worker has no sample
// (paused and no longer held, in a lifecycle operation, worker down), are
// absent from the answer rather than errors: one bad id does not spoil
// the others, and absence says nothing about other teams' sandboxes.
func (s *Server) handleSandboxesMetrics(w http.ResponseWriter, r *http.Request, c caller) {
	var ids []string
	seen := map[string]bool{}
	for _, v := range r.URL.Query()["sandbox_ids"] {
		for id := range strings.SplitSeq(v, ",") {
			id = strings.TrimSpace(id)
			if id == "" || seen[id] {
				continue
			}
			if _, err := parseSandboxID(id); err != nil {
				s.writeError(w, r, err)
				return
			}
			seen[id] = true
			ids = append(ids, id)
		}
	}
	if len(ids) == 0 {
		s.writeError(w, r, fmt.Errorf("%w: sandbox_ids is required", errdefs.ErrInvalid))
		return
	}
	if len(ids) > maxMetricsSandboxes {
		s.writeError(w, r, fmt.Errorf("%w: at most %d sandbox_ids", errdefs.ErrInvalid, maxMetricsSandboxes))
		return
	}
	out := e2bapi.SandboxesWithMetrics{Sandboxes: map[string]e2bapi.SandboxMetric{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, metricsFanout)
	for _, id := range ids {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			m, ok := s.latestMetric(r.Context(), c, id)
			if ok {
				mu.Lock()
				out.Sandboxes[id] = m
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	writeJSON(w, http.StatusOK, out)
}

// latestMetric is the newest sample of the caller's sandbox id, if any.
func (s *Server) latestMetric(ctx context.Context, c caller, id string) (e2bapi.SandboxMetric, bool) {
	rec, err := s.getSandbox(ctx, c, id)
	if err != nil || (rec.State != store.StateRunning && rec.State != store.StatePaused) {
		return e2bapi.SandboxMetric{}, false
	}
	samples, err := s.node.metricsRange(ctx, s.nodeURL(ctx, rec), rec.Route, window{}, 1)
	if err != nil || len(samples) == 0 {
		if err != nil {
			s.log.Debug("latest metrics unavailable", "sandbox", id, "err", err)
		}
		return e2bapi.SandboxMetric{}, false
	}
	return s.metric(rec, samples[len(samples)-1]), true
}
