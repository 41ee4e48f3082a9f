package store

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

// RegisterControlPlane puts /space/controlplanes/<id> under a lease of ttl
// for as long as the control plane instance id runs. Lifecycle operations
// name the instance running them (LifecycleOp.Owner): an operation whose
// owner's entry is gone died with it (a crash), and another instance (or
// the same one restarted) releases it at once instead of after the
// operation's deadline.
func (s *Store) RegisterControlPlane(ctx context.Context, id string, ttl time.Duration) (*Registration, error) {
	if id == "" || len(id) > 253 || strings.ContainsAny(id, "/ \t\r\n") {
		return nil, fmt.Errorf("store: register control plane: %w: id %q must be 1..253 characters without '/' or spaces", errdefs.ErrInvalid, id)
	}
	if ttl < MinWorkerTTL {
		return nil, fmt.Errorf("store: register control plane: %w: ttl %s below %s", errdefs.ErrInvalid, ttl, MinWorkerTTL)
	}
	b, _ := json.Marshal(struct {
		ID    string    `json:"id"`
		Since time.Time `json:"since"`
	}{id, time.Now().UTC()})
	return s.register(ctx, controlPlanesPrefix+id, b, spacev1.Worker{}, ttl, s.log.With("control_plane", id), nil)
}

// ControlPlanes returns the ids of the registered (live) control plane
// instances.
func (s *Store) ControlPlanes(ctx context.Context) (map[string]bool, error) {
	resp, err := s.cli.Get(ctx, controlPlanesPrefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return nil, wrapErr("list control planes", err)
	}
	out := make(map[string]bool, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		out[strings.TrimPrefix(string(kv.Key), controlPlanesPrefix)] = true
	}
	return out, nil
}
