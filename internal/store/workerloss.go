package store

import (
	"context"
	"encoding/json"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/errdefs"
)

// ErrWorkerRegistered refuses a write guarded by a worker's absence
// (MutateSandboxWhileWorkerGone) because the worker is registered again.
var ErrWorkerRegistered = fmt.Errorf("%w: worker registered again", errdefs.ErrConflict)

// MutateSandboxWhileWorkerGone is MutateSandbox whose write also requires,
// in the same transaction, that worker has no registration: a worker that
// registers again before the write makes it fail with ErrWorkerRegistered
// (the worker reads the records only after registering, so it either sees
// the write or the write never happens). The control plane publishes the
// executions it recovered from a lost worker this way.
func (s *Store) MutateSandboxWhileWorkerGone(ctx context.Context, id, worker string, fn func(*SandboxRecord) error) (SandboxRecord, int64, error) {
	wk := workerKey(worker)
	for attempt := 0; attempt < 8; attempt++ {
		rec, rev, err := s.GetSandbox(ctx, id)
		if err != nil {
			return SandboxRecord{}, 0, err
		}
		if err := fn(&rec); err != nil {
			return SandboxRecord{}, 0, err
		}
		if err := rec.Validate(); err != nil {
			return SandboxRecord{}, 0, fmt.Errorf("store: update sandbox: %w", err)
		}
		data, err := json.Marshal(rec)
		if err != nil {
			return SandboxRecord{}, 0, fmt.Errorf("store: encode sandbox: %w", err)
		}
		k := sandboxKey(id)
		resp, err := s.cli.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(k), "=", rev), clientv3.Compare(clientv3.CreateRevision(wk), "=", 0)).
			Then(clientv3.OpPut(k, string(data))).
			Else(clientv3.OpGet(wk, clientv3.WithCountOnly())).
			Commit()
		if err != nil {
			return SandboxRecord{}, 0, wrapErr("update sandbox", err)
		}
		if resp.Succeeded {
			return rec, resp.Header.Revision, nil
		}
		if resp.Responses[0].GetResponseRange().GetCount() > 0 {
			return SandboxRecord{}, 0, fmt.Errorf("store: update sandbox %s: %w (%s)", id, ErrWorkerRegistered, worker)
		}
	}
	return SandboxRecord{}, 0, fmt.Errorf("store: mutate sandbox %s: %w: too much contention", id, errdefs.ErrConflict)
}
