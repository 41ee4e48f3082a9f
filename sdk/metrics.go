package sdk

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
)

// SandboxMetric is one usage sample of a sandbox (E2B's SandboxMetric).
type SandboxMetric = e2bapi.SandboxMetric

// TeamMetric is one sample of a team's sandbox counts (E2B's TeamMetric).
type TeamMetric = e2bapi.TeamMetric

// MaxTeamMetric is the largest value of a team metric in a window.
type MaxTeamMetric = e2bapi.MaxTeamMetric

// Team metric names for MaxTeamMetric.
const (
	MetricConcurrentSandboxes = e2bapi.MetricConcurrentSandboxes
	MetricSandboxStartRate    = e2bapi.MetricSandboxStartRate
)

// windowQuery is start and end as the API reads them (Unix seconds; a
// zero time is left out: open).
func windowQuery(start, end time.Time) url.Values {
	q := url.Values{}
	if !start.IsZero() {
		q.Set("start", strconv.FormatInt(start.Unix(), 10))
	}
	if !end.IsZero() {
		q.Set("end", strconv.FormatInt(end.Unix(), 10))
	}
	return q
}

func withQuery(path string, q url.Values) string {
	if len(q) == 0 {
		return path
	}
	return path + "?" + q.Encode()
}

// GetMetrics returns the sandbox's usage samples taken in [start, end]
// (zero times: open), oldest first (GET /sandboxes/{id}/metrics).
func (c *Client) GetMetrics(ctx context.Context, id string, start, end time.Time) ([]SandboxMetric, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	var out []SandboxMetric
	err := c.rest(ctx, http.MethodGet, withQuery("/sandboxes/"+url.PathEscape(id)+"/metrics", windowQuery(start, end)), nil, &out, nil)
	return out, err
}

// LatestMetrics returns the newest sample of each of ids that has one,
// by id (GET /sandboxes/metrics); unknown ids are absent.
func (c *Client) LatestMetrics(ctx context.Context, ids []string) (map[string]SandboxMetric, error) {
	for _, id := range ids {
		if err := checkID(id); err != nil {
			return nil, err
		}
	}
	q := url.Values{}
	q.Set("sandbox_ids", strings.Join(ids, ","))
	var out e2bapi.SandboxesWithMetrics
	err := c.rest(ctx, http.MethodGet, withQuery("/sandboxes/metrics", q), nil, &out, nil)
	return out.Sandboxes, err
}

// TeamMetrics returns the team's samples in [start, end], oldest first
// (GET /teams/{teamID}/metrics).
func (c *Client) TeamMetrics(ctx context.Context, teamID string, start, end time.Time) ([]TeamMetric, error) {
	var out []TeamMetric
	err := c.rest(ctx, http.MethodGet, withQuery("/teams/"+url.PathEscape(teamID)+"/metrics", windowQuery(start, end)), nil, &out, nil)
	return out, err
}

// MaxTeamMetric returns the largest value of metric (MetricConcurrentSandboxes
// or MetricSandboxStartRate) in [start, end] (GET /teams/{teamID}/metrics/max).
func (c *Client) MaxTeamMetric(ctx context.Context, teamID, metric string, start, end time.Time) (*MaxTeamMetric, error) {
	q := windowQuery(start, end)
	q.Set("metric", metric)
	var out MaxTeamMetric
	if err := c.rest(ctx, http.MethodGet, withQuery("/teams/"+url.PathEscape(teamID)+"/metrics/max", q), nil, &out, nil); err != nil {
		return nil, err
	}
	return &out, nil
}

// Refresh keeps the running sandbox alive for at least d from now
// (POST /sandboxes/{id}/refreshes; whole seconds, at most an hour).
func (c *Client) Refresh(ctx context.Context, id string, d time.Duration) error {
	if err := checkID(id); err != nil {
		return err
	}
	secs := int64((d + time.Second - 1) / time.Second)
	return c.rest(ctx, http.MethodPost, "/sandboxes/"+url.PathEscape(id)+"/refreshes", e2bapi.SandboxRefreshRequest{Duration: &secs}, nil, nil)
}
