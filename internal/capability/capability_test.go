package capability

import (
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"strings"
	"testing"
	"time"

	"aidanwoods.dev/go-paseto"

	"github.com/spacesbx/space/internal/identity"
)

var t0 = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

func testRoute() identity.Route {
	return identity.Route{SandboxID: "sbx1", Generation: 7, ExecutionID: "e7", WorkerID: "w1", Substrate: "ns", ActivationID: "a1"}
}

func newPair(t testing.TB, kid string) (*Signer, Key) {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewSigner(kid, priv)
	if err != nil {
		t.Fatal(err)
	}
	s.now = func() time.Time { return t0 }
	return s, Key{ID: kid, Public: pub}
}

func newVerifier(t testing.TB, keys ...Key) *Verifier {
	t.Helper()
	v, err := NewVerifier(Bundle{Revision: 1, Keys: keys})
	if err != nil {
		t.Fatal(err)
	}
	v.SetClock(func() time.Time { return t0 })
	return v
}

func issue(t testing.TB, s *Signer, c Claims) string {
	t.Helper()
	tok, _, err := s.Issue(c)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func TestRoundTrip(t *testing.T) {
	s, k := newPair(t, "k1")
	v := newVerifier(t, k)
	tok := issue(t, s, Claims{Route: testRoute(), Purpose: PurposeFiles, Caller: "team1"})
	for i := 0; i < 2; i++ { // cold, then cached
		c, err := v.Verify(tok, PurposeFiles)
		if err != nil {
			t.Fatalf("verify #%d: %v", i, err)
		}
		if c.Route != testRoute() || c.Caller != "team1" || c.JTI == "" || c.Expiry.Sub(c.IssuedAt) != Lifetime {
			t.Fatalf("claims %+v", c)
		}
	}
}

func TestRejections(t *testing.T) {
	s, k := newPair(t, "k1")
	other, _ := newPair(t, "k1") // same kid, other key: bad signature
	unknown, _ := newPair(t, "k9")
	good := Claims{Route: testRoute(), Purpose: PurposeProcess}
	tok := issue(t, s, good)

	tamper := func(tok string) string {
		b := []byte(tok)
		i := len("v4.public.") + 20
		if b[i] == 'A' {
			b[i] = 'B'
		} else {
			b[i] = 'A'
		}
		return string(b)
	}
	cases := []struct {
		name   string
		token  string
		at     time.Time
		verify func(*Verifier, string) error
		want   error
	}{
		{"bad signature (other key)", issue(t, other, good), t0, nil, ErrBadSignature},
		{"tampered payload", tamper(tok), t0, nil, ErrBadSignature},
		{"unknown kid", issue(t, unknown, good), t0, nil, ErrUnknownKey},
		{"expired at exp+skew+1s", tok, t0.Add(Lifetime + Skew + time.Second), nil, ErrExpired},
		{"future iat beyond skew", issue(t, s, Claims{Route: testRoute(), Purpose: PurposeProcess, IssuedAt: t0.Add(Skew + time.Second)}), t0, nil, ErrNotYetValid},
		{"wrong purpose", tok, t0, func(v *Verifier, s string) error { _, err := v.Verify(s, PurposeFiles); return err }, ErrWrongPurpose},
		{"service port wrong port", issue(t, s, Claims{Route: testRoute(), Purpose: PurposeServicePort, Port: 8000, Protocol: "http"}), t0,
			func(v *Verifier, s string) error { _, err := v.VerifyServicePort(s, 8001, "http"); return err }, ErrWrongPort},
		{"service port wrong protocol", issue(t, s, Claims{Route: testRoute(), Purpose: PurposeServicePort, Port: 8000, Protocol: "http"}), t0,
			func(v *Verifier, s string) error { _, err := v.VerifyServicePort(s, 8000, "tcp"); return err }, ErrWrongPort},
		{"garbage", "not-a-token", t0, nil, ErrMalformed},
		{"v4.local header", "v4.local.abc.def", t0, nil, ErrMalformed},
		{"no footer", strings.Join(strings.Split(tok, ".")[:3], "."), t0, nil, ErrMalformed},
		{"oversized", "v4.public." + strings.Repeat("A", MaxTokenSize) + ".e30", t0, nil, ErrMalformed},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			v := newVerifier(t, k)
			v.SetClock(func() time.Time { return tc.at })
			var err error
			if tc.verify != nil {
				err = tc.verify(v, tc.token)
			} else {
				_, err = v.Verify(tc.token, PurposeProcess)
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
		})
	}
}

func TestExpiryBoundary(t *testing.T) {
	s, k := newPair(t, "k1")
	v := newVerifier(t, k)
	tok := issue(t, s, Claims{Route: testRoute(), Purpose: PurposeProcess})
	v.SetClock(func() time.Time { return t0.Add(Lifetime + Skew) })
	if _, err := v.Verify(tok, PurposeProcess); err != nil {
		t.Fatalf("at exp+skew: %v", err)
	}
	// The cached entry must not outlive the time window.
	v.SetClock(func() time.Time { return t0.Add(Lifetime + Skew + time.Second) })
	if _, err := v.Verify(tok, PurposeProcess); !errors.Is(err, ErrExpired) {
		t.Fatalf("cached token past window: %v", err)
	}
}

func TestLifetimeOverMaximum(t *testing.T) {
	s, k := newPair(t, "k1")
	if _, _, err := s.Issue(Claims{Route: testRoute(), Purpose: PurposeProcess, Expiry: t0.Add(Lifetime + time.Second)}); !errors.Is(err, ErrLifetime) {
		t.Fatalf("signer accepted long lifetime: %v", err)
	}
	// A forged long-lived token (signed by a key holder bypassing Issue)
	// is still rejected by receivers.
	c := Claims{Route: testRoute(), Purpose: PurposeProcess, JTI: "x", IssuedAt: t0, Expiry: t0.Add(10 * time.Minute)}
	tok := signRaw(t, s, c)
	v := newVerifier(t, k)
	if _, err := v.Verify(tok, PurposeProcess); !errors.Is(err, ErrLifetime) {
		t.Fatalf("got %v, want ErrLifetime", err)
	}
}

func TestMissingClaims(t *testing.T) {
	s, k := newPair(t, "k1")
	v := newVerifier(t, k)
	c := Claims{Purpose: PurposeProcess, JTI: "x", IssuedAt: t0, Expiry: t0.Add(time.Minute)}
	if _, err := v.Verify(signRaw(t, s, c), PurposeProcess); !errors.Is(err, ErrMissingClaims) {
		t.Fatalf("got %v", err)
	}
}

func TestKeyRotationWindow(t *testing.T) {
	s, k := newPair(t, "old")
	tok := issue(t, s, Claims{Route: testRoute(), Purpose: PurposeProcess})
	_, k2 := newPair(t, "new")
	k.NotAfter = t0.Add(RetiredKeyGrace)
	v := newVerifier(t, k, k2)
	if _, err := v.Verify(tok, PurposeProcess); err != nil {
		t.Fatalf("old key inside grace: %v", err)
	}
	v.SetClock(func() time.Time { return t0.Add(RetiredKeyGrace + time.Second) })
	if _, err := v.Verify(tok, PurposeProcess); !errors.Is(err, ErrKeyNotValid) && !errors.Is(err, ErrExpired) {
		t.Fatalf("old key after grace: %v", err)
	}
	// Dropping the key from the bundle flushes the cache: unknown kid.
	v.SetClock(func() time.Time { return t0 })
	if err := v.SetBundle(Bundle{Revision: 2, Keys: []Key{k2}}); err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(tok, PurposeProcess); !errors.Is(err, ErrUnknownKey) {
		t.Fatalf("removed key: %v", err)
	}
	// An older bundle does not roll back.
	if err := v.SetBundle(Bundle{Revision: 1, Keys: []Key{k}}); err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(tok, PurposeProcess); !errors.Is(err, ErrUnknownKey) {
		t.Fatalf("stale bundle reinstalled key: %v", err)
	}
}

func TestBundleValidate(t *testing.T) {
	_, k := newPair(t, "k1")
	for name, b := range map[string]Bundle{
		"duplicate": {Keys: []Key{k, k}},
		"empty id":  {Keys: []Key{{Public: k.Public}}},
		"short key": {Keys: []Key{{ID: "x", Public: k.Public[:5]}}},
	} {
		if _, err := NewVerifier(b); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestSignerRefusesInvalid(t *testing.T) {
	s, _ := newPair(t, "k1")
	if _, _, err := s.Issue(Claims{Route: testRoute(), Purpose: "admin"}); err == nil {
		t.Error("unknown purpose issued")
	}
	r := testRoute()
	r.ExecutionID = ""
	if _, _, err := s.Issue(Claims{Route: r, Purpose: PurposeProcess}); err == nil {
		t.Error("incomplete route issued")
	}
}

// FuzzVerify feeds arbitrary tokens to the parser: it must never panic and
// never accept anything it did not sign.
func FuzzVerify(f *testing.F) {
	s, k := newPair(f, "k1")
	v := newVerifier(f, k)
	good := issue(f, s, Claims{Route: testRoute(), Purpose: PurposeProcess})
	f.Add(good)
	f.Add("v4.public.AAAA.eyJraWQiOiJrMSJ9")
	f.Add("v4.public..")
	f.Add("")
	f.Fuzz(func(t *testing.T, tok string) {
		c, err := v.Verify(tok, PurposeProcess)
		if err == nil && tok != good {
			// Only the exact signed token (modulo base64 padding-free
			// encodings that decode identically) may verify.
			if c.Route != testRoute() {
				t.Fatalf("accepted forged token %q", tok)
			}
		}
	})
}

// The verifier parses tokens itself; it must agree with the PASETO library
// in both directions.
func TestVerifierAgreesWithLibrary(t *testing.T) {
	s, k := newPair(t, "k1")
	v := newVerifier(t, k)
	c := Claims{Route: testRoute(), Purpose: PurposeFiles, JTI: "j", IssuedAt: t0, Expiry: t0.Add(time.Minute)}
	lib := signRaw(t, s, c) // signed by the library
	if _, err := v.Verify(lib, PurposeFiles); err != nil {
		t.Fatalf("library-signed token: %v", err)
	}
	pk, _ := paseto.NewV4AsymmetricPublicKeyFromEd25519(k.Public)
	tok := issue(t, s, Claims{Route: testRoute(), Purpose: PurposeFiles})
	if _, err := paseto.MakeParser(nil).ParseV4Public(pk, tok, implicitAssertion); err != nil {
		t.Fatalf("library rejects our token: %v", err)
	}
	// A different implicit assertion (another capability version) fails.
	other := paseto.NewToken()
	other.SetFooter([]byte(`{"kid":"k1"}`))
	if _, err := v.Verify(other.V4Sign(s.key, []byte("space.capability.v0")), PurposeFiles); !errors.Is(err, ErrBadSignature) {
		t.Fatalf("other implicit assertion: %v", err)
	}
	// Two footers, bad base64, short payload.
	for _, bad := range []string{tok + ".x", "v4.public.!!!.e30", "v4.public.AAAA.eyJraWQiOiJrMSJ9"} {
		if _, err := v.Verify(bad, PurposeFiles); !errors.Is(err, ErrMalformed) {
			t.Errorf("%q: %v", bad, err)
		}
	}
}
