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

	"github.com/spacesbx/space/internal/atomicfile"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/store"
)

// SigningKeyFile is the name of the signing key in Config.DataDir.
const SigningKeyFile = "signing.key"

// KeyID derives a signing key's id from its public key.
func KeyID(pub ed25519.PublicKey) string {
	sum := sha256.Sum256(pub)
	return "ed25519-" + hex.EncodeToString(sum[:8])
}

// loadOrCreateSigningKey reads dir/signing.key (PKCS#8 PEM), creating it
// with mode 0600 when missing. A key file readable by group or others is
// refused.
func loadOrCreateSigningKey(dir string) (ed25519.PrivateKey, bool, error) {
	path := filepath.Join(dir, SigningKeyFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		priv, err := createSigningKey(dir, path)
		return priv, true, err
	}
	if err != nil {
		return nil, false, fmt.Errorf("signing key: %w", err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, false, fmt.Errorf("signing key: %w", err)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, false, fmt.Errorf("signing key %s: mode %v is readable by others; want 0600", path, fi.Mode().Perm())
	}
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "PRIVATE KEY" {
		return nil, false, fmt.Errorf("signing key %s: not a PEM private key", path)
	}
	k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
	if err != nil {
		return nil, false, fmt.Errorf("signing key %s: %w", path, err)
	}
	priv, ok := k.(ed25519.PrivateKey)
	if !ok {
		return nil, false, fmt.Errorf("signing key %s: not an Ed25519 key", path)
	}
	return priv, false, nil
}

func createSigningKey(dir, path string) (ed25519.PrivateKey, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("signing key: %w", err)
	}
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("signing key: %w", err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		return nil, fmt.Errorf("signing key: %w", err)
	}
	data := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
	// Linked into place, never renamed over: an existing key (a concurrent
	// start) is never overwritten.
	if err := atomicfile.Create(path, data, 0o600); err != nil {
		if errors.Is(err, os.ErrExist) {
			priv, _, err := loadOrCreateSigningKey(dir)
			return priv, err
		}
		return nil, fmt.Errorf("signing key: %w", err)
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
