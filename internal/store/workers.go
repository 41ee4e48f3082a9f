package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

// MinWorkerTTL is the shortest registration lease accepted. etcd itself
// raises very short leases to its own minimum (about 2 s on defaults).
const MinWorkerTTL = time.Second

// Registration keeps an entry (a worker's, a control plane's) alive under
// an etcd lease. A goroutine it owns renews the lease; if the lease is lost
// (etcd unreachable for longer than the TTL) it registers again. Close
// revokes the lease, which removes the entry at once.
type Registration struct {
	s   *Store
	ttl time.Duration
	log *slog.Logger
	key string

	mu    sync.Mutex
	w     spacev1.Worker // a worker's entry (Update)
	val   []byte         // the entry as stored
	lease clientv3.LeaseID
	// onRenew is told about every grant and answered renewal (nil: none).
	onRenew func(LeaseRenewal)

	ctx       context.Context
	cancel    context.CancelFunc
	done      chan struct{}
	closeOnce sync.Once
	closeErr  error
}

func workerKey(id string) string { return workersPrefix + id }

func validateWorker(w spacev1.Worker) error {
	if w.ID == "" || len(w.ID) > 253 || strings.ContainsAny(w.ID, "/ \t\r\n") {
		return fmt.Errorf("%w: worker id %q must be 1..253 characters without '/' or spaces", errdefs.ErrInvalid, w.ID)
	}
	if w.NodeURL == "" {
		return fmt.Errorf("%w: worker %q has no node url", errdefs.ErrInvalid, w.ID)
	}
	return nil
}

// RegisterWorker puts w under /space/workers/<id> with a lease of ttl and
// keeps the lease alive until the Registration is closed. Since defaults to
// now when zero.
func (s *Store) RegisterWorker(ctx context.Context, w spacev1.Worker, ttl time.Duration) (*Registration, error) {
	return s.RegisterWorkerObserved(ctx, w, ttl, nil)
}

// RegisterWorkerObserved is RegisterWorker telling onRenew (when non-nil)
// about every grant and every answered keep-alive of the lease, with the
// time its request was sent (LeaseRenewal): what a worker needs to know
// when its lease may have lapsed (LeaseDeadline). onRenew runs on the
// registration's goroutine (the first call within this call) and must
// not block.
func (s *Store) RegisterWorkerObserved(ctx context.Context, w spacev1.Worker, ttl time.Duration, onRenew func(LeaseRenewal)) (*Registration, error) {
	if err := validateWorker(w); err != nil {
		return nil, fmt.Errorf("store: register worker: %w", err)
	}
	if ttl < MinWorkerTTL {
		return nil, fmt.Errorf("store: register worker: %w: ttl %s below %s", errdefs.ErrInvalid, ttl, MinWorkerTTL)
	}
	if w.Since.IsZero() {
		w.Since = time.Now().UTC()
	}
	b, _ := json.Marshal(w)
	return s.register(ctx, workerKey(w.ID), b, w, ttl, s.log.With("worker", w.ID), onRenew)
}

// register puts val under key with a lease of ttl kept alive by the
// returned Registration.
func (s *Store) register(ctx context.Context, key string, val []byte, w spacev1.Worker, ttl time.Duration, log *slog.Logger,
	onRenew func(LeaseRenewal)) (*Registration, error) {
	rctx, cancel := context.WithCancel(context.Background())
	r := &Registration{
		s: s, ttl: ttl, w: w, key: key, val: val, ctx: rctx, cancel: cancel, done: make(chan struct{}),
		log: log, onRenew: onRenew,
	}
	if err := r.register(ctx); err != nil {
		cancel()
		return nil, err
	}
	go r.run()
	return r, nil
}

// register grants a lease and puts the entry under it.
func (r *Registration) register(ctx context.Context) error {
	secs := int64((r.ttl + time.Second - 1) / time.Second)
	sent := time.Now()
	g, err := r.s.cli.Grant(ctx, secs)
	if err != nil {
		return wrapErr("grant registration lease", err)
	}
	r.mu.Lock()
	val := r.val
	r.lease = g.ID
	r.mu.Unlock()
	if _, err := r.s.cli.Put(ctx, r.key, string(val), clientv3.WithLease(g.ID)); err != nil {
		r.revoke(g.ID)
		return wrapErr("put registration", err)
	}
	r.renewed(LeaseRenewal{Lease: int64(g.ID), Sent: sent, TTL: time.Duration(g.TTL) * time.Second, Fresh: true})
	return nil
}

// run renews the lease every third of its TTL (KeepAliveOnce, so that the
// send time of each answered renewal is known) and registers again when
// etcd says the lease is gone. A renewal etcd does not answer is retried
// sooner, so a worker cut off from etcd renews as soon as it is back.
func (r *Registration) run() {
	defer close(r.done)
	every := max(r.ttl/3, 100*time.Millisecond)
	retry := newBackOff(200 * time.Millisecond)
	wait := every
	for {
		if !sleepCtx(r.ctx, wait) {
			return
		}
		r.mu.Lock()
		lease := r.lease
		r.mu.Unlock()
		sent := time.Now()
		ctx, cancel := context.WithTimeout(r.ctx, every)
		resp, err := r.s.cli.KeepAliveOnce(ctx, lease)
		cancel()
		switch {
		case r.ctx.Err() != nil:
			return
		case err == nil:
			wait = every
			r.renewed(LeaseRenewal{Lease: int64(lease), Sent: sent, TTL: time.Duration(resp.TTL) * time.Second})
			continue
		case !errors.Is(err, rpctypes.ErrLeaseNotFound):
			r.log.Debug("registration lease renewal unanswered; retrying", "err", err)
			wait = min(every, 500*time.Millisecond)
			continue
		}
		r.log.Warn("registration lease lost; registering again")
		retry.Reset()
		for {
			ctx, cancel := context.WithTimeout(r.ctx, r.ttl+5*time.Second)
			err := r.register(ctx)
			cancel()
			if err == nil {
				r.log.Info("registered again under a new lease")
				break
			}
			if r.ctx.Err() != nil {
				return
			}
			r.log.Warn("registration failed; retrying", "err", err)
			if !sleepCtx(r.ctx, retry.NextBackOff()) {
				return
			}
		}
		wait = every
	}
}

// Update replaces the registered entry (e.g. a new load or state) under the
// same lease. The id cannot change.
func (r *Registration) Update(ctx context.Context, w spacev1.Worker) error {
	r.mu.Lock()
	if w.ID != r.w.ID {
		r.mu.Unlock()
		return fmt.Errorf("store: update worker: %w: id cannot change", errdefs.ErrInvalid)
	}
	if w.Since.IsZero() {
		w.Since = r.w.Since
	}
	if err := validateWorker(w); err != nil {
		r.mu.Unlock()
		return fmt.Errorf("store: update worker: %w", err)
	}
	b, _ := json.Marshal(w)
	r.w, r.val = w, b
	lease := r.lease
	r.mu.Unlock()
	if _, err := r.s.cli.Put(ctx, r.key, string(b), clientv3.WithLease(lease)); err != nil {
		return wrapErr("update worker", err)
	}
	return nil
}

// Close stops the keep-alives and revokes the lease (bounded to 5 s), which
// removes the worker entry.
func (r *Registration) Close() error {
	r.closeOnce.Do(func() {
		r.cancel()
		<-r.done
		r.mu.Lock()
		lease := r.lease
		r.mu.Unlock()
		r.closeErr = r.revoke(lease)
	})
	return r.closeErr
}

func (r *Registration) revoke(id clientv3.LeaseID) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := r.s.cli.Revoke(ctx, id); err != nil {
		return wrapErr("revoke registration lease", err)
	}
	return nil
}

// abandon stops keep-alives without revoking (tests: simulate a dead worker).
func (r *Registration) abandon() {
	r.closeOnce.Do(func() {
		r.cancel()
		<-r.done
	})
}

// ListWorkers returns the registered (live) workers sorted by id. Entries
// that fail to decode are skipped and logged.
func (s *Store) ListWorkers(ctx context.Context) ([]spacev1.Worker, error) {
	resp, err := s.cli.Get(ctx, workersPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list workers", err)
	}
	out := make([]spacev1.Worker, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var w spacev1.Worker
		if err := json.Unmarshal(kv.Value, &w); err != nil {
			s.log.Warn("skipping undecodable worker entry", "key", string(kv.Key), "err", err)
			continue
		}
		out = append(out, w)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// GetWorker returns one registered worker or errdefs.ErrNotFound.
func (s *Store) GetWorker(ctx context.Context, id string) (spacev1.Worker, error) {
	resp, err := s.cli.Get(ctx, workerKey(id))
	if err != nil {
		return spacev1.Worker{}, wrapErr("get worker", err)
	}
	if len(resp.Kvs) == 0 {
		return spacev1.Worker{}, fmt.Errorf("store: worker %q: %w", id, errdefs.ErrNotFound)
	}
	var w spacev1.Worker
	if err := json.Unmarshal(resp.Kvs[0].Value, &w); err != nil {
		return spacev1.Worker{}, fmt.Errorf("store: decode worker %q: %w", id, err)
	}
	return w, nil
}

// WatchWorkers calls fn with the full list of live workers now and after
// every change, until ctx ends (it then returns ctx.Err()). fn runs on the
// watching goroutine.
func (s *Store) WatchWorkers(ctx context.Context, fn func([]spacev1.Worker)) error {
	workers := map[string]spacev1.Worker{}
	emit := func() {
		out := make([]spacev1.Worker, 0, len(workers))
		for _, w := range workers {
			out = append(out, w)
		}
		sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
		fn(out)
	}
	return s.watchLoop(ctx, workersPrefix, true, func(resp *clientv3.GetResponse) {
		clear(workers)
		for _, kv := range resp.Kvs {
			var w spacev1.Worker
			if json.Unmarshal(kv.Value, &w) == nil {
				workers[strings.TrimPrefix(string(kv.Key), workersPrefix)] = w
			}
		}
		emit()
	}, func(ev *clientv3.Event) {
		id := strings.TrimPrefix(string(ev.Kv.Key), workersPrefix)
		if ev.Type == clientv3.EventTypeDelete {
			delete(workers, id)
		} else {
			var w spacev1.Worker
			if json.Unmarshal(ev.Kv.Value, &w) != nil {
				return
			}
			workers[id] = w
		}
		emit()
	})
}
