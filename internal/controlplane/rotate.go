package controlplane

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/atomicfile"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// Key rotation.
//
// POST /space/v1/keys/rotate (admin keys only):
//  1. a new Ed25519 key is written to DataDir/signing.key.next (0600, fsync);
//  2. a bundle holding both keys is published: the new key valid from now
//     (minus the skew allowance), every older key given
//     NotAfter = now + KeyPropagation + capability.RetiredKeyGrace, so every
//     token it may still sign expires (with skew) before receivers drop it;
//     keys already past NotAfter are pruned from the bundle;
//  3. after KeyPropagation (receivers watch the bundle), the control plane
//     signs with the new key;
//  4. signing.key.next replaces signing.key (rename, fsync).
//
// A crash after 1 leaves signing.key.next: the next start adopts it and
// publishes the same kind of bundle (adoptPendingKey).

// nextKeyFile holds a rotation's new key until it is in use.
const nextKeyFile = SigningKeyFile + ".next"

// DefaultKeyPropagation is how long a rotation waits between publishing the
// new key and signing with it.
const DefaultKeyPropagation = 2 * time.Second

// rotatingSigner is the signer in use; rotation swaps it atomically.
type rotatingSigner struct {
	cur atomic.Pointer[capability.Signer]
	mu  sync.Mutex // one rotation at a time
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

// RotateKey replaces the signing key (see the package comment above).
func (s *Server) RotateKey(ctx context.Context) (spacev1.RotateResponse, error) {
	if !s.signer.mu.TryLock() {
		return spacev1.RotateResponse{}, fmt.Errorf("%w: a key rotation is in progress", errdefs.ErrConflict)
	}
	defer s.signer.mu.Unlock()
	prev := s.signer.KeyID()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return spacev1.RotateResponse{}, fmt.Errorf("rotate: %w", err)
	}
	if err := writeKeyFile(s.cfg.DataDir, nextKeyFile, priv); err != nil {
		return spacev1.RotateResponse{}, fmt.Errorf("rotate: %w", err)
	}
	pub := priv.Public().(ed25519.PublicKey)
	kid := KeyID(pub)
	now := s.now().UTC()
	notAfter := now.Add(s.keyPropagation() + capability.RetiredKeyGrace)
	b, err := publishRotation(ctx, s.st, kid, pub, now, notAfter)
	if err != nil {
		return spacev1.RotateResponse{}, fmt.Errorf("%w: publish key bundle: %v", errdefs.ErrUnavailable, err)
	}
	s.log.Info("key rotation: bundle published", "kid", kid, "previous_kid", prev, "previous_not_after", notAfter,
		"bundle_revision", b.Revision)
	if d := s.keyPropagation(); d > 0 {
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-s.ctx.Done():
			t.Stop()
			return spacev1.RotateResponse{}, fmt.Errorf("%w: shutting down during key rotation", errdefs.ErrUnavailable)
		}
	}
	sg, err := capability.NewSigner(kid, priv)
	if err != nil {
		return spacev1.RotateResponse{}, fmt.Errorf("rotate: %w", err)
	}
	s.signer.cur.Store(sg)
	if err := commitNextKey(s.cfg.DataDir); err != nil {
		// Signing already uses the new key; the next start adopts the
		// pending file.
		s.log.Error("key rotation: replacing signing.key failed", "err", err)
	}
	s.log.Info("key rotation: signing with the new key", "kid", kid)
	out := spacev1.RotateResponse{KeyID: kid, PreviousKeyID: prev, PreviousNotAfter: notAfter, BundleRevision: b.Revision}
	for _, k := range b.Keys {
		out.Keys = append(out.Keys, k.ID)
		if k.ID == prev {
			out.PreviousNotAfter = k.NotAfter
		}
	}
	return out, nil
}

// keyPropagation is the configured wait, a negative one meaning none.
func (s *Server) keyPropagation() time.Duration { return max(s.cfg.KeyPropagation, 0) }

// publishRotation publishes a bundle with kid valid from now and every other
// key retiring at notAfter at the latest; keys past their NotAfter are
// pruned.
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

// writeKeyFile writes priv (PKCS#8 PEM, 0600) to dir/name atomically.
func writeKeyFile(dir, name string, priv ed25519.PrivateKey) error {
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		return err
	}
	data := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
	return atomicfile.Write(filepath.Join(dir, name), data, 0o600)
}

func commitNextKey(dir string) error {
	if err := os.Rename(filepath.Join(dir, nextKeyFile), filepath.Join(dir, SigningKeyFile)); err != nil {
		return err
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// adoptPendingKey finishes a rotation interrupted after its new key was
// written: it moves signing.key.next over signing.key. It reports whether it
// did (then the caller publishes with publishRotation).
func adoptPendingKey(dir string) (bool, error) {
	path := filepath.Join(dir, nextKeyFile)
	fi, err := os.Stat(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("pending signing key: %w", err)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return false, fmt.Errorf("pending signing key %s: mode %v is readable by others; want 0600", path, fi.Mode().Perm())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return false, fmt.Errorf("pending signing key: %w", err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "PRIVATE KEY" {
		return false, fmt.Errorf("pending signing key %s: not a PEM private key", path)
	}
	if k, err := x509.ParsePKCS8PrivateKey(blk.Bytes); err != nil {
		return false, fmt.Errorf("pending signing key %s: %w", path, err)
	} else if _, ok := k.(ed25519.PrivateKey); !ok {
		return false, fmt.Errorf("pending signing key %s: not an Ed25519 key", path)
	}
	if err := commitNextKey(dir); err != nil {
		return false, fmt.Errorf("pending signing key: %w", err)
	}
	return true, nil
}

// publishStartKey publishes the signing key at start: as a rotation when a
// pending key was just adopted (older keys retire after the grace), else by
// adding it to the bundle.
func (s *Server) publishStartKey(ctx context.Context, adopted bool, kid string, pub ed25519.PublicKey) (capability.Bundle, error) {
	now := s.now()
	if adopted {
		return publishRotation(ctx, s.st, kid, pub, now, now.Add(capability.RetiredKeyGrace))
	}
	return publishKey(ctx, s.st, kid, pub, now)
}
