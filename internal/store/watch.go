package store

import (
	"context"
	"time"

	"github.com/cenkalti/backoff/v5"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// watchLoop reads key (or the prefix) and calls load with the snapshot, then
// calls event for every change. When the watch breaks (compaction, lost
// connection) it reads a fresh snapshot and continues. It returns ctx.Err()
// when ctx ends.
func (s *Store) watchLoop(ctx context.Context, key string, isPrefix bool,
	load func(*clientv3.GetResponse), event func(*clientv3.Event)) error {
	retry := newBackOff(100 * time.Millisecond)
	for {
		var opts []clientv3.OpOption
		if isPrefix {
			opts = append(opts, clientv3.WithPrefix())
		}
		resp, err := s.cli.Get(ctx, key, opts...)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			s.log.Warn("watch: read failed; retrying", "key", key, "err", err)
			if !sleepCtx(ctx, retry.NextBackOff()) {
				return ctx.Err()
			}
			continue
		}
		load(resp)
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wopts := append(opts, clientv3.WithRev(resp.Header.Revision+1))
		wch := s.cli.Watch(wctx, key, wopts...)
		for wr := range wch {
			if err := wr.Err(); err != nil {
				s.log.Warn("watch: broken; resyncing", "key", key, "err", err)
				break
			}
			retry.Reset()
			for _, ev := range wr.Events {
				event(ev)
			}
		}
		cancel()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !sleepCtx(ctx, retry.NextBackOff()) {
			return ctx.Err()
		}
	}
}

// maxBackOff caps the store's retry intervals.
const maxBackOff = 5 * time.Second

// newBackOff returns the store's retry schedule: initial, doubling up to
// maxBackOff, without jitter (the only clients of a key are this process's
// own loops).
func newBackOff(initial time.Duration) *backoff.ExponentialBackOff {
	b := &backoff.ExponentialBackOff{InitialInterval: initial, Multiplier: 2, MaxInterval: maxBackOff}
	b.Reset()
	return b
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
