package store

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/url"
	"sort"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/errdefs"
)

// Webhooks (E2B's /events/webhooks) and their deliveries:
//
//	webhooks/hooks/<team>/<id>          the registration, secret included
//	webhooks/status/<id>                delivery counters and last result
//	webhooks/pending/<id>/<seq>         a delivery not yet acknowledged
//	webhooks/failed/<id>/<seq>          a delivery given up on (newest kept)
const (
	webhooksPrefix       = prefix + "webhooks/"
	webhookHooksPrefix   = webhooksPrefix + "hooks/"
	webhookStatusPrefix  = webhooksPrefix + "status/"
	webhookPendingPrefix = webhooksPrefix + "pending/"
	webhookFailedPrefix  = webhooksPrefix + "failed/"
)

// MaxFailedDeliveries is how many given-up deliveries a webhook keeps.
const MaxFailedDeliveries = 20

// WebhookRecord is a registered webhook. Secret signs its deliveries: it is
// never returned by the API nor logged (LogValue omits it).
type WebhookRecord struct {
	ID        string    `json:"id"`
	TeamID    string    `json:"team_id"`
	Name      string    `json:"name"`
	URL       string    `json:"url"`
	Enabled   bool      `json:"enabled"`
	Events    []string  `json:"events"`
	Secret    string    `json:"secret"`
	CreatedAt time.Time `json:"created_at"`
}

// LogValue renders the record without its secret, and its URL as scheme
// and host only (a path or query may carry a receiver's token).
func (w WebhookRecord) LogValue() slog.Value {
	host := "?"
	if u, err := url.Parse(w.URL); err == nil {
		host = u.Scheme + "://" + u.Host
	}
	return slog.GroupValue(slog.String("webhook", w.ID), slog.String("team", w.TeamID), slog.String("url", host))
}

// Subscribed reports whether w is enabled and takes events of type t.
func (w WebhookRecord) Subscribed(t string) bool {
	if !w.Enabled {
		return false
	}
	for _, e := range w.Events {
		if e == t {
			return true
		}
	}
	return false
}

// WebhookStatus is a webhook's delivery counters and last result.
type WebhookStatus struct {
	Delivered  int64     `json:"delivered"`
	Failed     int64     `json:"failed"`
	LastAt     time.Time `json:"last_at,omitzero"`
	LastStatus int       `json:"last_status,omitempty"`
	LastError  string    `json:"last_error,omitempty"`
}

// Delivery states.
const (
	DeliveryPending = "pending"
	DeliveryFailed  = "failed"
)

// DeliveryRecord is one event to post to one webhook. ID is the stable
// e2b-delivery-id: the same on every attempt, so receivers de-duplicate.
type DeliveryRecord struct {
	ID        string `json:"id"`
	WebhookID string `json:"webhook_id"`
	TeamID    string `json:"team_id"`
	// Seq is the event's sequence key: a webhook's deliveries go out in
	// Seq order.
	Seq       string `json:"seq"`
	EventID   string `json:"event_id"`
	EventType string `json:"event_type"`
	// Body is the exact payload posted (and signed).
	Body      json.RawMessage `json:"body"`
	State     string          `json:"state"`
	Attempts  int             `json:"attempts"`
	NextAt    time.Time       `json:"next_at,omitzero"`
	LastError string          `json:"last_error,omitempty"`
	CreatedAt time.Time       `json:"created_at"`
	FailedAt  time.Time       `json:"failed_at,omitzero"`
}

func webhookKey(team, id string) string   { return webhookHooksPrefix + team + "/" + id }
func deliveryKey(hook, seq string) string { return webhookPendingPrefix + hook + "/" + seq }
func failedKey(hook, seq string) string   { return webhookFailedPrefix + hook + "/" + seq }
func validHookID(id string) error {
	if id == "" || len(id) > 64 || strings.ContainsAny(id, "/ \t\r\n") {
		return fmt.Errorf("%w: webhook id %q", errdefs.ErrInvalid, id)
	}
	return nil
}

func putDelivery(key string, d DeliveryRecord) (clientv3.Op, error) {
	if err := validHookID(d.WebhookID); err != nil || d.ID == "" || d.Seq == "" || strings.Contains(d.Seq, "/") {
		return clientv3.Op{}, fmt.Errorf("store: delivery: %w: webhook %q id %q seq %q", errdefs.ErrInvalid, d.WebhookID, d.ID, d.Seq)
	}
	b, err := json.Marshal(d)
	if err != nil {
		return clientv3.Op{}, fmt.Errorf("store: encode delivery: %w", err)
	}
	return clientv3.OpPut(key, string(b)), nil
}

// CreateWebhook stores a new webhook (errdefs.ErrConflict if the id
// exists, errdefs.ErrInvalid past maxPerTeam webhooks of its team).
func (s *Store) CreateWebhook(ctx context.Context, w WebhookRecord, maxPerTeam int) error {
	if err := validTeam(w.TeamID); err != nil {
		return fmt.Errorf("store: create webhook: %w", err)
	}
	if err := validHookID(w.ID); err != nil {
		return fmt.Errorf("store: create webhook: %w", err)
	}
	if maxPerTeam > 0 {
		n, err := s.cli.Get(ctx, webhookHooksPrefix+w.TeamID+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			return wrapErr("create webhook", err)
		}
		if n.Count >= int64(maxPerTeam) {
			return fmt.Errorf("store: create webhook: %w: team has %d webhooks (at most %d)", errdefs.ErrInvalid, n.Count, maxPerTeam)
		}
	}
	b, err := json.Marshal(w)
	if err != nil {
		return fmt.Errorf("store: encode webhook: %w", err)
	}
	k := webhookKey(w.TeamID, w.ID)
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).Then(clientv3.OpPut(k, string(b))).Commit()
	if err != nil {
		return wrapErr("create webhook", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: create webhook %s: %w: already exists", w.ID, errdefs.ErrConflict)
	}
	return nil
}

// GetWebhook returns team's webhook id, or errdefs.ErrNotFound (also for
// another team's webhook).
func (s *Store) GetWebhook(ctx context.Context, team, id string) (WebhookRecord, int64, error) {
	if validTeam(team) != nil || validHookID(id) != nil {
		return WebhookRecord{}, 0, fmt.Errorf("store: webhook %s: %w", id, errdefs.ErrNotFound)
	}
	resp, err := s.cli.Get(ctx, webhookKey(team, id))
	if err != nil {
		return WebhookRecord{}, 0, wrapErr("get webhook", err)
	}
	if len(resp.Kvs) == 0 {
		return WebhookRecord{}, 0, fmt.Errorf("store: webhook %s: %w", id, errdefs.ErrNotFound)
	}
	var w WebhookRecord
	if err := json.Unmarshal(resp.Kvs[0].Value, &w); err != nil {
		return WebhookRecord{}, 0, fmt.Errorf("store: decode webhook %s: %w", id, err)
	}
	return w, resp.Kvs[0].ModRevision, nil
}

// ListWebhooks returns team's webhooks sorted by creation time.
func (s *Store) ListWebhooks(ctx context.Context, team string) ([]WebhookRecord, error) {
	if err := validTeam(team); err != nil {
		return nil, fmt.Errorf("store: list webhooks: %w", err)
	}
	resp, err := s.cli.Get(ctx, webhookHooksPrefix+team+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list webhooks", err)
	}
	out := make([]WebhookRecord, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var w WebhookRecord
		if err := json.Unmarshal(kv.Value, &w); err != nil {
			s.log.Warn("skipping undecodable webhook", "key", string(kv.Key), "err", err)
			continue
		}
		out = append(out, w)
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].CreatedAt.Equal(out[j].CreatedAt) {
			return out[i].CreatedAt.Before(out[j].CreatedAt)
		}
		return out[i].ID < out[j].ID
	})
	return out, nil
}

// UpdateWebhook applies fn to team's webhook id and writes it back
// (retrying on a concurrent write).
func (s *Store) UpdateWebhook(ctx context.Context, team, id string, fn func(*WebhookRecord) error) (WebhookRecord, error) {
	for range 8 {
		w, rev, err := s.GetWebhook(ctx, team, id)
		if err != nil {
			return WebhookRecord{}, err
		}
		if err := fn(&w); err != nil {
			return WebhookRecord{}, err
		}
		w.ID, w.TeamID = id, team
		b, err := json.Marshal(w)
		if err != nil {
			return WebhookRecord{}, fmt.Errorf("store: encode webhook: %w", err)
		}
		k := webhookKey(team, id)
		resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(k), "=", rev)).Then(clientv3.OpPut(k, string(b))).Commit()
		if err != nil {
			return WebhookRecord{}, wrapErr("update webhook", err)
		}
		if resp.Succeeded {
			return w, nil
		}
	}
	return WebhookRecord{}, fmt.Errorf("store: update webhook %s: %w: too much contention", id, errdefs.ErrConflict)
}

// DeleteWebhook removes team's webhook id with its status and every
// delivery of it (errdefs.ErrNotFound if there is none).
func (s *Store) DeleteWebhook(ctx context.Context, team, id string) error {
	if validTeam(team) != nil || validHookID(id) != nil {
		return fmt.Errorf("store: webhook %s: %w", id, errdefs.ErrNotFound)
	}
	k := webhookKey(team, id)
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), ">", 0)).Then(
		clientv3.OpDelete(k),
		clientv3.OpDelete(webhookStatusPrefix+id),
		clientv3.OpDelete(webhookPendingPrefix+id+"/", clientv3.WithPrefix()),
		clientv3.OpDelete(webhookFailedPrefix+id+"/", clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return wrapErr("delete webhook", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: webhook %s: %w", id, errdefs.ErrNotFound)
	}
	return nil
}

// WebhookDeliveries returns webhook id's status, its pending count and its
// failed deliveries, newest first.
func (s *Store) WebhookDeliveries(ctx context.Context, id string) (WebhookStatus, int, []DeliveryRecord, error) {
	var st WebhookStatus
	if err := validHookID(id); err != nil {
		return st, 0, nil, fmt.Errorf("store: webhook deliveries: %w", err)
	}
	resp, err := s.cli.Txn(ctx).Then(
		clientv3.OpGet(webhookStatusPrefix+id),
		clientv3.OpGet(webhookPendingPrefix+id+"/", clientv3.WithPrefix(), clientv3.WithCountOnly()),
		clientv3.OpGet(webhookFailedPrefix+id+"/", clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend)),
	).Commit()
	if err != nil {
		return st, 0, nil, wrapErr("webhook deliveries", err)
	}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		if err := json.Unmarshal(kvs[0].Value, &st); err != nil {
			return st, 0, nil, fmt.Errorf("store: decode webhook status: %w", err)
		}
	}
	pending := int(resp.Responses[1].GetResponseRange().Count)
	var failed []DeliveryRecord
	for _, kv := range resp.Responses[2].GetResponseRange().Kvs {
		var d DeliveryRecord
		if json.Unmarshal(kv.Value, &d) == nil {
			failed = append(failed, d)
		}
	}
	return st, pending, failed, nil
}

// PendingCount returns how many deliveries of webhook id are pending.
func (s *Store) PendingCount(ctx context.Context, id string) (int, error) {
	if err := validHookID(id); err != nil {
		return 0, fmt.Errorf("store: pending count: %w", err)
	}
	resp, err := s.cli.Get(ctx, webhookPendingPrefix+id+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return 0, wrapErr("pending count", err)
	}
	return int(resp.Count), nil
}

// PendingDeliveries returns every pending delivery, by webhook then Seq.
func (s *Store) PendingDeliveries(ctx context.Context) ([]DeliveryRecord, error) {
	resp, err := s.cli.Get(ctx, webhookPendingPrefix, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
	if err != nil {
		return nil, wrapErr("pending deliveries", err)
	}
	out := make([]DeliveryRecord, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var d DeliveryRecord
		if err := json.Unmarshal(kv.Value, &d); err != nil {
			s.log.Warn("skipping undecodable delivery", "key", string(kv.Key), "err", err)
			continue
		}
		out = append(out, d)
	}
	return out, nil
}

// DeliveryOutcome is how one attempt ended.
type DeliveryOutcome int

// Outcomes.
const (
	// DeliveryRetry: failed, try again at NextAt.
	DeliveryRetry DeliveryOutcome = iota
	// DeliveryDone: acknowledged (2xx): the delivery is removed.
	DeliveryDone
	// DeliveryGiveUp: failed for the last time: moved to the failed list.
	DeliveryGiveUp
	// DeliveryDrop: no longer deliverable (webhook disabled or changed):
	// removed without counting.
	DeliveryDrop
)

// RecordAttempt records an attempt at d (d carries the new Attempts,
// NextAt and LastError) with its HTTP status (0: no answer), if l still
// leads and d is still pending. The webhook's status is updated in the
// same transaction.
func (s *Store) RecordAttempt(ctx context.Context, l *Leadership, d DeliveryRecord, out DeliveryOutcome, status int, at time.Time) error {
	pk := deliveryKey(d.WebhookID, d.Seq)
	sk := webhookStatusPrefix + d.WebhookID
	hk := webhookKey(d.TeamID, d.WebhookID)
	for range 8 {
		cur, err := s.cli.Get(ctx, sk)
		if err != nil {
			return wrapErr("record attempt", err)
		}
		var st WebhookStatus
		var srev int64
		if len(cur.Kvs) > 0 {
			srev = cur.Kvs[0].ModRevision
			_ = json.Unmarshal(cur.Kvs[0].Value, &st)
		}
		if out != DeliveryDrop {
			st.LastAt, st.LastStatus, st.LastError = at.UTC(), status, d.LastError
		}
		var ops []clientv3.Op
		switch out {
		case DeliveryRetry:
			d.State = DeliveryPending
			op, err := putDelivery(pk, d)
			if err != nil {
				return err
			}
			ops = append(ops, op)
		case DeliveryDone:
			st.Delivered++
			st.LastError = ""
			ops = append(ops, clientv3.OpDelete(pk))
		case DeliveryGiveUp:
			st.Failed++
			d.State, d.FailedAt = DeliveryFailed, at.UTC()
			op, err := putDelivery(failedKey(d.WebhookID, d.Seq), d)
			if err != nil {
				return err
			}
			ops = append(ops, clientv3.OpDelete(pk), op)
		case DeliveryDrop:
			ops = append(ops, clientv3.OpDelete(pk))
		}
		if out != DeliveryDrop {
			// The status follows the webhook: none is written once it is gone.
			b, _ := json.Marshal(st)
			ops = append(ops, clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(hk), ">", 0)},
				[]clientv3.Op{clientv3.OpPut(sk, string(b))}, nil))
		}
		cmps := []clientv3.Cmp{l.cmp(), clientv3.Compare(clientv3.CreateRevision(pk), ">", 0),
			clientv3.Compare(clientv3.ModRevision(sk), "=", srev)}
		resp, err := s.cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
		if err != nil {
			return wrapErr("record attempt", err)
		}
		if resp.Succeeded {
			if out == DeliveryGiveUp {
				s.trimFailed(ctx, d.WebhookID)
			}
			return nil
		}
		// Why it failed: leadership, the delivery gone, or the status moved.
		chk, err := s.cli.Txn(ctx).If(l.cmp()).Then(clientv3.OpGet(pk, clientv3.WithCountOnly())).Commit()
		if err != nil {
			return wrapErr("record attempt", err)
		}
		if !chk.Succeeded {
			return fmt.Errorf("store: record attempt: %w", ErrNotLeader)
		}
		if chk.Responses[0].GetResponseRange().Count == 0 {
			return fmt.Errorf("store: delivery %s: %w", d.ID, errdefs.ErrNotFound)
		}
	}
	return fmt.Errorf("store: record attempt %s: %w: too much contention", d.ID, errdefs.ErrConflict)
}

// trimFailed keeps the newest MaxFailedDeliveries failed deliveries.
func (s *Store) trimFailed(ctx context.Context, hook string) {
	resp, err := s.cli.Get(ctx, webhookFailedPrefix+hook+"/", clientv3.WithPrefix(), clientv3.WithKeysOnly(),
		clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
	if err != nil || len(resp.Kvs) <= MaxFailedDeliveries {
		return
	}
	for _, kv := range resp.Kvs[:len(resp.Kvs)-MaxFailedDeliveries] {
		_, _ = s.cli.Delete(ctx, string(kv.Key))
	}
}
