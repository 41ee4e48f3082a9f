package controlplane

import (
	"context"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/spacesbx/space/internal/store"
)

// Leadership of the control plane.
//
// Every replica serves the whole API (request handling keeps no state of
// its own: records change only through revision-guarded transactions).
// What must run once in the cluster runs only on the replica that leads
// the "controlplane" election (store.Campaign, LeaderElection): the reaper
// loop and every step it starts (timeouts, auto-pause, lost-execution
// recovery, stale operations, tombstones, completing an interrupted key
// rotation), and the watch that wakes it. The lease is Config.LeaderTTL: a
// crashed leader is replaced within it; Close resigns at once. Losing the
// lease (etcd unreachable for the TTL) cancels the singletons' context and
// waits for their steps before campaigning again. The events recorder has
// its own election (internal/events). Team metrics are sampled by every
// replica into its own memory (teammetrics.go): nothing shared is written.

// LeaderElection is the name of the control plane's election
// (/space/elections/controlplane/ in the store).
const LeaderElection = "controlplane"

// runLeader campaigns until Close and runs the singletons while leading.
func (s *Server) runLeader() {
	defer s.wg.Done()
	retry := &backoff.ExponentialBackOff{InitialInterval: 200 * time.Millisecond, Multiplier: 2, MaxInterval: 5 * time.Second, RandomizationFactor: 0.2}
	retry.Reset()
	for s.ctx.Err() == nil {
		l, err := s.st.Campaign(s.ctx, LeaderElection, s.instance, s.cfg.LeaderTTL)
		if err != nil {
			if s.ctx.Err() == nil {
				s.log.Warn("control plane election: campaign failed; retrying", "instance", s.instance, "err", err)
				sleepCtx(s.ctx, retry.NextBackOff())
			}
			continue
		}
		retry.Reset()
		s.lead(l)
		if s.ctx.Err() == nil {
			sleepCtx(s.ctx, retry.NextBackOff())
		}
	}
}

// lead runs the singletons until the leadership or the server ends.
func (s *Server) lead(l *store.Leadership) {
	s.leading.Store(true)
	s.obs.leader.Set(1)
	s.obs.leaderChanges.WithLabelValues("won").Inc()
	s.log.Info("control plane leadership won: running the reaper", "instance", s.instance)
	lctx, cancel := context.WithCancel(s.ctx)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		s.reapLoop(lctx)
	}()
	go func() {
		defer wg.Done()
		// A lost execution is recovered at once, not on the next tick.
		_ = s.st.WatchLost(lctx, func() {
			select {
			case s.reapNow <- struct{}{}:
			default:
			}
		})
	}()
	lost := false
	select {
	case <-l.Done():
		lost = true
	case <-s.ctx.Done():
	}
	cancel()
	wg.Wait()
	s.leading.Store(false)
	s.obs.leader.Set(0)
	s.obs.leaderChanges.WithLabelValues("lost").Inc()
	if lost {
		s.log.Warn("control plane leadership lost (etcd lease expired): singletons stopped", "instance", s.instance)
	} else {
		s.log.Info("control plane leadership resigned", "instance", s.instance)
	}
	if err := l.Close(); err != nil && !lost {
		s.log.Debug("control plane election: resign", "err", err)
	}
}

// Leading reports whether this replica leads the control plane election
// now (runs the singletons).
func (s *Server) Leading() bool { return s.leading.Load() }

// Instance is this replica's instance name (its lifecycle operations'
// owner and its candidate id in the election).
func (s *Server) Instance() string { return s.instance }

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
