package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

// API key roles.
const (
	RoleAdmin = "admin" // team member who may also list workers
	RoleUser  = "user"
	RoleEdge  = "edge" // the edge's service key
)

// APIKeyRecord is what the store keeps about an API key. The key itself is
// never stored: records are addressed by the hex SHA-256 of the key.
type APIKeyRecord struct {
	TeamID    string    `json:"team_id"`
	KeyID     string    `json:"key_id"`
	Role      string    `json:"role"`
	Name      string    `json:"name,omitempty"`
	CreatedAt time.Time `json:"created_at"`
}

// HashAPIKey returns the hex SHA-256 of key, the address of its record.
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

// PutAPIKey stores rec under hash (from HashAPIKey), replacing any record.
func (s *Store) PutAPIKey(ctx context.Context, hash string, rec APIKeyRecord) error {
	if !validHash(hash) {
		return fmt.Errorf("store: put api key: %w: hash must be 64 hex characters", errdefs.ErrInvalid)
	}
	if rec.TeamID == "" || rec.KeyID == "" {
		return fmt.Errorf("store: put api key: %w: team and key id required", errdefs.ErrInvalid)
	}
	switch rec.Role {
	case RoleAdmin, RoleUser, RoleEdge:
	default:
		return fmt.Errorf("store: put api key: %w: unknown role %q", errdefs.ErrInvalid, rec.Role)
	}
	b, _ := json.Marshal(rec)
	if _, err := s.cli.Put(ctx, apiKeysPrefix+hash, string(b)); err != nil {
		return wrapErr("put api key", err)
	}
	return nil
}

// LookupAPIKey returns the record stored under hash, or errdefs.ErrNotFound.
func (s *Store) LookupAPIKey(ctx context.Context, hash string) (APIKeyRecord, error) {
	if !validHash(hash) {
		return APIKeyRecord{}, fmt.Errorf("store: lookup api key: %w", errdefs.ErrNotFound)
	}
	resp, err := s.cli.Get(ctx, apiKeysPrefix+hash)
	if err != nil {
		return APIKeyRecord{}, wrapErr("lookup api key", err)
	}
	if len(resp.Kvs) == 0 {
		return APIKeyRecord{}, fmt.Errorf("store: api key: %w", errdefs.ErrNotFound)
	}
	var rec APIKeyRecord
	if err := json.Unmarshal(resp.Kvs[0].Value, &rec); err != nil {
		return APIKeyRecord{}, fmt.Errorf("store: decode api key: %w", err)
	}
	return rec, nil
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
