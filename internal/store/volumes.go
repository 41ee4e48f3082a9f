package store

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/errdefs"
)

const volumesPrefix = prefix + "volumes/"

// VolumeRecord is a team's named volume (E2B's /volumes). Its files live
// on the workers (internal/volume), named by ID.
//
// Token authorizes the volume content API: never log the record with %v.
type VolumeRecord struct {
	ID        string    `json:"id"`
	TeamID    string    `json:"team_id"`
	Name      string    `json:"name"`
	Token     string    `json:"token"`
	CreatedAt time.Time `json:"created_at"`
	// Deleting is set while a delete checks that no sandbox mounts the
	// volume; a create that finds it set refuses to mount the volume.
	Deleting bool `json:"deleting,omitempty"`
}

// volumeKey is keyed by team and name: a name is unique within a team by
// construction (a create is a compare-and-swap on the key), and another
// team's lookups never reach the record.
func volumeKey(team, name string) string { return volumesPrefix + team + "/" + name }

// CreateVolume writes a new volume (errdefs.ErrConflict if the team has a
// volume of that name).
func (s *Store) CreateVolume(ctx context.Context, rec VolumeRecord) error {
	if !validSecretKeyPart(rec.TeamID) || !validSecretKeyPart(rec.Name) || rec.ID == "" {
		return fmt.Errorf("store: create volume: %w: bad team, name or id", errdefs.ErrInvalid)
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("store: encode volume: %w", err)
	}
	k := volumeKey(rec.TeamID, rec.Name)
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).
		Then(clientv3.OpPut(k, string(data))).
		Commit()
	if err != nil {
		return wrapErr("create volume", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: create volume %q: %w: a volume of that name exists", rec.Name, errdefs.ErrConflict)
	}
	return nil
}

// ListVolumes returns a team's volumes sorted by name.
func (s *Store) ListVolumes(ctx context.Context, team string) ([]VolumeRecord, error) {
	if !validSecretKeyPart(team) {
		return nil, fmt.Errorf("store: list volumes: %w: bad team", errdefs.ErrInvalid)
	}
	resp, err := s.cli.Get(ctx, volumesPrefix+team+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list volumes", err)
	}
	out := make([]VolumeRecord, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var rec VolumeRecord
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			s.log.Warn("skipping undecodable volume record", "key", string(kv.Key))
			continue
		}
		out = append(out, rec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// GetVolume finds a team's volume by id or, failing that, by name
// (errdefs.ErrNotFound, also for another team's volume).
func (s *Store) GetVolume(ctx context.Context, team, idOrName string) (VolumeRecord, int64, error) {
	if !validSecretKeyPart(team) || !validSecretKeyPart(idOrName) {
		return VolumeRecord{}, 0, fmt.Errorf("store: volume: %w", errdefs.ErrNotFound)
	}
	all, err := s.cli.Get(ctx, volumesPrefix+team+"/", clientv3.WithPrefix())
	if err != nil {
		return VolumeRecord{}, 0, wrapErr("get volume", err)
	}
	var byName *VolumeRecord
	var nameRev int64
	for _, kv := range all.Kvs {
		var rec VolumeRecord
		if json.Unmarshal(kv.Value, &rec) != nil {
			continue
		}
		if rec.ID == idOrName {
			return rec, kv.ModRevision, nil
		}
		if rec.Name == idOrName && strings.HasSuffix(string(kv.Key), "/"+idOrName) {
			r := rec
			byName, nameRev = &r, kv.ModRevision
		}
	}
	if byName != nil {
		return *byName, nameRev, nil
	}
	return VolumeRecord{}, 0, fmt.Errorf("store: volume %q: %w", idOrName, errdefs.ErrNotFound)
}

// UpdateVolume replaces a volume if its revision is still expectRevision
// (errdefs.ErrConflict otherwise) and returns the new revision.
func (s *Store) UpdateVolume(ctx context.Context, expectRevision int64, rec VolumeRecord) (int64, error) {
	data, err := json.Marshal(rec)
	if err != nil {
		return 0, fmt.Errorf("store: encode volume: %w", err)
	}
	k := volumeKey(rec.TeamID, rec.Name)
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(k), "=", expectRevision)).
		Then(clientv3.OpPut(k, string(data))).
		Commit()
	if err != nil {
		return 0, wrapErr("update volume", err)
	}
	if !resp.Succeeded {
		return 0, fmt.Errorf("store: update volume %q: %w: changed meanwhile", rec.Name, errdefs.ErrConflict)
	}
	return resp.Header.Revision, nil
}

// DeleteVolume removes a volume if its revision is still expectRevision
// (errdefs.ErrConflict otherwise).
func (s *Store) DeleteVolume(ctx context.Context, rec VolumeRecord, expectRevision int64) error {
	k := volumeKey(rec.TeamID, rec.Name)
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(k), "=", expectRevision)).
		Then(clientv3.OpDelete(k)).
		Commit()
	if err != nil {
		return wrapErr("delete volume", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: delete volume %q: %w: changed meanwhile", rec.Name, errdefs.ErrConflict)
	}
	return nil
}

// VolumeIDs returns the ids of every team's volumes (a worker's files of
// any other volume belong to a deleted one).
func (s *Store) VolumeIDs(ctx context.Context) (map[string]bool, error) {
	resp, err := s.cli.Get(ctx, volumesPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list volume ids", err)
	}
	out := make(map[string]bool, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var rec VolumeRecord
		if err := json.Unmarshal(kv.Value, &rec); err != nil || rec.ID == "" {
			// Undecodable: keep nothing from being collected by mistake.
			return nil, fmt.Errorf("store: volume record %s: %w", kv.Key, errdefs.ErrUnavailable)
		}
		out[rec.ID] = true
	}
	return out, nil
}

// GetVolumeByID finds a volume of any team by id (the volume content
// API, whose caller proves itself with the volume's token, not a team's
// key); errdefs.ErrNotFound when there is none.
func (s *Store) GetVolumeByID(ctx context.Context, id string) (VolumeRecord, error) {
	if !validSecretKeyPart(id) {
		return VolumeRecord{}, fmt.Errorf("store: volume: %w", errdefs.ErrNotFound)
	}
	resp, err := s.cli.Get(ctx, volumesPrefix, clientv3.WithPrefix())
	if err != nil {
		return VolumeRecord{}, wrapErr("get volume", err)
	}
	for _, kv := range resp.Kvs {
		var rec VolumeRecord
		if json.Unmarshal(kv.Value, &rec) == nil && rec.ID == id {
			return rec, nil
		}
	}
	return VolumeRecord{}, fmt.Errorf("store: volume %q: %w", id, errdefs.ErrNotFound)
}
