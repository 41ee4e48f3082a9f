// Package capability issues and verifies SPACE capabilities: short-lived
// PASETO v4.public (Ed25519) tokens that name the sandbox execution selected
// for a request, where it is placed, and the access it permits.
//
// Only the control plane holds a Signer. Receivers (sbx-manager, netgtw, the
// edge) hold a Verifier built from a public key bundle and cannot issue
// tokens. A valid token is necessary but not sufficient: the receiver must
// still compare the token's identity with its own installed record
// (package identity).
package capability

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"aidanwoods.dev/go-paseto"

	"github.com/spacesbx/space/internal/identity"
)

// Lifetime is the longest a capability may live (exp - iat).
const Lifetime = 120 * time.Second

// Skew is the clock-skew allowance on exp and iat.
const Skew = 15 * time.Second

// RetiredKeyGrace is how long a rotated-out key must stay in bundles: every
// token it signed has expired by then.
const RetiredKeyGrace = Lifetime + Skew

// MaxTokenSize bounds what a receiver is willing to parse.
const MaxTokenSize = 4096

// implicitAssertion binds signatures to this capability format version. It
// deliberately names no receiver: a receiver must be able to verify a token
// selected for another receiver and answer RefreshRoute rather than Deny.
var implicitAssertion = []byte("space.capability.v1")

// Purpose names the class of operation a capability permits.
type Purpose string

// Purposes.
const (
	PurposeProcess     Purpose = "process"
	PurposeFilesystem  Purpose = "filesystem"
	PurposeFiles       Purpose = "files"
	PurposeServicePort Purpose = "service-port"
	// PurposeControl authorizes control-plane calls to a worker (install,
	// retire); it is never issued to callers.
	PurposeControl Purpose = "control"
)

// Valid reports whether p is a known purpose.
func (p Purpose) Valid() bool {
	switch p {
	case PurposeProcess, PurposeFilesystem, PurposeFiles, PurposeServicePort, PurposeControl:
		return true
	}
	return false
}

// Rejection reasons. Every one of them is a Deny: none is repaired by
// refreshing the route.
var (
	ErrMalformed     = errors.New("malformed capability")
	ErrUnknownKey    = errors.New("capability signed by unknown key")
	ErrKeyNotValid   = errors.New("capability signing key not valid now")
	ErrBadSignature  = errors.New("capability signature invalid")
	ErrWrongPurpose  = errors.New("capability purpose does not permit operation")
	ErrWrongPort     = errors.New("capability does not permit port or protocol")
	ErrExpired       = errors.New("capability expired")
	ErrNotYetValid   = errors.New("capability issued in the future")
	ErrLifetime      = errors.New("capability lifetime exceeds maximum")
	ErrMissingClaims = errors.New("capability lacks required claims")
)

// Claims is the signed content of a capability.
type Claims struct {
	identity.Route
	Purpose Purpose `json:"purpose"`
	// Port and Protocol are set for service-port capabilities only.
	Port     int    `json:"port,omitempty"`
	Protocol string `json:"protocol,omitempty"`
	// Caller is the team or key id, for audit.
	Caller   string    `json:"caller,omitempty"`
	JTI      string    `json:"jti"`
	IssuedAt time.Time `json:"iat"`
	Expiry   time.Time `json:"exp"`
}

type footer struct {
	KID string `json:"kid"`
}

// Signer issues capabilities. It is held by the control plane only.
type Signer struct {
	kid string
	key paseto.V4AsymmetricSecretKey
	now func() time.Time
}

// NewSigner returns a signer for the Ed25519 private key identified by kid.
func NewSigner(kid string, priv ed25519.PrivateKey) (*Signer, error) {
	if kid == "" || len(kid) > 64 {
		return nil, fmt.Errorf("signer: key id must be 1..64 characters")
	}
	k, err := paseto.NewV4AsymmetricSecretKeyFromEd25519(priv)
	if err != nil {
		return nil, fmt.Errorf("signer: %w", err)
	}
	return &Signer{kid: kid, key: k, now: time.Now}, nil
}

// KeyID is the id of the signing key.
func (s *Signer) KeyID() string { return s.kid }

// Issue signs c. JTI, IssuedAt and Expiry are filled in when zero; Expiry
// defaults to IssuedAt+Lifetime. It refuses claims a receiver would reject.
func (s *Signer) Issue(c Claims) (string, Claims, error) {
	if !c.Purpose.Valid() {
		return "", c, fmt.Errorf("issue: %w: %q", ErrWrongPurpose, c.Purpose)
	}
	if c.Purpose != PurposeControl {
		if err := c.Route.Validate(); err != nil {
			return "", c, fmt.Errorf("issue: %w", err)
		}
	}
	if c.JTI == "" {
		var b [12]byte
		_, _ = rand.Read(b[:])
		c.JTI = hex.EncodeToString(b[:])
	}
	if c.IssuedAt.IsZero() {
		c.IssuedAt = s.now()
	}
	c.IssuedAt = c.IssuedAt.UTC().Truncate(time.Millisecond)
	if c.Expiry.IsZero() {
		c.Expiry = c.IssuedAt.Add(Lifetime)
	}
	c.Expiry = c.Expiry.UTC().Truncate(time.Millisecond)
	if life := c.Expiry.Sub(c.IssuedAt); life <= 0 || life > Lifetime {
		return "", c, fmt.Errorf("issue: %w", ErrLifetime)
	}
	body, err := json.Marshal(c)
	if err != nil {
		return "", c, fmt.Errorf("issue: %w", err)
	}
	f, _ := json.Marshal(footer{KID: s.kid})
	tok, err := paseto.NewTokenFromClaimsJSON(body, f)
	if err != nil {
		return "", c, fmt.Errorf("issue: %w", err)
	}
	return tok.V4Sign(s.key, implicitAssertion), c, nil
}

// Key is a verification key with its validity window.
type Key struct {
	ID     string            `json:"kid"`
	Public ed25519.PublicKey `json:"public"`
	// NotBefore and NotAfter bound when tokens signed by the key are
	// accepted. Zero means unbounded.
	NotBefore time.Time `json:"not_before,omitzero"`
	NotAfter  time.Time `json:"not_after,omitzero"`
}

// Bundle is the set of verification keys receivers trust. It is published
// by the control plane and holds no secrets.
type Bundle struct {
	// Revision increases with every change; receivers ignore older bundles.
	Revision int64 `json:"revision"`
	Keys     []Key `json:"keys"`
}

// Validate checks that every key is well-formed and ids are unique.
func (b Bundle) Validate() error {
	seen := map[string]bool{}
	for _, k := range b.Keys {
		if k.ID == "" || seen[k.ID] {
			return fmt.Errorf("bundle: empty or duplicate key id %q", k.ID)
		}
		if len(k.Public) != ed25519.PublicKeySize {
			return fmt.Errorf("bundle: key %q: public key must be %d bytes", k.ID, ed25519.PublicKeySize)
		}
		seen[k.ID] = true
	}
	return nil
}

// PurposeForEnvdPath maps a path of the guest (envd) API to the purpose a
// capability must carry to reach it. Unknown paths map to nothing: they are
// refused rather than given a default.
func PurposeForEnvdPath(path string) (Purpose, bool) {
	switch {
	case strings.HasPrefix(path, "/process.Process/"):
		return PurposeProcess, true
	case strings.HasPrefix(path, "/filesystem.Filesystem/"):
		return PurposeFilesystem, true
	case path == "/files", path == "/health":
		return PurposeFiles, true
	}
	return "", false
}
