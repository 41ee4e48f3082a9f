package events

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/store"
)

// record follows the sandbox records from the durable cursor and records
// what each change means.
func (s *Service) record(ctx context.Context, l *store.Leadership) error {
	retry := &backoff.ExponentialBackOff{InitialInterval: 100 * time.Millisecond, Multiplier: 2, MaxInterval: 5 * time.Second, RandomizationFactor: 0.2}
	retry.Reset()
	for {
		state, err := s.st.LoadEventState(ctx)
		if err == nil {
			obs := make(map[string]observed, len(state.Observed))
			for id, b := range state.Observed {
				obs[id] = decodeObserved(b)
			}
			cursor := state.Cursor
			if cursor == 0 {
				cursor, err = s.resync(ctx, l, obs)
			}
			if err == nil {
				err = s.st.WatchSandboxesFrom(ctx, cursor, func(ch store.SandboxChange) error {
					retry.Reset()
					c := ch.Revision
					if !ch.Last {
						c-- // another change of this revision is still to record
					}
					return s.apply(ctx, l, obs, ch.ID, ch.Record, ch.Revision, c)
				})
			}
			if errors.Is(err, store.ErrCompacted) {
				s.log.Warn("events: history compacted past the cursor; resyncing from the records", "cursor", cursor)
				_, err = s.resync(ctx, l, obs)
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, store.ErrNotLeader) {
			return err
		}
		if err != nil {
			s.log.Warn("events: recorder failed; restarting from the cursor", "err", err)
		}
		sleep(ctx, retry.NextBackOff())
	}
}

// resync derives from the current records against the digests (what a
// missing stretch of history amounts to) and returns the new cursor.
func (s *Service) resync(ctx context.Context, l *store.Leadership, obs map[string]observed) (int64, error) {
	entries, rev, err := s.st.ListSandboxesAt(ctx)
	if err != nil {
		return 0, err
	}
	seen := map[string]bool{}
	for _, e := range entries {
		rec := e.Record
		seen[rec.ID] = true
		if err := s.apply(ctx, l, obs, rec.ID, &rec, rev, 0); err != nil {
			return 0, err
		}
	}
	for id := range obs {
		if !seen[id] {
			if err := s.apply(ctx, l, obs, id, nil, rev, 0); err != nil {
				return 0, err
			}
		}
	}
	if err := s.st.CommitEvents(ctx, l, store.EventCommit{Cursor: rev}); err != nil {
		return 0, err
	}
	return rev, nil
}

// apply records the events of one sandbox change (rec nil: the record was
// deleted) and moves the cursor to cursor (0: leave it).
func (s *Service) apply(ctx context.Context, l *store.Leadership, obs map[string]observed, id string, rec *store.SandboxRecord, rev, cursor int64) error {
	prev, known := obs[id]
	if rec == nil {
		if !known {
			return s.st.CommitEvents(ctx, l, store.EventCommit{Cursor: cursor})
		}
		c := store.EventCommit{Cursor: cursor, SandboxID: id, Forget: true}
		if prev.Created && !prev.Ended && prev.Team != "" {
			// Purged before its end was seen (a resync after a gap in
			// the history): it ended all the same.
			d := derived{Type: e2bapi.EventKilled, Data: e2bapi.EventData{Reason: "ended unobserved", Generation: prev.Gen, WorkerID: prev.Worker}}
			if err := s.addEvents(ctx, &c, prev.sandbox(id), []derived{d}, rev); err != nil {
				return err
			}
		}
		if err := s.commit(ctx, l, c, id); err != nil {
			return err
		}
		delete(obs, id)
		return nil
	}
	next, ds := derive(prev, *rec)
	pb, _ := json.Marshal(prev)
	nb, _ := json.Marshal(next)
	if known && len(ds) == 0 && bytes.Equal(pb, nb) {
		return nil // nothing new: the cursor may lag, replaying this is a no-op
	}
	c := store.EventCommit{Cursor: cursor, SandboxID: id, Observed: nb}
	if err := s.addEvents(ctx, &c, *rec, ds, rev); err != nil {
		return err
	}
	if err := s.commit(ctx, l, c, id); err != nil {
		return err
	}
	obs[id] = next
	return nil
}

// addEvents adds to c the events ds of sandbox rec (derived from the
// change at revision rev) and a delivery for each webhook taking one.
func (s *Service) addEvents(ctx context.Context, c *store.EventCommit, rec store.SandboxRecord, ds []derived, rev int64) error {
	if len(ds) == 0 {
		return nil
	}
	hooks, err := s.st.ListWebhooks(ctx, rec.TeamID)
	if err != nil {
		return err
	}
	// Room left in each webhook's queue: a receiver that never answers
	// (the tenant chose its URL) holds its deliveries for minutes each,
	// and they must not pile up without bound.
	room := make(map[string]int, len(hooks))
	for _, h := range hooks {
		n, err := s.st.PendingCount(ctx, h.ID)
		if err != nil {
			return err
		}
		room[h.ID] = s.cfg.MaxPendingPerWebhook - n
	}
	now := s.cfg.Clock().UTC()
	for i, d := range ds {
		data, err := json.Marshal(d.Data)
		if err != nil {
			return fmt.Errorf("events: encode event data: %w", err)
		}
		ev := e2bapi.SandboxEvent{Version: e2bapi.EventVersion, ID: NewID(), Type: d.Type, EventData: data,
			SandboxExecutionID: rec.Route.ExecutionID, SandboxID: rec.ID, SandboxTeamID: rec.TeamID,
			SandboxTemplateID: rec.TemplateID, Timestamp: now}
		seq := store.EventSeq(now, rev, i)
		c.Events = append(c.Events, store.EventRecord{Seq: seq, Event: ev})
		body, err := json.Marshal(ev)
		if err != nil {
			return fmt.Errorf("events: encode event: %w", err)
		}
		for _, h := range hooks {
			if !h.Subscribed(d.Type) {
				continue
			}
			if room[h.ID] <= 0 {
				s.log.Warn("events: webhook has too many pending deliveries; event not queued for it",
					"webhook", h.ID, "team", h.TeamID, "event", ev.ID, "type", ev.Type, "max_pending", s.cfg.MaxPendingPerWebhook)
				continue
			}
			room[h.ID]--
			c.Deliveries = append(c.Deliveries, store.DeliveryRecord{ID: NewID(), WebhookID: h.ID, TeamID: h.TeamID, Seq: seq,
				EventID: ev.ID, EventType: ev.Type, Body: body, State: store.DeliveryPending, CreatedAt: now})
		}
	}
	return nil
}

// commit writes c and wakes the dispatcher when it holds deliveries.
func (s *Service) commit(ctx context.Context, l *store.Leadership, c store.EventCommit, id string) error {
	if err := s.st.CommitEvents(ctx, l, c); err != nil {
		return err
	}
	for _, e := range c.Events {
		s.log.Debug("events: recorded", "type", e.Event.Type, "sandbox", id, "team", e.Event.SandboxTeamID)
	}
	if len(c.Deliveries) > 0 {
		s.Kick()
	}
	return nil
}
