package events

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// dispatch posts the pending deliveries: each webhook's oldest first, one
// at a time per webhook, up to Concurrency webhooks at once.
func (s *Service) dispatch(ctx context.Context, l *store.Leadership) error {
	type result struct {
		hook, team string
		err        error
	}
	done := make(chan result)
	inflight := map[string]bool{}
	// A team's webhooks take at most perTeam of the slots: a tenant's
	// receivers that hang every attempt must not hold them all, holding
	// up every other team's deliveries.
	teamInflight := map[string]int{}
	perTeam := max(1, s.cfg.Concurrency/4)
	var wg sync.WaitGroup
	defer wg.Wait()
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		pending, err := s.st.PendingDeliveries(ctx)
		if err != nil && ctx.Err() == nil {
			s.log.Warn("events: read pending deliveries", "err", err)
		}
		now := time.Now() // retries wait real time (timers do), whatever the clock of the timestamps
		wake := s.cfg.PollInterval
		headSeen := map[string]bool{}
		for _, d := range pending {
			if headSeen[d.WebhookID] {
				continue
			}
			headSeen[d.WebhookID] = true
			if inflight[d.WebhookID] || len(inflight) >= s.cfg.Concurrency || teamInflight[d.TeamID] >= perTeam {
				continue
			}
			if wait := d.NextAt.Sub(now); wait > 0 {
				wake = min(wake, wait)
				continue
			}
			inflight[d.WebhookID] = true
			teamInflight[d.TeamID]++
			wg.Add(1)
			go func() {
				defer wg.Done()
				err := s.attempt(ctx, l, d)
				select {
				case done <- result{d.WebhookID, d.TeamID, err}:
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
			if teamInflight[r.team]--; teamInflight[r.team] <= 0 {
				delete(teamInflight, r.team)
			}
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
	if err != nil && ctx.Err() != nil {
		return ctx.Err() // cut short by a stop: not an attempt, the next leader sends it again
	}
	// An answer is recorded even while stopping (the leadership guard
	// still holds), so a stop seldom causes a redelivery.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
	defer cancel()
	ctx = rctx
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
			d.NextAt = time.Now().Add(s.retryAfter(d.Attempts)).UTC()
		}
	}
	s.log.Debug("events: delivery attempt", "webhook", d.WebhookID, "delivery", d.ID, "attempt", d.Attempts, "status", status, "err", d.LastError)
	if out == store.DeliveryGiveUp {
		s.log.Warn("events: delivery failed for good", "webhook", d.WebhookID, "delivery", d.ID, "attempts", d.Attempts, "err", d.LastError)
	}
	return ignoreGone(s.st.RecordAttempt(ctx, l, d, out, status, s.cfg.Clock()))
}

// recordTimeout bounds recording an attempt's outcome.
const recordTimeout = 5 * time.Second

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
		return 0, fmt.Errorf("post: %w", publicDialError(err))
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	return resp.StatusCode, nil
}

// publicDialError is err as the webhook's owner may see it (lastError):
// never the address a name resolved to, nor the resolver's answer, which
// would map the platform's internal names and addresses for a tenant
// who registers them.
func publicDialError(err error) error {
	var dnsErr *net.DNSError
	switch {
	case errors.Is(err, errdefs.ErrDenied):
		return fmt.Errorf("%w: the url resolves to a non-public address", errdefs.ErrDenied)
	case errors.As(err, &dnsErr):
		return errors.New("the url's host could not be resolved")
	}
	var opErr *net.OpError
	if errors.As(err, &opErr) && opErr.Err != nil {
		return fmt.Errorf("%s: %w", opErr.Op, opErr.Err)
	}
	return err
}
