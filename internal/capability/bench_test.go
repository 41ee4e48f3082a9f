package capability

import (
	"testing"
)

// BenchmarkVerifyCold measures a full verification: footer parse, Ed25519
// signature, claims decode and checks (cache disabled).
func BenchmarkVerifyCold(b *testing.B) {
	s, k := newPair(b, "k1")
	v := newVerifier(b, k)
	v.max = 0
	tok := issue(b, s, Claims{Route: testRoute(), Purpose: PurposeFiles})
	b.ReportAllocs()
	for b.Loop() {
		v.mu.Lock()
		clear(v.cache)
		v.mu.Unlock()
		if _, err := v.Verify(tok, PurposeFiles); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkVerifyCached measures a cache hit: SHA-256 of the token, lookup,
// and the purpose, key and time checks that are never cached.
func BenchmarkVerifyCached(b *testing.B) {
	s, k := newPair(b, "k1")
	v := newVerifier(b, k)
	tok := issue(b, s, Claims{Route: testRoute(), Purpose: PurposeFiles})
	if _, err := v.Verify(tok, PurposeFiles); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := v.Verify(tok, PurposeFiles); err != nil {
			b.Fatal(err)
		}
	}
}
