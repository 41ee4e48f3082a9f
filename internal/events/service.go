package events

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// Defaults.
const (
	// DefaultRetention and DefaultMaxPerTeam bound the events kept: a
	// team's events older than 7 days, and beyond its newest 10000, are
	// deleted.
	DefaultRetention     = 7 * 24 * time.Hour
	DefaultMaxPerTeam    = 10000
	DefaultPruneInterval = time.Minute
	// DefaultMaxAttempts attempts a delivery gets before it is failed.
	DefaultMaxAttempts = 8
	// DefaultRetryInitial and DefaultRetryMax shape the backoff between
	// attempts (doubling, 20% jitter).
	DefaultRetryInitial   = time.Second
	DefaultRetryMax       = 5 * time.Minute
	DefaultAttemptTimeout = 10 * time.Second
	DefaultLeaseTTL       = 5 * time.Second
	DefaultConcurrency    = 8
	DefaultPollInterval   = time.Second
	// DefaultMaxWebhooksPerTeam bounds a team's registrations.
	DefaultMaxWebhooksPerTeam = 20
)

// Config configures a Service.
type Config struct {
	// Instance names this process in the leader election. Required.
	Instance string
	// Retention and MaxPerTeam bound the events kept (defaults 7 days,
	// 10000); PruneInterval is how often old ones are deleted (1 min).
	Retention     time.Duration
	MaxPerTeam    int
	PruneInterval time.Duration
	// AllowPrivate lets webhooks reach loopback, private and link-local
	// addresses (tests, closed labs). Default: refused, at registration
	// and on every dial.
	AllowPrivate bool
	// MaxAttempts (default 8) attempts per delivery, RetryInitial (1 s)
	// doubling up to RetryMax (5 min) between them; AttemptTimeout (10 s)
	// bounds one attempt.
	MaxAttempts    int
	RetryInitial   time.Duration
	RetryMax       time.Duration
	AttemptTimeout time.Duration
	// LeaseTTL is how long a dead leader keeps the election (5 s).
	LeaseTTL time.Duration
	// Concurrency bounds the webhooks posted to at once (8); a webhook's
	// own deliveries go out one at a time, in event order.
	Concurrency int
	// PollInterval is how often pending deliveries are looked at when
	// nothing else wakes the dispatcher (1 s).
	PollInterval time.Duration
	// MaxWebhooksPerTeam bounds a team's registrations (20).
	MaxWebhooksPerTeam int
	// Logger (default slog.Default()) and Clock (default time.Now).
	Logger *slog.Logger
	Clock  func() time.Time
}

func (c Config) withDefaults() Config {
	c.Retention = cmp.Or(c.Retention, DefaultRetention)
	c.MaxPerTeam = cmp.Or(c.MaxPerTeam, DefaultMaxPerTeam)
	c.PruneInterval = cmp.Or(c.PruneInterval, DefaultPruneInterval)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, DefaultMaxAttempts)
	c.RetryInitial = cmp.Or(c.RetryInitial, DefaultRetryInitial)
	c.RetryMax = cmp.Or(c.RetryMax, DefaultRetryMax)
	c.AttemptTimeout = cmp.Or(c.AttemptTimeout, DefaultAttemptTimeout)
	c.LeaseTTL = cmp.Or(c.LeaseTTL, DefaultLeaseTTL)
	c.Concurrency = cmp.Or(c.Concurrency, DefaultConcurrency)
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.MaxWebhooksPerTeam = cmp.Or(c.MaxWebhooksPerTeam, DefaultMaxWebhooksPerTeam)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Clock == nil {
		c.Clock = time.Now
	}
	return c
}

// Validate checks c (zero fields take their defaults).
func (c Config) Validate() error {
	switch {
	case c.Instance == "":
		return fmt.Errorf("events config: %w: instance required", errdefs.ErrInvalid)
	case c.Retention < 0 || c.PruneInterval < 0 || c.RetryInitial < 0 || c.RetryMax < 0 || c.AttemptTimeout < 0 ||
		c.LeaseTTL < 0 || c.PollInterval < 0:
		return fmt.Errorf("events config: %w: negative duration", errdefs.ErrInvalid)
	case c.MaxPerTeam < 0 || c.MaxAttempts < 0 || c.Concurrency < 0 || c.MaxWebhooksPerTeam < 0:
		return fmt.Errorf("events config: %w: negative bound", errdefs.ErrInvalid)
	case c.LeaseTTL != 0 && c.LeaseTTL < time.Second:
		return fmt.Errorf("events config: %w: lease ttl below 1 s", errdefs.ErrInvalid)
	}
	return nil
}

// Service records lifecycle events and delivers webhooks while this
// process leads the events election; every control plane runs one.
type Service struct {
	cfg    Config
	st     *store.Store
	log    *slog.Logger
	client *http.Client
	notify chan struct{}

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	once   sync.Once
}

// New returns a stopped Service; Start runs it.
func New(cfg Config, st *store.Store) (*Service, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if st == nil {
		return nil, fmt.Errorf("events: %w: store required", errdefs.ErrInvalid)
	}
	tr := &http.Transport{
		Proxy:                 nil, // a proxy would dial for us, past dialControl
		DialContext:           newDialer(cfg.AllowPrivate),
		TLSHandshakeTimeout:   cfg.AttemptTimeout,
		ResponseHeaderTimeout: cfg.AttemptTimeout,
		MaxIdleConnsPerHost:   2,
		IdleConnTimeout:       30 * time.Second,
	}
	s := &Service{cfg: cfg, st: st, log: cfg.Logger.With("component", "events"), notify: make(chan struct{}, 1),
		client: &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s, nil
}

// Config is the service's configuration with defaults filled.
func (s *Service) Config() Config { return s.cfg }

// Start campaigns for the leadership in the background and, while
// leading, records and delivers.
func (s *Service) Start() {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.run(s.ctx)
	}()
}

// Close stops the service: deliveries in flight are abandoned (they stay
// pending for the next leader), the leadership is resigned.
func (s *Service) Close() error {
	s.once.Do(func() {
		s.cancel()
		s.wg.Wait()
		s.client.CloseIdleConnections()
	})
	return nil
}

// Kick wakes the dispatcher (a webhook changed).
func (s *Service) Kick() {
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

func (s *Service) run(ctx context.Context) {
	retry := &backoff.ExponentialBackOff{InitialInterval: 200 * time.Millisecond, Multiplier: 2, MaxInterval: 5 * time.Second, RandomizationFactor: 0.2}
	retry.Reset()
	for ctx.Err() == nil {
		l, err := s.st.CampaignEvents(ctx, s.cfg.Instance, s.cfg.LeaseTTL)
		if err != nil {
			if ctx.Err() == nil {
				s.log.Warn("events: campaign failed; retrying", "err", err)
				sleep(ctx, retry.NextBackOff())
			}
			continue
		}
		retry.Reset()
		s.log.Info("events: leading", "instance", s.cfg.Instance)
		err = s.lead(ctx, l)
		if cerr := l.Close(); cerr != nil && ctx.Err() == nil {
			s.log.Debug("events: resign", "err", cerr)
		}
		if ctx.Err() == nil {
			s.log.Warn("events: leadership ended", "err", err)
			sleep(ctx, retry.NextBackOff())
		}
	}
}

// lead records, delivers and prunes until the leadership or ctx ends or
// one of them fails.
func (s *Service) lead(ctx context.Context, l *store.Leadership) error {
	lctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var wg sync.WaitGroup
	for _, fn := range []func(context.Context, *store.Leadership) error{s.record, s.dispatch, s.prune} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := fn(lctx, l); err != nil && lctx.Err() == nil {
				cancel(err)
			}
		}()
	}
	select {
	case <-l.Done():
		cancel(fmt.Errorf("events: %w: lease lost", store.ErrNotLeader))
	case <-lctx.Done():
	}
	wg.Wait()
	return context.Cause(lctx)
}

func (s *Service) prune(ctx context.Context, l *store.Leadership) error {
	t := time.NewTicker(s.cfg.PruneInterval)
	defer t.Stop()
	for {
		n, err := s.st.PruneEvents(ctx, l, s.cfg.Clock().Add(-s.cfg.Retention), s.cfg.MaxPerTeam)
		if errors.Is(err, store.ErrNotLeader) {
			return err
		}
		if err != nil && ctx.Err() == nil {
			s.log.Warn("events: prune failed", "err", err)
		} else if n > 0 {
			s.log.Info("events: pruned", "events", n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

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
		if err := s.st.CommitEvents(ctx, l, store.EventCommit{Cursor: cursor, SandboxID: id, Forget: true}); err != nil {
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
	now := s.cfg.Clock().UTC()
	c := store.EventCommit{Cursor: cursor, SandboxID: id, Observed: nb}
	var hooks []store.WebhookRecord
	if len(ds) > 0 {
		var err error
		if hooks, err = s.st.ListWebhooks(ctx, rec.TeamID); err != nil {
			return err
		}
	}
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
			if h.Subscribed(d.Type) {
				c.Deliveries = append(c.Deliveries, store.DeliveryRecord{ID: NewID(), WebhookID: h.ID, TeamID: h.TeamID, Seq: seq,
					EventID: ev.ID, EventType: ev.Type, Body: body, State: store.DeliveryPending, CreatedAt: now})
			}
		}
	}
	if err := s.st.CommitEvents(ctx, l, c); err != nil {
		return err
	}
	obs[id] = next
	for _, e := range c.Events {
		s.log.Debug("events: recorded", "type", e.Event.Type, "sandbox", id, "team", rec.TeamID)
	}
	if len(c.Deliveries) > 0 {
		s.Kick()
	}
	return nil
}

// dispatch posts the pending deliveries: each webhook's oldest first, one
// at a time per webhook, up to Concurrency webhooks at once.
func (s *Service) dispatch(ctx context.Context, l *store.Leadership) error {
	type result struct {
		hook string
		err  error
	}
	done := make(chan result)
	inflight := map[string]bool{}
	var wg sync.WaitGroup
	defer wg.Wait()
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		pending, err := s.st.PendingDeliveries(ctx)
		if err != nil && ctx.Err() == nil {
			s.log.Warn("events: read pending deliveries", "err", err)
		}
		now := s.cfg.Clock()
		wake := s.cfg.PollInterval
		headSeen := map[string]bool{}
		for _, d := range pending {
			if headSeen[d.WebhookID] {
				continue
			}
			headSeen[d.WebhookID] = true
			if inflight[d.WebhookID] || len(inflight) >= s.cfg.Concurrency {
				continue
			}
			if wait := d.NextAt.Sub(now); wait > 0 {
				wake = min(wake, wait)
				continue
			}
			inflight[d.WebhookID] = true
			wg.Add(1)
			go func() {
				defer wg.Done()
				err := s.attempt(ctx, l, d)
				select {
				case done <- result{d.WebhookID, err}:
				case <-ctx.Done():
				}
			}()
		}
		timer.Reset(wake)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case r := <-done:
			delete(inflight, r.hook)
			if errors.Is(r.err, store.ErrNotLeader) {
				return r.err
			}
			if r.err != nil && ctx.Err() == nil {
				s.log.Warn("events: delivery bookkeeping failed", "webhook", r.hook, "err", r.err)
			}
		case <-s.notify:
		case <-timer.C:
		}
	}
}

// attempt posts d once and records the outcome.
func (s *Service) attempt(ctx context.Context, l *store.Leadership, d store.DeliveryRecord) error {
	hook, _, err := s.st.GetWebhook(ctx, d.TeamID, d.WebhookID)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil // deleted with its deliveries
	}
	if err != nil {
		return err
	}
	if !hook.Subscribed(d.EventType) {
		return ignoreGone(s.st.RecordAttempt(ctx, l, d, store.DeliveryDrop, 0, s.cfg.Clock()))
	}
	status, err := s.post(ctx, hook, d)
	if ctx.Err() != nil {
		return ctx.Err() // not an attempt: the next leader sends it again
	}
	d.Attempts++
	d.LastError = ""
	switch {
	case err != nil:
		d.LastError = err.Error()
	case status < 200 || status > 299:
		d.LastError = fmt.Sprintf("status %d", status)
	}
	out := store.DeliveryDone
	if d.LastError != "" {
		out = store.DeliveryRetry
		if d.Attempts >= s.cfg.MaxAttempts {
			out = store.DeliveryGiveUp
		} else {
			d.NextAt = s.cfg.Clock().Add(s.retryAfter(d.Attempts)).UTC()
		}
	}
	s.log.Debug("events: delivery attempt", "webhook", d.WebhookID, "delivery", d.ID, "attempt", d.Attempts, "status", status, "err", d.LastError)
	if out == store.DeliveryGiveUp {
		s.log.Warn("events: delivery failed for good", "webhook", d.WebhookID, "delivery", d.ID, "attempts", d.Attempts, "err", d.LastError)
	}
	return ignoreGone(s.st.RecordAttempt(ctx, l, d, out, status, s.cfg.Clock()))
}

func ignoreGone(err error) error {
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	return err
}

// retryAfter is the wait after the n-th failed attempt: the backoff's n-th
// interval (exponential, jittered, capped).
func (s *Service) retryAfter(n int) time.Duration {
	b := &backoff.ExponentialBackOff{InitialInterval: s.cfg.RetryInitial, RandomizationFactor: 0.2, Multiplier: 2, MaxInterval: s.cfg.RetryMax}
	b.Reset()
	d := s.cfg.RetryInitial
	for range n {
		d = b.NextBackOff()
	}
	return d
}

// post sends one attempt and returns the HTTP status.
func (s *Service) post(ctx context.Context, hook store.WebhookRecord, d store.DeliveryRecord) (int, error) {
	u, err := ParseWebhookURL(hook.URL, s.cfg.AllowPrivate)
	if err != nil {
		return 0, err
	}
	actx, cancel := context.WithTimeout(ctx, s.cfg.AttemptTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(actx, http.MethodPost, u.String(), bytes.NewReader(d.Body))
	if err != nil {
		return 0, fmt.Errorf("%w: %v", errdefs.ErrInvalid, err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "space-webhooks/1")
	req.Header.Set(e2bapi.HeaderWebhookID, hook.ID)
	req.Header.Set(e2bapi.HeaderDeliveryID, d.ID)
	req.Header.Set(e2bapi.HeaderSignatureVersion, SignatureVersion)
	req.Header.Set(e2bapi.HeaderSignature, Sign(hook.Secret, d.Body))
	resp, err := s.client.Do(req)
	if err != nil {
		// The url error repeats the URL (which may carry a token): keep
		// only its cause.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return 0, fmt.Errorf("post: %w", err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	return resp.StatusCode, nil
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
