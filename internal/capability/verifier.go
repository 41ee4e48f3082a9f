package capability

import (
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"sync"
	"time"
)

// DefaultCacheSize bounds the verified-token cache.
const DefaultCacheSize = 16384

// cached is a verified token's claims and the key that signed it.
type cached struct {
	claims Claims
	kid    string
}

// Verifier checks capabilities against a key bundle. It is safe for
// concurrent use. Its cache of verified tokens skips only the signature
// check: purpose, key validity and the time window are re-checked on every
// call, and the caller still compares identity with its installed record.
type Verifier struct {
	mu       sync.RWMutex
	revision int64
	keys     map[string]Key
	cache    map[[32]byte]cached
	max      int
	now      func() time.Time
}

// NewVerifier returns a verifier trusting b.
func NewVerifier(b Bundle) (*Verifier, error) {
	v := &Verifier{max: DefaultCacheSize, now: time.Now, revision: -1}
	if err := v.SetBundle(b); err != nil {
		return nil, err
	}
	return v, nil
}

// SetClock replaces the verifier's clock (tests and benchmarks).
func (v *Verifier) SetClock(now func() time.Time) {
	v.mu.Lock()
	v.now = now
	v.mu.Unlock()
}

// SetBundle installs b unless it is older than the installed bundle, and
// flushes the verified-token cache.
func (v *Verifier) SetBundle(b Bundle) error {
	if err := b.Validate(); err != nil {
		return err
	}
	keys := make(map[string]Key, len(b.Keys))
	for _, k := range b.Keys {
		keys[k.ID] = k
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if b.Revision < v.revision {
		return nil
	}
	v.revision = b.Revision
	v.keys = keys
	v.cache = make(map[[32]byte]cached)
	return nil
}

// Revision is the installed bundle's revision.
func (v *Verifier) Revision() int64 {
	v.mu.RLock()
	defer v.mu.RUnlock()
	return v.revision
}

// Verify checks token for an operation of the given purpose and returns its
// claims. Order: size/format, key id known, signature, purpose, key validity,
// time window. Every error is final (Deny).
func (v *Verifier) Verify(token string, purpose Purpose) (Claims, error) {
	c, err := v.verify(token)
	if err != nil {
		return Claims{}, err
	}
	if c.Purpose != purpose {
		return Claims{}, fmt.Errorf("%w: token is for %q, operation needs %q", ErrWrongPurpose, c.Purpose, purpose)
	}
	return c, nil
}

// VerifyServicePort checks a service-port capability for port and protocol.
func (v *Verifier) VerifyServicePort(token string, port int, protocol string) (Claims, error) {
	c, err := v.Verify(token, PurposeServicePort)
	if err != nil {
		return Claims{}, err
	}
	if c.Port != port || c.Protocol != protocol {
		return Claims{}, fmt.Errorf("%w: token permits %d/%s, request is %d/%s", ErrWrongPort, c.Port, c.Protocol, port, protocol)
	}
	return c, nil
}

func (v *Verifier) verify(token string) (Claims, error) {
	if len(token) > MaxTokenSize {
		return Claims{}, fmt.Errorf("%w: token longer than %d bytes", ErrMalformed, MaxTokenSize)
	}
	sum := sha256.Sum256([]byte(token))
	v.mu.RLock()
	e, hit := v.cache[sum]
	now := v.now()
	var k Key
	var known bool
	if hit {
		k, known = v.keys[e.kid]
	}
	v.mu.RUnlock()
	c := e.claims
	if !hit {
		var err error
		c, k, err = v.verifySignature(token)
		if err != nil {
			return Claims{}, err
		}
		v.mu.Lock()
		if len(v.cache) >= v.max {
			clear(v.cache)
		}
		v.cache[sum] = cached{claims: c, kid: k.ID}
		v.mu.Unlock()
	} else if !known {
		// The bundle changed under a cached entry: the key is gone.
		return Claims{}, ErrUnknownKey
	}
	if err := checkKeyWindow(k, now); err != nil {
		return Claims{}, err
	}
	if err := checkTimes(c, now); err != nil {
		return Claims{}, err
	}
	return c, nil
}

func (v *Verifier) verifySignature(token string) (Claims, Key, error) {
	t, err := parseToken(token)
	if err != nil {
		return Claims{}, Key{}, err
	}
	v.mu.RLock()
	k, ok := v.keys[t.kid]
	v.mu.RUnlock()
	if !ok {
		return Claims{}, Key{}, fmt.Errorf("%w: %q", ErrUnknownKey, t.kid)
	}
	if !verifyParsed(t, k.Public) {
		return Claims{}, Key{}, ErrBadSignature
	}
	var c Claims
	if err := json.Unmarshal(t.message, &c); err != nil {
		return Claims{}, Key{}, fmt.Errorf("%w: claims: %v", ErrMalformed, err)
	}
	if c.JTI == "" || c.IssuedAt.IsZero() || c.Expiry.IsZero() || c.Purpose == "" {
		return Claims{}, Key{}, ErrMissingClaims
	}
	if c.Purpose != PurposeControl {
		if err := c.Route.Validate(); err != nil {
			return Claims{}, Key{}, fmt.Errorf("%w: %v", ErrMissingClaims, err)
		}
	}
	return c, k, nil
}

func checkKeyWindow(k Key, now time.Time) error {
	if !k.NotBefore.IsZero() && now.Before(k.NotBefore.Add(-Skew)) {
		return fmt.Errorf("%w: key %q not valid before %s", ErrKeyNotValid, k.ID, k.NotBefore.Format(time.RFC3339))
	}
	if !k.NotAfter.IsZero() && now.After(k.NotAfter) {
		return fmt.Errorf("%w: key %q retired at %s", ErrKeyNotValid, k.ID, k.NotAfter.Format(time.RFC3339))
	}
	return nil
}

func checkTimes(c Claims, now time.Time) error {
	if life := c.Expiry.Sub(c.IssuedAt); life <= 0 || life > Lifetime {
		return fmt.Errorf("%w: %s", ErrLifetime, life)
	}
	if now.After(c.Expiry.Add(Skew)) {
		return fmt.Errorf("%w at %s", ErrExpired, c.Expiry.Format(time.RFC3339))
	}
	if c.IssuedAt.After(now.Add(Skew)) {
		return fmt.Errorf("%w: issued at %s", ErrNotYetValid, c.IssuedAt.Format(time.RFC3339))
	}
	return nil
}
