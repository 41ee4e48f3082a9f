package store

import (
	"context"
	"encoding/json"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
)

// PutBundle publishes b. It refuses (errdefs.ErrConflict) a bundle whose revision is
// not greater than the stored one, so receivers never see a revision go back.
func (s *Store) PutBundle(ctx context.Context, b capability.Bundle) error {
	if err := b.Validate(); err != nil {
		return fmt.Errorf("store: put bundle: %w: %v", errdefs.ErrInvalid, err)
	}
	cur, rev, err := s.getBundle(ctx)
	if err != nil && !isNotFound(err) {
		return err
	}
	if err == nil && b.Revision <= cur.Revision {
		return fmt.Errorf("store: put bundle: %w: revision %d not above stored %d", errdefs.ErrConflict, b.Revision, cur.Revision)
	}
	return s.casBundle(ctx, rev, b)
}

// UpdateBundle reads the stored bundle (zero Bundle and found=false when
// none), lets fn derive the next one and writes it with compare-and-swap,
// retrying when another writer moved it. If fn returns changed=false nothing
// is written. The written bundle's revision is forced above the stored one.
func (s *Store) UpdateBundle(ctx context.Context, fn func(cur capability.Bundle, found bool) (next capability.Bundle, changed bool, err error)) (capability.Bundle, error) {
	for attempt := 0; attempt < 16; attempt++ {
		cur, rev, err := s.getBundle(ctx)
		found := err == nil
		if err != nil && !isNotFound(err) {
			return capability.Bundle{}, err
		}
		next, changed, err := fn(cur, found)
		if err != nil {
			return capability.Bundle{}, err
		}
		if !changed {
			return cur, nil
		}
		if next.Revision <= cur.Revision {
			next.Revision = cur.Revision + 1
		}
		if err := next.Validate(); err != nil {
			return capability.Bundle{}, fmt.Errorf("store: update bundle: %w: %v", errdefs.ErrInvalid, err)
		}
		err = s.casBundle(ctx, rev, next)
		if err == nil {
			return next, nil
		}
		if !isConflict(err) {
			return capability.Bundle{}, err
		}
	}
	return capability.Bundle{}, fmt.Errorf("store: update bundle: %w: too much contention", errdefs.ErrConflict)
}

// casBundle writes b if the key's mod revision is still rev (0: absent).
func (s *Store) casBundle(ctx context.Context, rev int64, b capability.Bundle) error {
	data, err := json.Marshal(b)
	if err != nil {
		return fmt.Errorf("store: encode bundle: %w", err)
	}
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(bundleKey), "=", rev)).
		Then(clientv3.OpPut(bundleKey, string(data))).
		Commit()
	if err != nil {
		return wrapErr("put bundle", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: put bundle: %w: bundle changed concurrently", errdefs.ErrConflict)
	}
	return nil
}

// GetBundle returns the published bundle or errdefs.ErrNotFound.
func (s *Store) GetBundle(ctx context.Context) (capability.Bundle, error) {
	b, _, err := s.getBundle(ctx)
	return b, err
}

func (s *Store) getBundle(ctx context.Context) (capability.Bundle, int64, error) {
	resp, err := s.cli.Get(ctx, bundleKey)
	if err != nil {
		return capability.Bundle{}, 0, wrapErr("get bundle", err)
	}
	if len(resp.Kvs) == 0 {
		return capability.Bundle{}, 0, fmt.Errorf("store: bundle: %w", errdefs.ErrNotFound)
	}
	var b capability.Bundle
	if err := json.Unmarshal(resp.Kvs[0].Value, &b); err != nil {
		return capability.Bundle{}, 0, fmt.Errorf("store: decode bundle: %w", err)
	}
	return b, resp.Kvs[0].ModRevision, nil
}

// WatchBundle calls fn with the current bundle (if one is published) and
// then with every new one, until ctx ends; it then returns ctx.Err(). After a
// broken watch it re-reads the bundle, so fn may see the same revision twice:
// receivers ignore bundles not newer than theirs. Undecodable or invalid
// bundles are logged and skipped. fn runs on the watching goroutine.
func (s *Store) WatchBundle(ctx context.Context, fn func(capability.Bundle)) error {
	deliver := func(v []byte) {
		var b capability.Bundle
		if err := json.Unmarshal(v, &b); err != nil {
			s.log.Warn("skipping undecodable key bundle", "err", err)
			return
		}
		if err := b.Validate(); err != nil {
			s.log.Warn("skipping invalid key bundle", "revision", b.Revision, "err", err)
			return
		}
		fn(b)
	}
	return s.watchLoop(ctx, bundleKey, false, func(resp *clientv3.GetResponse) {
		if len(resp.Kvs) > 0 {
			deliver(resp.Kvs[0].Value)
		}
	}, func(ev *clientv3.Event) {
		if ev.Type == clientv3.EventTypePut {
			deliver(ev.Kv.Value)
		}
	})
}
