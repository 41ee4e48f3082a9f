package store

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/errdefs"
)

// The control planes' shared signing key lives in etcd:
//
//	/space/signing/current   the key every control plane signs with
//	/space/signing/next      a rotation in progress (its new key, its owner)
//
// Whoever can read etcd can therefore mint capabilities: etcd access
// already equals control of the platform (it holds every record and API
// key hash), so its clients must be authenticated (TLS client certificates
// or etcd auth) on any network another tenant shares. The private keys are
// opaque bytes here (PKCS#8 DER); this package never logs them.
const (
	signingPrefix     = prefix + "signing/"
	signingCurrentKey = signingPrefix + "current"
	signingNextKey    = signingPrefix + "next"
)

// SigningKey is a private signing key as stored.
type SigningKey struct {
	// ID is the key id (the bundle's kid).
	ID string `json:"id"`
	// PKCS8 is the private key, PKCS#8 DER.
	PKCS8   []byte    `json:"pkcs8"`
	Created time.Time `json:"created"`
}

func (k SigningKey) validate() error {
	if k.ID == "" || len(k.PKCS8) == 0 {
		return fmt.Errorf("%w: signing key needs an id and key bytes", errdefs.ErrInvalid)
	}
	return nil
}

// Rotation is a key rotation in progress: Key is published in the bundle
// (every older key retiring at PreviousNotAfter at the latest) and becomes
// the current key once SignAfter (wall clock) has passed. Owner is the
// control plane instance carrying it out; when that instance is no longer
// registered, another completes it.
type Rotation struct {
	Key              SigningKey `json:"key"`
	Owner            string     `json:"owner"`
	Started          time.Time  `json:"started"`
	SignAfter        time.Time  `json:"signAfter"`
	PreviousID       string     `json:"previousId"`
	PreviousNotAfter time.Time  `json:"previousNotAfter"`
}

// GetSigningKey returns the current signing key, or errdefs.ErrNotFound.
func (s *Store) GetSigningKey(ctx context.Context) (SigningKey, error) {
	var k SigningKey
	_, err := s.getJSON(ctx, "signing key", signingCurrentKey, &k)
	return k, err
}

// InitSigningKey stores k as the current signing key unless one exists
// (compare-and-swap on its absence), and returns the key now stored and
// whether it is k: of two control planes starting together, both end up
// with the same key.
func (s *Store) InitSigningKey(ctx context.Context, k SigningKey) (SigningKey, bool, error) {
	if err := k.validate(); err != nil {
		return SigningKey{}, false, fmt.Errorf("store: init signing key: %w", err)
	}
	data, err := json.Marshal(k)
	if err != nil {
		return SigningKey{}, false, fmt.Errorf("store: encode signing key: %w", err)
	}
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(signingCurrentKey), "=", 0)).
		Then(clientv3.OpPut(signingCurrentKey, string(data))).
		Else(clientv3.OpGet(signingCurrentKey)).
		Commit()
	if err != nil {
		return SigningKey{}, false, wrapErr("init signing key", err)
	}
	if resp.Succeeded {
		return k, true, nil
	}
	var cur SigningKey
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return SigningKey{}, false, fmt.Errorf("store: init signing key: %w: key vanished", errdefs.ErrConflict)
	}
	if err := json.Unmarshal(kvs[0].Value, &cur); err != nil {
		return SigningKey{}, false, fmt.Errorf("store: decode signing key: %w", err)
	}
	return cur, false, nil
}

// GetRotation returns the rotation in progress and its mod revision, or
// errdefs.ErrNotFound when none is.
func (s *Store) GetRotation(ctx context.Context) (Rotation, int64, error) {
	var r Rotation
	rev, err := s.getJSON(ctx, "rotation", signingNextKey, &r)
	return r, rev, err
}

// BeginRotation records r as the rotation in progress. With rev 0 it
// succeeds only if none is (errdefs.ErrConflict otherwise: rotations are
// serialised); with rev > 0 it takes over the rotation stored at that
// revision (an interrupted one whose owner died).
func (s *Store) BeginRotation(ctx context.Context, r Rotation, rev int64) (int64, error) {
	if err := r.Key.validate(); err != nil {
		return 0, fmt.Errorf("store: begin rotation: %w", err)
	}
	if r.Owner == "" {
		return 0, fmt.Errorf("store: begin rotation: %w: owner required", errdefs.ErrInvalid)
	}
	data, err := json.Marshal(r)
	if err != nil {
		return 0, fmt.Errorf("store: encode rotation: %w", err)
	}
	cmp := clientv3.Compare(clientv3.CreateRevision(signingNextKey), "=", 0)
	if rev > 0 {
		cmp = clientv3.Compare(clientv3.ModRevision(signingNextKey), "=", rev)
	}
	resp, err := s.cli.Txn(ctx).If(cmp).Then(clientv3.OpPut(signingNextKey, string(data))).Commit()
	if err != nil {
		return 0, wrapErr("begin rotation", err)
	}
	if !resp.Succeeded {
		return 0, fmt.Errorf("store: begin rotation: %w: another rotation is in progress", errdefs.ErrConflict)
	}
	return resp.Header.Revision, nil
}

// CommitRotation makes the rotation stored at revision rev the current
// key and ends it, in one transaction (errdefs.ErrConflict when the
// rotation moved: another control plane committed or took it over).
func (s *Store) CommitRotation(ctx context.Context, r Rotation, rev int64) error {
	data, err := json.Marshal(r.Key)
	if err != nil {
		return fmt.Errorf("store: encode signing key: %w", err)
	}
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(signingNextKey), "=", rev)).
		Then(clientv3.OpPut(signingCurrentKey, string(data)), clientv3.OpDelete(signingNextKey)).
		Commit()
	if err != nil {
		return wrapErr("commit rotation", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: commit rotation: %w: rotation moved since %d", errdefs.ErrConflict, rev)
	}
	return nil
}

// WatchSigningKey calls fn with the current signing key (if one is
// stored) and with every new one, until ctx ends; it then returns
// ctx.Err(). fn may see the same key twice.
func (s *Store) WatchSigningKey(ctx context.Context, fn func(SigningKey)) error {
	deliver := func(v []byte) {
		var k SigningKey
		if err := json.Unmarshal(v, &k); err != nil || k.validate() != nil {
			s.log.Warn("skipping undecodable signing key record")
			return
		}
		fn(k)
	}
	return s.watchLoop(ctx, signingCurrentKey, false, func(resp *clientv3.GetResponse) {
		if len(resp.Kvs) > 0 {
			deliver(resp.Kvs[0].Value)
		}
	}, func(ev *clientv3.Event) {
		if ev.Type == clientv3.EventTypePut {
			deliver(ev.Kv.Value)
		}
	})
}
