package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sort"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/errdefs"
)

// Roles. A team member (an API key or a user's membership) is an admin or a
// user; the edge's service key is outside every team.
const (
	RoleAdmin = "admin" // may also manage the team's keys and members
	RoleUser  = "user"  // a member: the team's sandboxes and data, not its keys
	RoleEdge  = "edge"  // the edge's service key
)

// ValidMemberRole reports whether role may be given to a team member.
func ValidMemberRole(role string) bool { return role == RoleAdmin || role == RoleUser }

// Mask is what may be shown of a secret after its creation (E2B's
// IdentifierMaskingDetails): its prefix, its length and a few characters
// of each end of the random part.
type Mask struct {
	Prefix            string `json:"prefix"`
	ValueLength       int    `json:"valueLength"`
	MaskedValuePrefix string `json:"maskedValuePrefix"`
	MaskedValueSuffix string `json:"maskedValueSuffix"`
}

// APIKeyRecord is what the store keeps about an API key. The key itself is
// never stored: records are addressed by the hex SHA-256 of the key.
type APIKeyRecord struct {
	TeamID    string    `json:"team_id"`
	KeyID     string    `json:"key_id"`
	Role      string    `json:"role"`
	Name      string    `json:"name,omitempty"`
	CreatedAt time.Time `json:"created_at"`
	// Mask is shown in listings (zero for keys stored before masks).
	Mask Mask `json:"mask,omitzero"`
	// CreatedBy is the user who created the key ("" for a key created
	// with another key, or the bootstrap key).
	CreatedBy string `json:"created_by,omitempty"`
	// LastUsed is updated at most once a minute (TouchAPIKey).
	LastUsed *time.Time `json:"last_used,omitempty"`
}

// HashAPIKey returns the hex SHA-256 of key, the address of its record.
// Access tokens are hashed the same way.
func HashAPIKey(key string) string {
	s := sha256.Sum256([]byte(key))
	return hex.EncodeToString(s[:])
}

func validHash(h string) bool {
	if len(h) != 64 {
		return false
	}
	_, err := hex.DecodeString(h)
	return err == nil
}

func validAPIKey(op, hash string, rec APIKeyRecord) error {
	if !validHash(hash) {
		return fmt.Errorf("store: %s: %w: hash must be 64 hex characters", op, errdefs.ErrInvalid)
	}
	if rec.TeamID == "" || rec.KeyID == "" {
		return fmt.Errorf("store: %s: %w: team and key id required", op, errdefs.ErrInvalid)
	}
	switch rec.Role {
	case RoleAdmin, RoleUser, RoleEdge:
	default:
		return fmt.Errorf("store: %s: %w: unknown role %q", op, errdefs.ErrInvalid, rec.Role)
	}
	return nil
}

// PutAPIKey stores rec under hash (from HashAPIKey), replacing any record.
func (s *Store) PutAPIKey(ctx context.Context, hash string, rec APIKeyRecord) error {
	if err := validAPIKey("put api key", hash, rec); err != nil {
		return err
	}
	b, _ := json.Marshal(rec)
	if _, err := s.cli.Put(ctx, apiKeysPrefix+hash, string(b)); err != nil {
		return wrapErr("put api key", err)
	}
	return nil
}

// CreateAPIKey stores a new key's record (errdefs.ErrConflict if the hash
// is taken, which a random key never does).
func (s *Store) CreateAPIKey(ctx context.Context, hash string, rec APIKeyRecord) error {
	if err := validAPIKey("create api key", hash, rec); err != nil {
		return err
	}
	b, _ := json.Marshal(rec)
	k := apiKeysPrefix + hash
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).Then(clientv3.OpPut(k, string(b))).Commit()
	if err != nil {
		return wrapErr("create api key", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: create api key: %w", errdefs.ErrConflict)
	}
	return nil
}

// LookupAPIKey returns the record stored under hash, or errdefs.ErrNotFound.
func (s *Store) LookupAPIKey(ctx context.Context, hash string) (APIKeyRecord, error) {
	rec, _, err := s.LookupAPIKeyRev(ctx, hash)
	return rec, err
}

// LookupAPIKeyRev is LookupAPIKey with the record's revision (for
// TouchAPIKey).
func (s *Store) LookupAPIKeyRev(ctx context.Context, hash string) (APIKeyRecord, int64, error) {
	if !validHash(hash) {
		return APIKeyRecord{}, 0, fmt.Errorf("store: lookup api key: %w", errdefs.ErrNotFound)
	}
	resp, err := s.cli.Get(ctx, apiKeysPrefix+hash)
	if err != nil {
		return APIKeyRecord{}, 0, wrapErr("lookup api key", err)
	}
	if len(resp.Kvs) == 0 {
		return APIKeyRecord{}, 0, fmt.Errorf("store: api key: %w", errdefs.ErrNotFound)
	}
	var rec APIKeyRecord
	if err := json.Unmarshal(resp.Kvs[0].Value, &rec); err != nil {
		return APIKeyRecord{}, 0, fmt.Errorf("store: decode api key: %w", err)
	}
	return rec, resp.Kvs[0].ModRevision, nil
}

// TouchAPIKey records a use of the key at rev (from LookupAPIKeyRev). It
// writes only if the record is unchanged since, so a key deleted or
// renamed meanwhile is never written back; losing that race is not an
// error.
func (s *Store) TouchAPIKey(ctx context.Context, hash string, rev int64, rec APIKeyRecord, at time.Time) error {
	at = at.UTC()
	rec.LastUsed = &at
	b, _ := json.Marshal(rec)
	k := apiKeysPrefix + hash
	if _, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(k), "=", rev)).Then(clientv3.OpPut(k, string(b))).Commit(); err != nil {
		return wrapErr("touch api key", err)
	}
	return nil
}

// DeleteAPIKey removes the record under hash (errdefs.ErrNotFound if none).
func (s *Store) DeleteAPIKey(ctx context.Context, hash string) error {
	if !validHash(hash) {
		return fmt.Errorf("store: delete api key: %w", errdefs.ErrNotFound)
	}
	resp, err := s.cli.Delete(ctx, apiKeysPrefix+hash)
	if err != nil {
		return wrapErr("delete api key", err)
	}
	if resp.Deleted == 0 {
		return fmt.Errorf("store: api key: %w", errdefs.ErrNotFound)
	}
	return nil
}

// APIKeyEntry is a listed key: its record and the hash it is stored under.
type APIKeyEntry struct {
	Hash string
	Rev  int64
	APIKeyRecord
}

// ListAPIKeys returns team's keys, oldest first. Keys are few per team; the
// scan over every key is the price of addressing records by hash alone.
func (s *Store) ListAPIKeys(ctx context.Context, team string) ([]APIKeyEntry, error) {
	resp, err := s.cli.Get(ctx, apiKeysPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list api keys", err)
	}
	var out []APIKeyEntry
	for _, kv := range resp.Kvs {
		var rec APIKeyRecord
		if json.Unmarshal(kv.Value, &rec) != nil || rec.TeamID != team || rec.Role == RoleEdge {
			continue
		}
		out = append(out, APIKeyEntry{Hash: string(kv.Key[len(apiKeysPrefix):]), Rev: kv.ModRevision, APIKeyRecord: rec})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

// FindAPIKey returns team's key with id keyID (errdefs.ErrNotFound when no
// key of that team has it: another team's key is not found either).
func (s *Store) FindAPIKey(ctx context.Context, team, keyID string) (APIKeyEntry, error) {
	keys, err := s.ListAPIKeys(ctx, team)
	if err != nil {
		return APIKeyEntry{}, err
	}
	for _, k := range keys {
		if k.KeyID == keyID {
			return k, nil
		}
	}
	return APIKeyEntry{}, fmt.Errorf("store: api key %s: %w", keyID, errdefs.ErrNotFound)
}

// UpdateAPIKey rewrites the key e (from FindAPIKey) with mut applied,
// provided it did not change since it was read (errdefs.ErrConflict).
func (s *Store) UpdateAPIKey(ctx context.Context, e APIKeyEntry, mut func(*APIKeyRecord)) (APIKeyRecord, error) {
	rec := e.APIKeyRecord
	mut(&rec)
	rec.TeamID, rec.KeyID = e.TeamID, e.KeyID
	b, _ := json.Marshal(rec)
	k := apiKeysPrefix + e.Hash
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(k), "=", e.Rev)).Then(clientv3.OpPut(k, string(b))).Commit()
	if err != nil {
		return APIKeyRecord{}, wrapErr("update api key", err)
	}
	if !resp.Succeeded {
		return APIKeyRecord{}, fmt.Errorf("store: update api key: %w: changed meanwhile", errdefs.ErrConflict)
	}
	return rec, nil
}
