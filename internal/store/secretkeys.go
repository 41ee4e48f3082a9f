package store

import (
	"context"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/errdefs"
)

// Cluster keys: random secrets every control-plane replica must share
// (the HMAC key of template-file upload links: a link one replica signs
// is used against another), created once by whichever replica asks
// first. Readable by whoever reads etcd, like the signing key.
const clusterKeysPrefix = prefix + "clusterkeys/"

// InitClusterKey returns the cluster key name, storing k as it when none
// exists yet (created reports whether k was stored). Replicas starting
// together agree on one key.
func (s *Store) InitClusterKey(ctx context.Context, name string, k []byte) (_ []byte, created bool, _ error) {
	if name == "" || len(k) < 16 {
		return nil, false, fmt.Errorf("store: init cluster key %q: %w: a name and at least 16 bytes", name, errdefs.ErrInvalid)
	}
	key := clusterKeysPrefix + name
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, string(k))).
		Else(clientv3.OpGet(key)).
		Commit()
	if err != nil {
		return nil, false, wrapErr("init cluster key", err)
	}
	if resp.Succeeded {
		return k, true, nil
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 || len(kvs[0].Value) < 16 {
		return nil, false, fmt.Errorf("store: cluster key %q: %w: missing or too short", name, errdefs.ErrConflict)
	}
	return kvs[0].Value, false, nil
}
