package controlplane

import (
	"encoding/base64"
	"fmt"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// listQuery is a parsed GET /v2/sandboxes query.
type listQuery struct {
	States       map[string]bool
	Metadata     map[string]string
	Template     string
	StartedAfter time.Time
	Asc          bool
	Limit        int
	After        *cursor
}

type cursor struct {
	Started int64 // unix nanoseconds
	ID      string
}

func (c cursor) encode() string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(c.Started, 10) + "_" + c.ID))
}

func decodeCursor(s string) (*cursor, error) {
	bad := fmt.Errorf("%w: nextToken is not a token this server issued", errdefs.ErrInvalid)
	if len(s) > 256 {
		return nil, bad
	}
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return nil, bad
	}
	ts, id, ok := strings.Cut(string(b), "_")
	if !ok {
		return nil, bad
	}
	n, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return nil, bad
	}
	if _, err := parseSandboxID(id); err != nil {
		return nil, bad
	}
	return &cursor{Started: n, ID: id}, nil
}

// parseMetadataQuery reads the SDK's metadata filter: a query string
// ("k=v&k2=v2") whose keys and values are themselves URL-encoded.
func parseMetadataQuery(raw string) (map[string]string, error) {
	if raw == "" {
		return nil, nil
	}
	vals, err := url.ParseQuery(raw)
	if err != nil {
		return nil, fmt.Errorf("%w: metadata filter must be a query string like \"user=abc&app=prod\"", errdefs.ErrInvalid)
	}
	out := make(map[string]string, len(vals))
	for k, vs := range vals {
		dk, err1 := url.QueryUnescape(k)
		if err1 != nil || len(vs) != 1 {
			return nil, fmt.Errorf("%w: metadata filter key %q is malformed or repeated", errdefs.ErrInvalid, truncate(k, 64))
		}
		dv, err2 := url.QueryUnescape(vs[0])
		if err2 != nil {
			return nil, fmt.Errorf("%w: metadata filter value for %q is malformed", errdefs.ErrInvalid, truncate(dk, 64))
		}
		out[dk] = dv
	}
	return out, nil
}

func parseListQuery(q url.Values, v2 bool) (listQuery, error) {
	lq := listQuery{States: map[string]bool{e2bapi.StateRunning: true}, Limit: -1}
	md, err := parseMetadataQuery(q.Get("metadata"))
	if err != nil {
		return lq, err
	}
	lq.Metadata = md
	if !v2 {
		return lq, nil
	}
	lq.States = map[string]bool{e2bapi.StateRunning: true, e2bapi.StatePaused: true}
	if states := q["state"]; len(states) > 0 {
		lq.States = map[string]bool{}
		for _, s := range states {
			for _, st := range strings.Split(s, ",") {
				if st != e2bapi.StateRunning && st != e2bapi.StatePaused {
					return lq, fmt.Errorf("%w: state must be running or paused", errdefs.ErrInvalid)
				}
				lq.States[st] = true
			}
		}
	}
	lq.Limit = e2bapi.DefaultLimit
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > e2bapi.MaxLimit {
			return lq, fmt.Errorf("%w: limit must be an integer 1..%d", errdefs.ErrInvalid, e2bapi.MaxLimit)
		}
		lq.Limit = n
	}
	if t := q.Get("nextToken"); t != "" {
		if lq.After, err = decodeCursor(t); err != nil {
			return lq, err
		}
	}
	switch q.Get("order") {
	case "", "desc":
	case "asc":
		lq.Asc = true
	default:
		return lq, fmt.Errorf("%w: order must be asc or desc", errdefs.ErrInvalid)
	}
	if t := q.Get("startedAfter"); t != "" {
		ts, err := time.Parse(time.RFC3339Nano, t)
		if err != nil {
			return lq, fmt.Errorf("%w: startedAfter must be an RFC 3339 timestamp", errdefs.ErrInvalid)
		}
		lq.StartedAfter = ts
	}
	lq.Template = q.Get("template")
	return lq, nil
}

// filterSandboxes applies lq to the team's visible records and returns one
// page, the next cursor ("" when done) and the number of running matches
// before pagination.
func filterSandboxes(entries []store.SandboxEntry, team string, lq listQuery) (page []store.SandboxRecord, next string, running int) {
	var out []store.SandboxRecord
	for _, e := range entries {
		r := e.Record
		if !visible(r, team) || !lq.States[e2bState(r)] {
			continue
		}
		if lq.Template != "" && r.TemplateID != lq.Template {
			continue
		}
		if !lq.StartedAfter.IsZero() && r.StartedAt.Before(lq.StartedAfter) {
			continue
		}
		match := true
		for k, v := range lq.Metadata {
			if got, ok := r.Metadata[k]; !ok || got != v {
				match = false
				break
			}
		}
		if !match {
			continue
		}
		if e2bState(r) == e2bapi.StateRunning {
			running++
		}
		out = append(out, r)
	}
	key := func(r store.SandboxRecord) cursor { return cursor{Started: r.StartedAt.UnixNano(), ID: r.ID} }
	before := func(a, b cursor) bool { // a sorts before b
		if a.Started != b.Started {
			if lq.Asc {
				return a.Started < b.Started
			}
			return a.Started > b.Started
		}
		if lq.Asc {
			return a.ID < b.ID
		}
		return a.ID > b.ID
	}
	sort.Slice(out, func(i, j int) bool { return before(key(out[i]), key(out[j])) })
	if lq.After != nil {
		i := sort.Search(len(out), func(i int) bool { return before(*lq.After, key(out[i])) })
		out = out[i:]
	}
	if lq.Limit > 0 && len(out) > lq.Limit {
		out = out[:lq.Limit]
		next = key(out[len(out)-1]).encode()
	}
	return out, next, running
}
