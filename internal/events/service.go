package events

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"

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
	// DefaultMaxPendingPerWebhook bounds a webhook's pending deliveries:
	// a receiver that never answers (a tenant's own choice) must not grow
	// etcd, nor the dispatcher's every read of the pending deliveries,
	// without bound.
	DefaultMaxPendingPerWebhook = 1000
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
	// Concurrency bounds the webhooks posted to at once (8), a quarter of
	// them (at least 1) of one team; a webhook's own deliveries go out one
	// at a time, in event order.
	Concurrency int
	// PollInterval is how often pending deliveries are looked at when
	// nothing else wakes the dispatcher (1 s).
	PollInterval time.Duration
	// MaxWebhooksPerTeam bounds a team's registrations (20).
	MaxWebhooksPerTeam int
	// MaxPendingPerWebhook bounds a webhook's pending deliveries (1000):
	// an event past it is not queued for that webhook (logged at warn).
	MaxPendingPerWebhook int
	// Logger (default slog.Default()) and Clock (default time.Now; the
	// time of events and of pruning: retries wait real time).
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
	c.MaxPendingPerWebhook = cmp.Or(c.MaxPendingPerWebhook, DefaultMaxPendingPerWebhook)
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
	case c.MaxPerTeam < 0 || c.MaxAttempts < 0 || c.Concurrency < 0 || c.MaxWebhooksPerTeam < 0 || c.MaxPendingPerWebhook < 0:
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

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
