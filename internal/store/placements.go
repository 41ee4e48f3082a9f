package store

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/errdefs"
)

// Placements: /space/placements/<worker> is bumped by every transaction
// that places an execution on the worker (a create's record, a move's
// pending route). A placement decision reads the sandbox records and these
// keys at one revision (PlacementView) and commits only if the chosen
// worker's key has not moved since (Placement): two decisions made from the
// same view of a worker's load, by one control plane or by two, cannot
// both commit, so no worker is given more sandboxes than its capacity
// allows. Releases (kills, pauses) do not bump it: they only lower load.
const placementsPrefix = prefix + "placements/"

// ErrPlacementMoved: another placement on the chosen worker committed
// since its load was read; read again and re-pick. It is an
// errdefs.ErrConflict.
var ErrPlacementMoved = errdefs.Message(errdefs.ErrConflict, "worker placements moved")

// Placement guards a write that places an execution on WorkerID: it
// commits only if the worker's placement key has not moved after Rev (0:
// never placed on), and bumps it. Rev is the revision the worker's load
// was read at: its key's own revision from PlacementView, or any revision
// through which a watch of the records has delivered everything.
type Placement struct {
	WorkerID string
	Rev      int64
}

func (p Placement) ops() (clientv3.Cmp, clientv3.Op) {
	k := placementsPrefix + p.WorkerID
	return clientv3.Compare(clientv3.ModRevision(k), "<", p.Rev+1), clientv3.OpPut(k, "")
}

// PlacementView lists every sandbox record and every worker's placement
// revision, consistent at one etcd revision.
func (s *Store) PlacementView(ctx context.Context) ([]SandboxEntry, map[string]int64, error) {
	resp, err := s.cli.Txn(ctx).Then(
		clientv3.OpGet(sandboxesPrefix, clientv3.WithPrefix()),
		clientv3.OpGet(placementsPrefix, clientv3.WithPrefix(), clientv3.WithKeysOnly()),
	).Commit()
	if err != nil {
		return nil, nil, wrapErr("placement view", err)
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	out := make([]SandboxEntry, 0, len(kvs))
	for _, kv := range kvs {
		var rec SandboxRecord
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			s.log.Warn("skipping undecodable sandbox record", "key", string(kv.Key), "err", err)
			continue
		}
		out = append(out, SandboxEntry{Record: rec, Revision: kv.ModRevision})
	}
	revs := map[string]int64{}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		revs[strings.TrimPrefix(string(kv.Key), placementsPrefix)] = kv.ModRevision
	}
	return out, revs, nil
}

// CreateSandboxPlaced is CreateSandbox guarded by p: ErrPlacementMoved when
// another placement on p's worker committed since p was read.
func (s *Store) CreateSandboxPlaced(ctx context.Context, rec SandboxRecord, p Placement) (int64, error) {
	if err := rec.Validate(); err != nil {
		return 0, fmt.Errorf("store: create sandbox: %w", err)
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return 0, fmt.Errorf("store: encode sandbox: %w", err)
	}
	k := sandboxKey(rec.ID)
	pc, pop := p.ops()
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0), pc).
		Then(clientv3.OpPut(k, string(data)), pop).
		Else(clientv3.OpGet(k, clientv3.WithCountOnly())).
		Commit()
	if err != nil {
		return 0, wrapErr("create sandbox", err)
	}
	if !resp.Succeeded {
		if resp.Responses[0].GetResponseRange().GetCount() > 0 {
			return 0, fmt.Errorf("store: create sandbox %s: %w: already exists", rec.ID, errdefs.ErrConflict)
		}
		return 0, fmt.Errorf("store: create sandbox %s on %s: %w", rec.ID, p.WorkerID, ErrPlacementMoved)
	}
	return resp.Header.Revision, nil
}

// UpdateSandboxPlaced is UpdateSandbox guarded by p (see
// CreateSandboxPlaced): ErrPlacementMoved when only the placement moved.
func (s *Store) UpdateSandboxPlaced(ctx context.Context, id string, expectRevision int64, rec SandboxRecord, p Placement) (int64, error) {
	data, err := encodeUpdate(id, expectRevision, rec)
	if err != nil {
		return 0, err
	}
	k := sandboxKey(id)
	pc, pop := p.ops()
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(k), "=", expectRevision), pc).
		Then(clientv3.OpPut(k, string(data)), pop).
		Else(clientv3.OpGet(k)).
		Commit()
	if err != nil {
		return 0, wrapErr("update sandbox", err)
	}
	if !resp.Succeeded {
		kvs := resp.Responses[0].GetResponseRange().Kvs
		switch {
		case len(kvs) == 0:
			return 0, fmt.Errorf("store: update sandbox %s: %w", id, errdefs.ErrNotFound)
		case kvs[0].ModRevision != expectRevision:
			return 0, fmt.Errorf("store: update sandbox %s: %w: revision moved since %d", id, errdefs.ErrConflict, expectRevision)
		}
		return 0, fmt.Errorf("store: update sandbox %s on %s: %w", id, p.WorkerID, ErrPlacementMoved)
	}
	return resp.Header.Revision, nil
}
