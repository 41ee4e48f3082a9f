package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"encoding/json"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
)

// Lifecycle events (E2B's events API) live under /space/events/:
//
//	log/<team>/<seq>/<sandbox>   the team's events, in seq (time) order
//	sbx/<team>/<sandbox>/<seq>   the same event, indexed by sandbox
//	observed/<sandbox>           the recorder's digest of the last record it saw
//	cursor                       the last sandbox-record revision recorded
//	leader/                      the recorder's and dispatcher's election
//
// The recorder derives events from the committed sandbox records (their
// etcd history is the outbox): it writes the events, the webhook
// deliveries they cause, its digest and its cursor in one transaction
// guarded by its leadership, so a restart resumes at the cursor and
// nothing is recorded twice.
const (
	eventsPrefix        = prefix + "events/"
	eventLogPrefix      = eventsPrefix + "log/"
	eventSbxPrefix      = eventsPrefix + "sbx/"
	eventObservedPrefix = eventsPrefix + "observed/"
	eventCursorKey      = eventsPrefix + "cursor"
	eventLeaderPrefix   = eventsPrefix + "leader"
)

// ErrCompacted: the history a watch asked for was compacted away; the
// caller resyncs from a listing. It is an errdefs.ErrUnavailable.
var ErrCompacted = errdefs.Message(errdefs.ErrUnavailable, "history compacted")

// EventRecord is one recorded lifecycle event. Seq orders a team's events
// (time, then revision, then index) and names it in keys.
type EventRecord struct {
	Seq   string
	Event e2bapi.SandboxEvent
}

// EventSeq builds the sequence key of the idx-th event derived from the
// sandbox change at revision rev, recorded at t.
func EventSeq(t time.Time, rev int64, idx int) string {
	return fmt.Sprintf("%013d.%012d.%02d", t.UnixMilli(), rev, idx)
}

func validTeam(team string) error {
	if team == "" || len(team) > 128 || strings.ContainsAny(team, "/ \t\r\n") {
		return fmt.Errorf("%w: team %q", errdefs.ErrInvalid, team)
	}
	return nil
}

func eventLogKey(team, seq, sbx string) string { return eventLogPrefix + team + "/" + seq + "/" + sbx }
func eventSbxKey(team, sbx, seq string) string { return eventSbxPrefix + team + "/" + sbx + "/" + seq }

// CampaignEvents blocks until this process (named id) leads the events
// election or ctx ends (Campaign on the events election, whose key stays
// under /space/events/leader).
func (s *Store) CampaignEvents(ctx context.Context, id string, ttl time.Duration) (*Leadership, error) {
	return s.campaign(ctx, eventLeaderPrefix, id, ttl)
}

// EventState is what the recorder resumes from: the last recorded
// revision and its digest of every sandbox it has seen.
type EventState struct {
	Cursor   int64
	Observed map[string][]byte
}

// LoadEventState reads the recorder's cursor and digests.
func (s *Store) LoadEventState(ctx context.Context) (EventState, error) {
	st := EventState{Observed: map[string][]byte{}}
	resp, err := s.cli.Txn(ctx).Then(
		clientv3.OpGet(eventCursorKey),
		clientv3.OpGet(eventObservedPrefix, clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return st, wrapErr("load event state", err)
	}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		if st.Cursor, err = strconv.ParseInt(string(kvs[0].Value), 10, 64); err != nil {
			return st, fmt.Errorf("store: event cursor %q: %w", kvs[0].Value, err)
		}
	}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		st.Observed[strings.TrimPrefix(string(kv.Key), eventObservedPrefix)] = kv.Value
	}
	return st, nil
}

// EventCommit is one recorder step: the events derived from one sandbox
// change, the webhook deliveries they cause, the sandbox's new digest
// (nil with Forget: removed) and the new cursor (0: unchanged).
type EventCommit struct {
	Cursor     int64
	SandboxID  string
	Observed   []byte
	Forget     bool
	Events     []EventRecord
	Deliveries []DeliveryRecord
}

// maxTxnOps stays below etcd's default --max-txn-ops (128).
const maxTxnOps = 120

// CommitEvents writes c in one transaction, if l still leads.
func (s *Store) CommitEvents(ctx context.Context, l *Leadership, c EventCommit) error {
	var ops []clientv3.Op
	for _, e := range c.Events {
		ev := e.Event
		if err := validTeam(ev.SandboxTeamID); err != nil {
			return fmt.Errorf("store: commit events: %w", err)
		}
		if err := identity.ValidateSandboxID(ev.SandboxID); err != nil {
			return fmt.Errorf("store: commit events: %w: %v", errdefs.ErrInvalid, err)
		}
		b, err := json.Marshal(ev)
		if err != nil {
			return fmt.Errorf("store: encode event: %w", err)
		}
		ops = append(ops, clientv3.OpPut(eventLogKey(ev.SandboxTeamID, e.Seq, ev.SandboxID), string(b)),
			clientv3.OpPut(eventSbxKey(ev.SandboxTeamID, ev.SandboxID, e.Seq), string(b)))
	}
	for _, d := range c.Deliveries {
		op, err := putDelivery(deliveryKey(d.WebhookID, d.Seq), d)
		if err != nil {
			return err
		}
		ops = append(ops, op)
	}
	if c.SandboxID != "" {
		switch {
		case c.Forget:
			ops = append(ops, clientv3.OpDelete(eventObservedPrefix+c.SandboxID))
		case c.Observed != nil:
			ops = append(ops, clientv3.OpPut(eventObservedPrefix+c.SandboxID, string(c.Observed)))
		}
	}
	if c.Cursor > 0 {
		ops = append(ops, clientv3.OpPut(eventCursorKey, strconv.FormatInt(c.Cursor, 10)))
	}
	if len(ops) == 0 {
		return nil
	}
	if len(ops) > maxTxnOps {
		return fmt.Errorf("store: commit events: %w: %d operations in one step", errdefs.ErrInvalid, len(ops))
	}
	resp, err := s.cli.Txn(ctx).If(l.cmp()).Then(ops...).Commit()
	if err != nil {
		return wrapErr("commit events", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: commit events: %w", ErrNotLeader)
	}
	return nil
}

// SandboxChange is one change of a sandbox record seen by
// WatchSandboxesFrom (Record is nil when the record was deleted).
type SandboxChange struct {
	ID       string
	Record   *SandboxRecord
	Revision int64
	// Last is false when another change of the same revision follows.
	Last bool
}

// ListSandboxesAt lists every sandbox record and the revision the listing
// is consistent at.
func (s *Store) ListSandboxesAt(ctx context.Context) ([]SandboxEntry, int64, error) {
	resp, err := s.cli.Get(ctx, sandboxesPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, 0, wrapErr("list sandboxes", err)
	}
	out := make([]SandboxEntry, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var rec SandboxRecord
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			s.log.Warn("skipping undecodable sandbox record", "key", string(kv.Key), "err", err)
			continue
		}
		out = append(out, SandboxEntry{Record: rec, Revision: kv.ModRevision})
	}
	return out, resp.Header.Revision, nil
}

// WatchSandboxesFrom calls fn for every change of a sandbox record after
// revision after, in revision order, until ctx ends or fn fails. It
// returns ErrCompacted when that history is gone.
func (s *Store) WatchSandboxesFrom(ctx context.Context, after int64, fn func(SandboxChange) error) error {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	wch := s.cli.Watch(wctx, sandboxesPrefix, clientv3.WithPrefix(), clientv3.WithRev(after+1))
	for wr := range wch {
		if err := wr.Err(); err != nil {
			if wr.CompactRevision != 0 || errors.Is(err, rpctypes.ErrCompacted) {
				return fmt.Errorf("store: watch sandboxes from %d: %w", after, ErrCompacted)
			}
			return wrapErr("watch sandboxes", err)
		}
		for i, ev := range wr.Events {
			ch := SandboxChange{ID: strings.TrimPrefix(string(ev.Kv.Key), sandboxesPrefix), Revision: ev.Kv.ModRevision,
				Last: i == len(wr.Events)-1 || wr.Events[i+1].Kv.ModRevision != ev.Kv.ModRevision}
			if ev.Type != clientv3.EventTypeDelete {
				var rec SandboxRecord
				if err := json.Unmarshal(ev.Kv.Value, &rec); err != nil {
					s.log.Warn("skipping undecodable sandbox record in events watch", "err", err)
					continue
				}
				ch.Record = &rec
			}
			if err := fn(ch); err != nil {
				return err
			}
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return fmt.Errorf("store: watch sandboxes: %w: watch closed", errdefs.ErrUnavailable)
}

// EventQuery selects events of one team (and one sandbox when SandboxID
// is set), oldest first with Asc.
type EventQuery struct {
	TeamID    string
	SandboxID string
	Offset    int
	Limit     int
	Asc       bool
	// Types, when set, keeps only events of these types.
	Types []string
}

// eventPage is how many events a filtered listing reads at a time.
var eventPage int64 = 500

// ListEvents returns the events q selects.
func (s *Store) ListEvents(ctx context.Context, q EventQuery) ([]EventRecord, error) {
	if err := validTeam(q.TeamID); err != nil {
		return nil, fmt.Errorf("store: list events: %w", err)
	}
	if q.Offset < 0 || q.Limit <= 0 {
		return nil, fmt.Errorf("store: list events: %w: offset %d limit %d", errdefs.ErrInvalid, q.Offset, q.Limit)
	}
	pfx := eventLogPrefix + q.TeamID + "/"
	if q.SandboxID != "" {
		if err := identity.ValidateSandboxID(q.SandboxID); err != nil {
			return nil, fmt.Errorf("store: list events: %w: %v", errdefs.ErrInvalid, err)
		}
		pfx = eventSbxPrefix + q.TeamID + "/" + q.SandboxID + "/"
	}
	match := func(t string) bool { return len(q.Types) == 0 || slices.Contains(q.Types, t) }
	order := clientv3.SortDescend
	if q.Asc {
		order = clientv3.SortAscend
	}
	// Pages of keys in order; without a type filter the first page is
	// all it takes.
	chunk := int64(max(q.Offset+q.Limit, 100))
	if len(q.Types) > 0 {
		chunk = eventPage
	}
	start, end := pfx, clientv3.GetPrefixRangeEnd(pfx)
	out := []EventRecord{}
	skipped := 0
	for {
		resp, err := s.cli.Get(ctx, start, clientv3.WithRange(end), clientv3.WithSort(clientv3.SortByKey, order), clientv3.WithLimit(chunk))
		if err != nil {
			return nil, wrapErr("list events", err)
		}
		for _, kv := range resp.Kvs {
			var e EventRecord
			if err := json.Unmarshal(kv.Value, &e.Event); err != nil {
				s.log.Warn("skipping undecodable event", "key", string(kv.Key), "err", err)
				continue
			}
			if !match(e.Event.Type) {
				continue
			}
			if skipped < q.Offset {
				skipped++
				continue
			}
			rest := strings.TrimPrefix(string(kv.Key), pfx)
			if q.SandboxID == "" {
				rest, _, _ = strings.Cut(rest, "/")
			}
			e.Seq = rest
			out = append(out, e)
			if len(out) == q.Limit {
				return out, nil
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return out, nil
		}
		last := string(resp.Kvs[len(resp.Kvs)-1].Key)
		if q.Asc {
			start = last + "\x00"
		} else {
			end = last
		}
	}
}

// PruneEvents deletes every team's events recorded before cutoff and, per
// team, all but the newest maxPerTeam. It returns how many it deleted.
func (s *Store) PruneEvents(ctx context.Context, l *Leadership, cutoff time.Time, maxPerTeam int) (int, error) {
	resp, err := s.cli.Get(ctx, eventLogPrefix, clientv3.WithPrefix(), clientv3.WithKeysOnly(),
		clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
	if err != nil {
		return 0, wrapErr("prune events", err)
	}
	type entry struct{ team, seq, sbx string }
	byTeam := map[string][]entry{}
	for _, kv := range resp.Kvs {
		parts := strings.Split(strings.TrimPrefix(string(kv.Key), eventLogPrefix), "/")
		if len(parts) != 3 {
			continue
		}
		byTeam[parts[0]] = append(byTeam[parts[0]], entry{parts[0], parts[1], parts[2]})
	}
	cut := EventSeq(cutoff, 0, 0)
	var doomed []entry
	teams := make([]string, 0, len(byTeam))
	for t := range byTeam {
		teams = append(teams, t)
	}
	sort.Strings(teams)
	for _, t := range teams {
		es := byTeam[t]
		over := len(es) - maxPerTeam
		for i, e := range es {
			if e.seq < cut || (maxPerTeam > 0 && i < over) {
				doomed = append(doomed, e)
			}
		}
	}
	n := 0
	for len(doomed) > 0 {
		batch := doomed[:min(len(doomed), maxTxnOps/2)]
		doomed = doomed[len(batch):]
		ops := make([]clientv3.Op, 0, 2*len(batch))
		for _, e := range batch {
			ops = append(ops, clientv3.OpDelete(eventLogKey(e.team, e.seq, e.sbx)), clientv3.OpDelete(eventSbxKey(e.team, e.sbx, e.seq)))
		}
		r, err := s.cli.Txn(ctx).If(l.cmp()).Then(ops...).Commit()
		if err != nil {
			return n, wrapErr("prune events", err)
		}
		if !r.Succeeded {
			return n, fmt.Errorf("store: prune events: %w", ErrNotLeader)
		}
		n += len(batch)
	}
	return n, nil
}
