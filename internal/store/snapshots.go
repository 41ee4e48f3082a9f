package store

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/errdefs"
)

const snapshotsPrefix = prefix + "snapshots/"

// snapshotIDRE is the form of snapshot ids: safe as a file name and in a
// URL path segment.
var snapshotIDRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,63}$`)

// SnapshotRecord is a persistent, user-visible snapshot of a sandbox's
// writable layer (E2B's "snapshot template"). The data lives in the
// workers' snapshot store under ID; this record outlives the sandbox.
type SnapshotRecord struct {
	ID         string   `json:"id"`
	TeamID     string   `json:"team_id"`
	Names      []string `json:"names,omitempty"`
	SandboxID  string   `json:"sandbox_id"`
	TemplateID string   `json:"template_id"`
	// Generation of the source execution that was archived.
	Generation uint64            `json:"generation"`
	EnvVars    map[string]string `json:"env_vars,omitempty"`
	CPUCount   int               `json:"cpu_count,omitempty"`
	MemoryMB   int               `json:"memory_mb,omitempty"`
	DiskSizeMB int               `json:"disk_size_mb,omitempty"`
	SizeBytes  int64             `json:"size_bytes"`
	CreatedAt  time.Time         `json:"created_at"`
}

// ValidSnapshotID reports whether id has the form of a snapshot id.
func ValidSnapshotID(id string) bool { return snapshotIDRE.MatchString(id) }

// CreateSnapshot writes a new snapshot record (errdefs.ErrConflict if the id exists).
func (s *Store) CreateSnapshot(ctx context.Context, rec SnapshotRecord) error {
	if !ValidSnapshotID(rec.ID) || rec.TeamID == "" {
		return fmt.Errorf("store: create snapshot: %w: bad id or team", errdefs.ErrInvalid)
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("store: encode snapshot: %w", err)
	}
	k := snapshotsPrefix + rec.ID
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).
		Then(clientv3.OpPut(k, string(data))).
		Commit()
	if err != nil {
		return wrapErr("create snapshot", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: create snapshot %s: %w: already exists", rec.ID, errdefs.ErrConflict)
	}
	return nil
}

// GetSnapshot returns a snapshot record or errdefs.ErrNotFound.
func (s *Store) GetSnapshot(ctx context.Context, id string) (SnapshotRecord, error) {
	if !ValidSnapshotID(id) {
		return SnapshotRecord{}, fmt.Errorf("store: snapshot %q: %w", id, errdefs.ErrNotFound)
	}
	resp, err := s.cli.Get(ctx, snapshotsPrefix+id)
	if err != nil {
		return SnapshotRecord{}, wrapErr("get snapshot", err)
	}
	if len(resp.Kvs) == 0 {
		return SnapshotRecord{}, fmt.Errorf("store: snapshot %s: %w", id, errdefs.ErrNotFound)
	}
	var rec SnapshotRecord
	if err := json.Unmarshal(resp.Kvs[0].Value, &rec); err != nil {
		return SnapshotRecord{}, fmt.Errorf("store: decode snapshot %s: %w", id, err)
	}
	return rec, nil
}

// ListSnapshots returns every snapshot record sorted by id.
func (s *Store) ListSnapshots(ctx context.Context) ([]SnapshotRecord, error) {
	resp, err := s.cli.Get(ctx, snapshotsPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list snapshots", err)
	}
	out := make([]SnapshotRecord, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var rec SnapshotRecord
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			s.log.Warn("skipping undecodable snapshot record", "key", string(kv.Key), "err", err)
			continue
		}
		out = append(out, rec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// DeleteSnapshot removes a snapshot record (errdefs.ErrNotFound when absent).
func (s *Store) DeleteSnapshot(ctx context.Context, id string) error {
	if !ValidSnapshotID(id) {
		return fmt.Errorf("store: snapshot %q: %w", id, errdefs.ErrNotFound)
	}
	resp, err := s.cli.Delete(ctx, snapshotsPrefix+id)
	if err != nil {
		return wrapErr("delete snapshot", err)
	}
	if resp.Deleted == 0 {
		return fmt.Errorf("store: snapshot %s: %w", id, errdefs.ErrNotFound)
	}
	return nil
}
