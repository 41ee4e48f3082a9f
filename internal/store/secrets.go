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

const secretsPrefix = prefix + "secrets/"

// SecretRecord is a team's named secret (E2B's /secrets). Value never
// leaves the platform through the API: the control plane hands it only
// to the worker whose egress proxy substitutes it (network.rules), so a
// sandbox only ever sees the placeholder ${e2b.secrets.<name>}.
//
// Value is a secret: never log the record with %v.
type SecretRecord struct {
	ID             string            `json:"id"`
	TeamID         string            `json:"team_id"`
	Name           string            `json:"name"`
	Value          string            `json:"value"`
	CurrentVersion int64             `json:"current_version"`
	Metadata       map[string]string `json:"metadata,omitempty"`
	CreatedAt      time.Time         `json:"created_at"`
	UpdatedAt      time.Time         `json:"updated_at"`
}

// secretKey is keyed by team and name, so a name is unique within a team
// by construction (a create is a compare-and-swap on the key).
func secretKey(team, name string) string { return secretsPrefix + team + "/" + name }

func validSecretKeyPart(s string) bool {
	return s != "" && len(s) <= 256 && !strings.ContainsAny(s, "/\x00")
}

// CreateSecret writes a new secret (errdefs.ErrConflict if the team has a
// secret of that name).
func (s *Store) CreateSecret(ctx context.Context, rec SecretRecord) error {
	if !validSecretKeyPart(rec.TeamID) || !validSecretKeyPart(rec.Name) || rec.ID == "" {
		return fmt.Errorf("store: create secret: %w: bad team, name or id", errdefs.ErrInvalid)
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("store: encode secret: %w", err)
	}
	k := secretKey(rec.TeamID, rec.Name)
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).
		Then(clientv3.OpPut(k, string(data))).
		Commit()
	if err != nil {
		return wrapErr("create secret", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: create secret %q: %w: a secret of that name exists", rec.Name, errdefs.ErrConflict)
	}
	return nil
}

// ListSecrets returns a team's secrets sorted by name.
func (s *Store) ListSecrets(ctx context.Context, team string) ([]SecretRecord, error) {
	if !validSecretKeyPart(team) {
		return nil, fmt.Errorf("store: list secrets: %w: bad team", errdefs.ErrInvalid)
	}
	resp, err := s.cli.Get(ctx, secretsPrefix+team+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list secrets", err)
	}
	out := make([]SecretRecord, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var rec SecretRecord
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			s.log.Warn("skipping undecodable secret record", "key", string(kv.Key))
			continue
		}
		out = append(out, rec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// GetSecret finds a team's secret by id or name (errdefs.ErrNotFound).
func (s *Store) GetSecret(ctx context.Context, team, idOrName string) (SecretRecord, int64, error) {
	if !validSecretKeyPart(team) || !validSecretKeyPart(idOrName) {
		return SecretRecord{}, 0, fmt.Errorf("store: secret: %w", errdefs.ErrNotFound)
	}
	resp, err := s.cli.Get(ctx, secretKey(team, strings.ToLower(idOrName)))
	if err != nil {
		return SecretRecord{}, 0, wrapErr("get secret", err)
	}
	kvs := resp.Kvs
	if len(kvs) == 0 {
		// By id: a team has few secrets; scan them.
		all, err := s.cli.Get(ctx, secretsPrefix+team+"/", clientv3.WithPrefix())
		if err != nil {
			return SecretRecord{}, 0, wrapErr("get secret", err)
		}
		for _, kv := range all.Kvs {
			var rec SecretRecord
			if json.Unmarshal(kv.Value, &rec) == nil && rec.ID == idOrName {
				return rec, kv.ModRevision, nil
			}
		}
		return SecretRecord{}, 0, fmt.Errorf("store: secret %q: %w", idOrName, errdefs.ErrNotFound)
	}
	var rec SecretRecord
	if err := json.Unmarshal(kvs[0].Value, &rec); err != nil {
		return SecretRecord{}, 0, fmt.Errorf("store: decode secret: %w", err)
	}
	return rec, kvs[0].ModRevision, nil
}

// UpdateSecret replaces a secret if its revision is still expectRevision
// (errdefs.ErrConflict otherwise).
func (s *Store) UpdateSecret(ctx context.Context, expectRevision int64, rec SecretRecord) error {
	data, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("store: encode secret: %w", err)
	}
	k := secretKey(rec.TeamID, rec.Name)
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(k), "=", expectRevision)).
		Then(clientv3.OpPut(k, string(data))).
		Commit()
	if err != nil {
		return wrapErr("update secret", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: update secret %q: %w: changed meanwhile", rec.Name, errdefs.ErrConflict)
	}
	return nil
}

// DeleteSecret removes a team's secret by id or name (errdefs.ErrNotFound).
func (s *Store) DeleteSecret(ctx context.Context, team, idOrName string) error {
	rec, rev, err := s.GetSecret(ctx, team, idOrName)
	if err != nil {
		return err
	}
	k := secretKey(rec.TeamID, rec.Name)
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(k), "=", rev)).
		Then(clientv3.OpDelete(k)).
		Commit()
	if err != nil {
		return wrapErr("delete secret", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: delete secret %q: %w: changed meanwhile", rec.Name, errdefs.ErrConflict)
	}
	return nil
}
