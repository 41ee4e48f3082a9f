package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/errdefs"
)

// Access tokens are stored like API keys, by the hex SHA-256 of the token,
// with an index per user so a user's tokens are one prefix read.
const (
	accessTokensPrefix = prefix + "accesstokens/" // <hash> -> AccessTokenRecord
	userTokensPrefix   = prefix + "usertokens/"   // <user>/<id> -> hash
)

// AccessTokenRecord is what the store keeps about a user's access token.
type AccessTokenRecord struct {
	ID        string    `json:"id"`
	UserID    string    `json:"user_id"`
	Name      string    `json:"name,omitempty"`
	Mask      Mask      `json:"mask"`
	CreatedAt time.Time `json:"created_at"`
}

// CreateAccessToken stores a new token's record under hash.
func (s *Store) CreateAccessToken(ctx context.Context, hash string, rec AccessTokenRecord) error {
	if !validHash(hash) || !validIDPart(rec.ID) || !validIDPart(rec.UserID) {
		return fmt.Errorf("store: create access token: %w: bad hash, id or user", errdefs.ErrInvalid)
	}
	b, _ := json.Marshal(rec)
	k, ik := accessTokensPrefix+hash, userTokensPrefix+rec.UserID+"/"+rec.ID
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0), clientv3.Compare(clientv3.CreateRevision(ik), "=", 0)).
		Then(clientv3.OpPut(k, string(b)), clientv3.OpPut(ik, hash)).Commit()
	if err != nil {
		return wrapErr("create access token", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: create access token: %w", errdefs.ErrConflict)
	}
	return nil
}

// LookupAccessToken returns the record stored under hash (errdefs.ErrNotFound).
func (s *Store) LookupAccessToken(ctx context.Context, hash string) (AccessTokenRecord, error) {
	var rec AccessTokenRecord
	if !validHash(hash) {
		return rec, fmt.Errorf("store: access token: %w", errdefs.ErrNotFound)
	}
	_, err := s.getJSON(ctx, "access token", accessTokensPrefix+hash, &rec)
	return rec, err
}

// ListAccessTokens returns user's tokens, oldest first.
func (s *Store) ListAccessTokens(ctx context.Context, user string) ([]AccessTokenRecord, error) {
	if !validIDPart(user) {
		return nil, nil
	}
	resp, err := s.cli.Get(ctx, userTokensPrefix+user+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list access tokens", err)
	}
	out := []AccessTokenRecord{}
	for _, kv := range resp.Kvs {
		rec, err := s.LookupAccessToken(ctx, string(kv.Value))
		if errors.Is(err, errdefs.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, rec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

// DeleteAccessToken removes user's token id (errdefs.ErrNotFound if the
// user has no such token).
func (s *Store) DeleteAccessToken(ctx context.Context, user, id string) error {
	if !validIDPart(user) || !validIDPart(id) {
		return fmt.Errorf("store: access token: %w", errdefs.ErrNotFound)
	}
	ik := userTokensPrefix + user + "/" + id
	resp, err := s.cli.Get(ctx, ik)
	if err != nil {
		return wrapErr("delete access token", err)
	}
	if len(resp.Kvs) == 0 {
		return fmt.Errorf("store: access token: %w", errdefs.ErrNotFound)
	}
	hash := string(resp.Kvs[0].Value)
	if _, err := s.cli.Txn(ctx).Then(clientv3.OpDelete(accessTokensPrefix+hash), clientv3.OpDelete(ik)).Commit(); err != nil {
		return wrapErr("delete access token", err)
	}
	return nil
}
