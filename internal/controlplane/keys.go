package controlplane

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// SigningKeyFile is the name of the signing key a release that kept it per
// replica left in Config.DataDir; it is migrated into the store once.
const SigningKeyFile = "signing.key"

// KeyID derives a signing key's id from its public key.
func KeyID(pub ed25519.PublicKey) string {
	sum := sha256.Sum256(pub)
	return "ed25519-" + hex.EncodeToString(sum[:8])
}

// The signing key is shared by every control plane replica through the
// store (store.GetSigningKey): any replica signs, and its capabilities
// verify everywhere. The first replica to start stores it with a
// compare-and-swap, so replicas starting together agree on one key; an
// install whose control plane kept DataDir/signing.key keeps that key (it
// is migrated: copied into the store when the store has none, and
// signing.key.next, a rotation that release had interrupted, wins over
// it). The files are not read again afterwards.

// startKey is the signing key a replica starts with.
type startKey struct {
	priv ed25519.PrivateKey
	kid  string
	// origin: "store" (another replica or an earlier start stored it),
	// "created", "migrated" (DataDir/signing.key) or "migrated-pending"
	// (DataDir/signing.key.next: published as a rotation).
	origin string
}

// loadSigningKey returns the store's signing key, storing one first when
// the store has none.
func loadSigningKey(ctx context.Context, st *store.Store, dir string, now time.Time) (startKey, error) {
	k, err := st.GetSigningKey(ctx)
	if err == nil {
		return decodeStoredKey(k, "store")
	}
	if !errors.Is(err, errdefs.ErrNotFound) {
		return startKey{}, fmt.Errorf("signing key: %w", err)
	}
	cand, err := localOrNewKey(dir)
	if err != nil {
		return startKey{}, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(cand.priv)
	if err != nil {
		return startKey{}, fmt.Errorf("signing key: %w", err)
	}
	got, ours, err := st.InitSigningKey(ctx, store.SigningKey{ID: cand.kid, PKCS8: der, Created: now.UTC()})
	if err != nil {
		return startKey{}, fmt.Errorf("signing key: %w", err)
	}
	if ours {
		return cand, nil
	}
	return decodeStoredKey(got, "store") // another replica stored one first
}

func decodeStoredKey(k store.SigningKey, origin string) (startKey, error) {
	priv, err := parseKey(k.PKCS8)
	if err != nil {
		return startKey{}, fmt.Errorf("signing key %s in the store: %w", k.ID, err)
	}
	if kid := KeyID(priv.Public().(ed25519.PublicKey)); kid != k.ID {
		return startKey{}, fmt.Errorf("signing key in the store: id %s does not match its key (%s)", k.ID, kid)
	}
	return startKey{priv: priv, kid: k.ID, origin: origin}, nil
}

// localOrNewKey is the key a replica offers when the store has none: the
// one a per-replica release left in dir, else a new one.
func localOrNewKey(dir string) (startKey, error) {
	for _, f := range []struct{ name, origin string }{{nextKeyFile, "migrated-pending"}, {SigningKeyFile, "migrated"}} {
		priv, err := readKeyFile(filepath.Join(dir, f.name))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return startKey{}, err
		}
		return startKey{priv: priv, kid: KeyID(priv.Public().(ed25519.PublicKey)), origin: f.origin}, nil
	}
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return startKey{}, fmt.Errorf("signing key: %w", err)
	}
	return startKey{priv: priv, kid: KeyID(priv.Public().(ed25519.PublicKey)), origin: "created"}, nil
}

// readKeyFile reads a PKCS#8 PEM Ed25519 key; a file readable by group or
// others is refused.
func readKeyFile(path string) (ed25519.PrivateKey, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("signing key %s: mode %v is readable by others; want 0600", path, fi.Mode().Perm())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("signing key: %w", err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "PRIVATE KEY" {
		return nil, fmt.Errorf("signing key %s: not a PEM private key", path)
	}
	priv, err := parseKey(blk.Bytes)
	if err != nil {
		return nil, fmt.Errorf("signing key %s: %w", path, err)
	}
	return priv, nil
}

func parseKey(der []byte) (ed25519.PrivateKey, error) {
	k, err := x509.ParsePKCS8PrivateKey(der)
	if err != nil {
		return nil, err
	}
	priv, ok := k.(ed25519.PrivateKey)
	if !ok {
		return nil, errors.New("not an Ed25519 key")
	}
	return priv, nil
}

// publishKey adds pub to the stored verification bundle (keeping every other
// key that is not past its NotAfter) and bumps its revision. Nothing is
// written when the bundle already holds the key unchanged.
func publishKey(ctx context.Context, st *store.Store, kid string, pub ed25519.PublicKey, now time.Time) (capability.Bundle, error) {
	return st.UpdateBundle(ctx, func(cur capability.Bundle, _ bool) (capability.Bundle, bool, error) {
		next := capability.Bundle{Revision: cur.Revision + 1}
		changed, present := false, false
		for _, k := range cur.Keys {
			if !k.NotAfter.IsZero() && now.After(k.NotAfter) {
				changed = true // expired: drop
				continue
			}
			if k.ID == kid {
				present = true
				if !pub.Equal(k.Public) {
					return cur, false, fmt.Errorf("key bundle holds another public key under id %s", kid)
				}
			}
			next.Keys = append(next.Keys, k)
		}
		if !present {
			next.Keys = append(next.Keys, capability.Key{ID: kid, Public: pub, NotBefore: now.UTC().Add(-capability.Skew)})
			changed = true
		}
		return next, changed, nil
	})
}

// newAPIKey returns a fresh E2B-style API key.
func newAPIKey() string { return "e2b_" + randHex(20) }

// keyIDOfHash is a short, non-secret id for an API key, for audit.
func keyIDOfHash(hash string) string { return "key-" + hash[:12] }

// equalSecret compares two secrets in constant time (over their SHA-256, so
// lengths leak nothing either).
func equalSecret(a, b string) bool {
	ha, hb := sha256.Sum256([]byte(a)), sha256.Sum256([]byte(b))
	return subtle.ConstantTimeCompare(ha[:], hb[:]) == 1
}

func randHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic("crypto/rand: " + err.Error())
	}
	return hex.EncodeToString(b)
}

const idAlphabet = "abcdefghijklmnopqrstuvwxyz0123456789"

// newSandboxID returns 20 random lowercase letters and digits (~103 bits),
// starting with a letter. Draws are unbiased (rejection sampling).
func newSandboxID() string {
	out := make([]byte, 20)
	var one [1]byte
	for i := range out {
		n := 36
		if i == 0 {
			n = 26
		}
		limit := 256 - 256%n
		for {
			if _, err := rand.Read(one[:]); err != nil {
				panic("crypto/rand: " + err.Error())
			}
			if int(one[0]) < limit {
				break
			}
		}
		out[i] = idAlphabet[int(one[0])%n]
	}
	return string(out)
}
