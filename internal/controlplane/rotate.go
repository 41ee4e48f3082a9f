package controlplane

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// Key rotation, cluster-wide.
//
// POST /space/v1/keys/rotate (admin keys only), on any replica:
//  1. a new Ed25519 key is recorded in the store as the rotation in
//     progress (store.BeginRotation: created only if none is, so rotations
//     are serialised across replicas), naming this replica its owner;
//  2. a bundle holding both keys is published: the new key valid from now
//     (minus the skew allowance), every older key given
//     NotAfter = now + KeyPropagation + capability.RetiredKeyGrace, so every
//     token it may still sign expires (with skew) before receivers drop it;
//     keys already past NotAfter are pruned from the bundle;
//  3. after KeyPropagation (receivers watch the bundle), the rotation is
//     committed: in one transaction the new key becomes the store's current
//     key and the rotation record goes (store.CommitRotation);
//  4. every replica watches the current key and signs with the new one
//     from then on (the rotating one at once).
//
// A replica that dies after 1 leaves the rotation record: the leader's
// reaper pass (completeRotation) takes it over once its owner is no longer
// registered (or it has stalled for rotationStall) and does 2 and 3 again
// (both are idempotent), so a rotation that was begun always completes.

// nextKeyFile is where a release that kept the key per replica held a
// rotation's new key until it was in use (migrated by loadSigningKey).
const nextKeyFile = SigningKeyFile + ".next"

// DefaultKeyPropagation is how long a rotation waits between publishing the
// new key and signing with it.
const DefaultKeyPropagation = 2 * time.Second

// rotationStall is how long past its SignAfter a rotation whose owner is
// still registered may stay uncommitted before the leader completes it
// (the owner failed half-way, e.g. etcd errors, and lives on).
const rotationStall = 30 * time.Second

// rotatingSigner is the signer in use; a rotation swaps it atomically.
type rotatingSigner struct {
	cur atomic.Pointer[capability.Signer]
	mu  sync.Mutex // one rotation at a time in this replica
}

func newRotatingSigner(sg *capability.Signer) *rotatingSigner {
	r := &rotatingSigner{}
	r.cur.Store(sg)
	return r
}

// Issue signs c with the key in use.
func (r *rotatingSigner) Issue(c capability.Claims) (string, capability.Claims, error) {
	return r.cur.Load().Issue(c)
}

// KeyID is the id of the key in use.
func (r *rotatingSigner) KeyID() string { return r.cur.Load().KeyID() }

func (s *Server) handleRotate(w http.ResponseWriter, r *http.Request, c caller) {
	if !c.operator() {
		s.writeError(w, r, fmt.Errorf("%w: rotating the signing key needs an admin key of the bootstrap team", errdefs.ErrDenied))
		return
	}
	out, err := s.RotateKey(context.WithoutCancel(r.Context()))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// RotateKey replaces the signing key of every replica (see the comment
// above). It answers errdefs.ErrConflict while another rotation is in
// progress.
func (s *Server) RotateKey(ctx context.Context) (spacev1.RotateResponse, error) {
	if !s.signer.mu.TryLock() {
		return spacev1.RotateResponse{}, fmt.Errorf("%w: a key rotation is in progress", errdefs.ErrConflict)
	}
	defer s.signer.mu.Unlock()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return spacev1.RotateResponse{}, fmt.Errorf("rotate: %w", err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		return spacev1.RotateResponse{}, fmt.Errorf("rotate: %w", err)
	}
	now := s.now().UTC()
	rot := store.Rotation{
		Key:   store.SigningKey{ID: KeyID(priv.Public().(ed25519.PublicKey)), PKCS8: der, Created: now},
		Owner: s.instance, Started: now, SignAfter: time.Now().Add(s.keyPropagation()),
		PreviousID: s.signer.KeyID(), PreviousNotAfter: now.Add(s.keyPropagation() + capability.RetiredKeyGrace),
	}
	rev, err := s.st.BeginRotation(ctx, rot, 0)
	if errors.Is(err, errdefs.ErrConflict) {
		// Another is in progress: refused, unless its owner died (then
		// this replica completes that one).
		cur, crev, gerr := s.st.GetRotation(ctx)
		if gerr != nil || !s.rotationOrphaned(ctx, cur) {
			return spacev1.RotateResponse{}, fmt.Errorf("%w: a key rotation is in progress", errdefs.ErrConflict)
		}
		s.log.Warn("key rotation: completing one a dead replica began", "kid", cur.Key.ID, "owner", cur.Owner)
		rot = cur
		rot.Owner = s.instance
		rev, err = s.st.BeginRotation(ctx, rot, crev)
		if errors.Is(err, errdefs.ErrConflict) {
			return spacev1.RotateResponse{}, fmt.Errorf("%w: a key rotation is in progress", errdefs.ErrConflict)
		}
	}
	if err != nil {
		return spacev1.RotateResponse{}, fmt.Errorf("%w: begin rotation: %v", errdefs.ErrUnavailable, err)
	}
	crashpoint.Hit(crashpoint.RotateBegun)
	return s.carryOutRotation(ctx, rot, rev, true)
}

// carryOutRotation publishes rot's key in the bundle, waits until its
// SignAfter (or, without wait, returns errRotationPending before it),
// commits it and signs with it.
func (s *Server) carryOutRotation(ctx context.Context, rot store.Rotation, rev int64, wait bool) (spacev1.RotateResponse, error) {
	priv, err := parseKey(rot.Key.PKCS8)
	if err != nil {
		return spacev1.RotateResponse{}, fmt.Errorf("rotate: key %s: %w", rot.Key.ID, err)
	}
	pub := priv.Public().(ed25519.PublicKey)
	if KeyID(pub) != rot.Key.ID {
		return spacev1.RotateResponse{}, fmt.Errorf("rotate: key id %s does not match its key", rot.Key.ID)
	}
	b, err := publishRotation(ctx, s.st, rot.Key.ID, pub, s.now().UTC(), rot.PreviousNotAfter)
	if err != nil {
		return spacev1.RotateResponse{}, fmt.Errorf("%w: publish key bundle: %v", errdefs.ErrUnavailable, err)
	}
	s.log.Info("key rotation: bundle published", "kid", rot.Key.ID, "previous_kid", rot.PreviousID,
		"previous_not_after", rot.PreviousNotAfter, "bundle_revision", b.Revision)
	crashpoint.Hit(crashpoint.RotatePublished)
	if d := time.Until(rot.SignAfter); d > 0 {
		if !wait {
			return spacev1.RotateResponse{}, errRotationPending
		}
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-s.ctx.Done():
			t.Stop()
			return spacev1.RotateResponse{}, fmt.Errorf("%w: shutting down during key rotation (the leader completes it)", errdefs.ErrUnavailable)
		}
	}
	if err := s.st.CommitRotation(ctx, rot, rev); err != nil {
		// Another replica may have committed this very rotation (it took
		// it over): then the outcome is the same.
		cur, gerr := s.st.GetSigningKey(ctx)
		if gerr != nil || cur.ID != rot.Key.ID {
			return spacev1.RotateResponse{}, fmt.Errorf("%w: commit rotation: %v", errdefs.ErrUnavailable, err)
		}
	} else {
		s.obs.keyRotations.Inc()
	}
	if err := s.useKey(rot.Key); err != nil {
		return spacev1.RotateResponse{}, err
	}
	out := spacev1.RotateResponse{KeyID: rot.Key.ID, PreviousKeyID: rot.PreviousID, PreviousNotAfter: rot.PreviousNotAfter, BundleRevision: b.Revision}
	for _, k := range b.Keys {
		out.Keys = append(out.Keys, k.ID)
		if k.ID == rot.PreviousID {
			out.PreviousNotAfter = k.NotAfter
		}
	}
	return out, nil
}

// errRotationPending: the rotation's new key is published but not to be
// signed with yet.
var errRotationPending = errors.New("rotation waits for key propagation")

// rotationOrphaned reports whether nobody carries rot out: its owner is
// no longer registered, or it stalled past its SignAfter.
func (s *Server) rotationOrphaned(ctx context.Context, rot store.Rotation) bool {
	if time.Since(rot.SignAfter) > rotationStall {
		return true
	}
	live, err := s.st.ControlPlanes(ctx)
	return err == nil && !live[rot.Owner]
}

// completeRotation (the leader's reaper pass) completes a rotation whose
// owner died or stalled, and one this replica took over earlier.
func (s *Server) completeRotation(ctx context.Context) {
	rot, rev, err := s.st.GetRotation(ctx)
	if err != nil {
		if !errors.Is(err, errdefs.ErrNotFound) && ctx.Err() == nil {
			s.log.Warn("key rotation: reading the rotation in progress failed", "err", err)
		}
		return
	}
	if !s.signer.mu.TryLock() {
		return // this replica is rotating now
	}
	defer s.signer.mu.Unlock()
	if rot.Owner != s.instance {
		if !s.rotationOrphaned(ctx, rot) {
			return
		}
		s.log.Warn("key rotation: completing one an unavailable replica began", "kid", rot.Key.ID, "owner", rot.Owner)
		rot.Owner = s.instance
		if rev, err = s.st.BeginRotation(ctx, rot, rev); err != nil {
			s.log.Debug("key rotation: take-over skipped", "err", err)
			return
		}
	}
	if _, err := s.carryOutRotation(ctx, rot, rev, false); err != nil && !errors.Is(err, errRotationPending) {
		s.log.Warn("key rotation: completing failed; retried on the next pass", "kid", rot.Key.ID, "err", err)
		return
	} else if err == nil {
		s.log.Info("key rotation: completed", "kid", rot.Key.ID)
	}
}

// useKey makes k the key this replica signs with (no-op when it is).
func (s *Server) useKey(k store.SigningKey) error {
	if s.signer.KeyID() == k.ID {
		return nil
	}
	sk, err := decodeStoredKey(k, "store")
	if err != nil {
		return fmt.Errorf("rotate: %w", err)
	}
	sg, err := capability.NewSigner(sk.kid, sk.priv)
	if err != nil {
		return fmt.Errorf("rotate: %w", err)
	}
	prev := s.signer.cur.Swap(sg)
	s.log.Info("key rotation: signing with the new key", "kid", k.ID, "previous_kid", prev.KeyID())
	return nil
}

// watchSigningKey follows the store's current key (a rotation committed
// by another replica) until the server closes.
func (s *Server) watchSigningKey() {
	defer s.wg.Done()
	_ = s.st.WatchSigningKey(s.ctx, func(k store.SigningKey) {
		if err := s.useKey(k); err != nil {
			s.log.Error("signing key from the store unusable; keeping the current one", "kid", k.ID, "err", err)
		}
	})
}

// keyPropagation is the configured wait, a negative one meaning none.
func (s *Server) keyPropagation() time.Duration { return max(s.cfg.KeyPropagation, 0) }

// publishRotation publishes a bundle with kid valid from now and every other
// key retiring at notAfter at the latest; keys past their NotAfter are
// pruned. Publishing the same rotation again changes nothing but the
// revision.
func publishRotation(ctx context.Context, st *store.Store, kid string, pub ed25519.PublicKey, now, notAfter time.Time) (capability.Bundle, error) {
	return st.UpdateBundle(ctx, func(cur capability.Bundle, _ bool) (capability.Bundle, bool, error) {
		next := capability.Bundle{Revision: cur.Revision + 1}
		for _, k := range cur.Keys {
			if !k.NotAfter.IsZero() && now.After(k.NotAfter) {
				continue
			}
			if k.ID == kid {
				if !pub.Equal(k.Public) {
					return cur, false, fmt.Errorf("key bundle holds another public key under id %s", kid)
				}
				continue // re-added below without NotAfter
			}
			if k.NotAfter.IsZero() || k.NotAfter.After(notAfter) {
				k.NotAfter = notAfter.UTC()
			}
			next.Keys = append(next.Keys, k)
		}
		next.Keys = append(next.Keys, capability.Key{ID: kid, Public: pub, NotBefore: now.UTC().Add(-capability.Skew)})
		return next, true, nil
	})
}

// publishStartKey publishes the signing key at start: as a rotation when it
// was migrated from a pending local rotation (older keys retire after the
// grace), else by adding it to the bundle (nothing is written when the
// bundle holds it).
func (s *Server) publishStartKey(ctx context.Context, k startKey) (capability.Bundle, error) {
	now := s.now()
	pub := k.priv.Public().(ed25519.PublicKey)
	if k.origin == "migrated-pending" {
		return publishRotation(ctx, s.st, k.kid, pub, now, now.Add(capability.RetiredKeyGrace))
	}
	return publishKey(ctx, s.st, k.kid, pub, now)
}
