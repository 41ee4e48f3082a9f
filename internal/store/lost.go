package store

import (
	"context"
	"encoding/json"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/identity"
)

// lostPrefix holds, per execution (lost/<sandbox>/<execution>), an
// execution a worker found without its processes when it started (its
// record and files are on that worker's disk): the control plane recovers
// it as a new execution, or tears it down when nothing will, and deletes
// the marker. One sandbox can have several: a move cut by a crash leaves
// the old execution on one worker and the unpublished new one on another,
// and each worker reports its own (keyed by sandbox alone, the second
// report replaced the first and the published execution was never
// recovered).
const lostPrefix = prefix + "lost/"

func lostKey(r identity.Route) string { return lostPrefix + r.SandboxID + "/" + r.ExecutionID }

// PutLost records route as lost. A later report of the same execution
// (another activation) replaces it.
func (s *Store) PutLost(ctx context.Context, route identity.Route) error {
	if err := route.Validate(); err != nil {
		return fmt.Errorf("store: put lost: %w", err)
	}
	data, err := json.Marshal(route)
	if err != nil {
		return fmt.Errorf("store: encode lost route: %w", err)
	}
	if _, err := s.cli.Put(ctx, lostKey(route), string(data)); err != nil {
		return wrapErr("put lost", err)
	}
	return nil
}

// ListLost returns every lost execution on record.
func (s *Store) ListLost(ctx context.Context) ([]identity.Route, error) {
	resp, err := s.cli.Get(ctx, lostPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list lost", err)
	}
	out := make([]identity.Route, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var r identity.Route
		if err := json.Unmarshal(kv.Value, &r); err != nil {
			s.log.Warn("malformed lost-execution marker dropped", "key", string(kv.Key), "err", err)
			_, _ = s.cli.Delete(ctx, string(kv.Key))
			continue
		}
		out = append(out, r)
	}
	return out, nil
}

// WatchLost calls fn for every lost-execution report made from now on,
// until ctx ends (its error is then returned).
func (s *Store) WatchLost(ctx context.Context, fn func()) error {
	return s.watchLoop(ctx, lostPrefix, true, func(*clientv3.GetResponse) {}, func(ev *clientv3.Event) {
		if ev.Type == clientv3.EventTypePut {
			fn()
		}
	})
}

// DeleteLost removes the marker of route, unless it names another
// activation of that execution meanwhile (a newer report is kept). A
// marker of the former layout (keyed by sandbox) naming route goes too.
func (s *Store) DeleteLost(ctx context.Context, route identity.Route) error {
	data, err := json.Marshal(route)
	if err != nil {
		return fmt.Errorf("store: encode lost route: %w", err)
	}
	for _, k := range []string{lostKey(route), lostPrefix + route.SandboxID} {
		if _, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.Value(k), "=", string(data))).Then(clientv3.OpDelete(k)).Commit(); err != nil {
			return wrapErr("delete lost", err)
		}
	}
	return nil
}
