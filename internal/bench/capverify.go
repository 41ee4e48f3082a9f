package bench

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"strings"
	"time"

	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/identity"
)

// CapResult holds capability-verification timings, each the median over
// rounds of the per-operation mean within a round, in microseconds.
type CapResult struct {
	ColdUS, CachedUS, RawEd25519US float64
	Rounds, ColdPerRound           int
	TokenBytes, SignedBytes        int
}

// CapFixture is a signer, a verifier trusting it and the raw material for
// the Ed25519 baseline: the exact bytes PASETO v4.public signs for a token.
type CapFixture struct {
	Signer   *capability.Signer
	Verifier *capability.Verifier
	pub      ed25519.PublicKey
	priv     ed25519.PrivateKey
}

// NewCapFixture returns a fresh key pair, signer and verifier.
func NewCapFixture() (*CapFixture, error) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	s, err := capability.NewSigner("bench", priv)
	if err != nil {
		return nil, err
	}
	v, err := capability.NewVerifier(capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "bench", Public: pub}}})
	if err != nil {
		return nil, err
	}
	return &CapFixture{Signer: s, Verifier: v, pub: pub, priv: priv}, nil
}

// benchRoute is a realistic route identity (ids of production length).
func benchRoute() identity.Route {
	return identity.Route{
		SandboxID: "i8c2kq7x3m1n0p9r4s5t", Generation: 1, ExecutionID: "4f0c9d2b7a6e5f1c8d3b2a19",
		WorkerID: "w1", Substrate: identity.SubstrateNS, ActivationID: "9a8b7c6d5e4f3a2b",
	}
}

// Issue returns n distinct files capabilities (distinct jti each).
func (f *CapFixture) Issue(n int) ([]string, error) {
	toks := make([]string, n)
	for i := range toks {
		t, _, err := f.Signer.Issue(capability.Claims{Route: benchRoute(), Purpose: capability.PurposeFiles, Caller: "bench"})
		if err != nil {
			return nil, err
		}
		toks[i] = t
	}
	return toks, nil
}

// SignedMessage returns the bytes the Ed25519 signature of tok covers
// (PASETO PAE(header, message, footer, implicit assertion)) and the
// signature, so the baseline verifies a message of exactly the same size.
func SignedMessage(tok string) (msg, sig []byte, err error) {
	const header = "v4.public."
	rest, ok := strings.CutPrefix(tok, header)
	if !ok {
		return nil, nil, fmt.Errorf("not a v4.public token")
	}
	body, foot, _ := strings.Cut(rest, ".")
	raw, err := base64.RawURLEncoding.DecodeString(body)
	if err != nil || len(raw) < ed25519.SignatureSize {
		return nil, nil, fmt.Errorf("token body: %v", err)
	}
	footer, err := base64.RawURLEncoding.DecodeString(foot)
	if err != nil {
		return nil, nil, fmt.Errorf("token footer: %v", err)
	}
	m, sig := raw[:len(raw)-ed25519.SignatureSize], raw[len(raw)-ed25519.SignatureSize:]
	pieces := [][]byte{[]byte(header), m, footer, []byte("space.capability.v1")}
	msg = binary.LittleEndian.AppendUint64(nil, uint64(len(pieces)))
	for _, p := range pieces {
		msg = binary.LittleEndian.AppendUint64(msg, uint64(len(p)))
		msg = append(msg, p...)
	}
	return msg, sig, nil
}

// MeasureCapability times raw Ed25519 verification, cold capability
// verification (every token verified once: signature, decode, checks, cache
// insert) and cached verification (cache hit: hash, lookup, purpose and
// time checks), interleaved round by round so drift hits all three alike.
func MeasureCapability(rounds, coldPerRound, cachedPerRound int) (CapResult, error) {
	f, err := NewCapFixture()
	if err != nil {
		return CapResult{}, err
	}
	toks, err := f.Issue(rounds * coldPerRound)
	if err != nil {
		return CapResult{}, err
	}
	msg, sig, err := SignedMessage(toks[0])
	if err != nil {
		return CapResult{}, err
	}
	if !ed25519.Verify(f.pub, msg, sig) {
		return CapResult{}, fmt.Errorf("baseline message does not verify: PAE reconstruction is wrong")
	}
	hot := toks[0]
	if _, err := f.Verifier.Verify(hot, capability.PurposeFiles); err != nil {
		return CapResult{}, err
	}
	var raw, cold, cached []float64
	for r := range rounds {
		t0 := time.Now()
		for range coldPerRound {
			if !ed25519.Verify(f.pub, msg, sig) {
				return CapResult{}, fmt.Errorf("raw verify failed")
			}
		}
		raw = append(raw, usPerOp(time.Since(t0), coldPerRound))

		batch := toks[r*coldPerRound : (r+1)*coldPerRound]
		if r == 0 {
			batch = batch[1:] // toks[0] is the cached one
		}
		t0 = time.Now()
		for _, t := range batch {
			if _, err := f.Verifier.Verify(t, capability.PurposeFiles); err != nil {
				return CapResult{}, err
			}
		}
		cold = append(cold, usPerOp(time.Since(t0), len(batch)))

		t0 = time.Now()
		for range cachedPerRound {
			if _, err := f.Verifier.Verify(hot, capability.PurposeFiles); err != nil {
				return CapResult{}, err
			}
		}
		cached = append(cached, usPerOp(time.Since(t0), cachedPerRound))
	}
	return CapResult{
		ColdUS: Median(cold), CachedUS: Median(cached), RawEd25519US: Median(raw),
		Rounds: rounds, ColdPerRound: coldPerRound, TokenBytes: len(hot), SignedBytes: len(msg),
	}, nil
}

func usPerOp(d time.Duration, n int) float64 {
	return float64(d) / float64(time.Microsecond) / float64(n)
}
