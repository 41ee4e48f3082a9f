package store

import (
	"context"
	"encoding/json"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/identity"
)

// lostPrefix holds, per sandbox, an execution a worker found without its
// processes when it started (its record and files are on that worker's
// disk): the control plane recovers it as a new execution and deletes the
// marker.
const lostPrefix = prefix + "lost/"

// PutLost records route as lost. A later report for the same sandbox
// replaces it.
func (s *Store) PutLost(ctx context.Context, route identity.Route) error {
	if err := route.Validate(); err != nil {
		return fmt.Errorf("store: put lost: %w", err)
	}
	data, err := json.Marshal(route)
	if err != nil {
		return fmt.Errorf("store: encode lost route: %w", err)
	}
	if _, err := s.cli.Put(ctx, lostPrefix+route.SandboxID, string(data)); err != nil {
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
// execution meanwhile (a newer report is kept).
func (s *Store) DeleteLost(ctx context.Context, route identity.Route) error {
	data, err := json.Marshal(route)
	if err != nil {
		return fmt.Errorf("store: encode lost route: %w", err)
	}
	k := lostPrefix + route.SandboxID
	if _, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.Value(k), "=", string(data))).Then(clientv3.OpDelete(k)).Commit(); err != nil {
		return wrapErr("delete lost", err)
	}
	return nil
}
