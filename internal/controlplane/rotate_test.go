package controlplane

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

func tokenKID(t *testing.T, tok string) string {
	t.Helper()
	parts := strings.Split(tok, ".")
	if len(parts) != 4 {
		t.Fatalf("token has %d parts", len(parts))
	}
	raw, err := base64.RawURLEncoding.DecodeString(parts[3])
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		KID string `json:"kid"`
	}
	if err := json.Unmarshal(raw, &f); err != nil {
		t.Fatal(err)
	}
	return f.KID
}

func TestKeyRotation(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, func(c *Config) { c.KeyPropagation = 50 * time.Millisecond })
	n1 := newFakeNode(t, "w1", st)
	e.register(n1, 10)
	sb := createV2(t, e, map[string]any{"templateID": "base"})
	ctx := context.Background()

	oldCap, _ := e.capability(sb.SandboxID)
	oldKID := e.srv.KeyID()
	if tokenKID(t, oldCap.Token) != oldKID {
		t.Fatal("token kid is not the signing key's")
	}

	// Admin only.
	user := "e2b_" + strings.Repeat("c", 40)
	if err := st.PutAPIKey(ctx, store.HashAPIKey(user), store.APIKeyRecord{TeamID: DefaultTeamID, KeyID: "u", Role: store.RoleUser}); err != nil {
		t.Fatal(err)
	}
	expectError(t, e.do("POST", "/space/v1/keys/rotate", map[string]string{"X-API-Key": user}, nil), 403)
	expectError(t, e.do("POST", "/space/v1/keys/rotate", map[string]string{"X-API-Key": edgeKey}, nil), 403)
	expectError(t, e.do("POST", "/space/v1/keys/rotate", nil, nil), 401)

	start := e.clock.Now()
	r := e.api("POST", "/space/v1/keys/rotate", nil)
	if r.Code != 200 {
		t.Fatalf("rotate: %d %s", r.Code, r.Body)
	}
	var out spacev1.RotateResponse
	r.decode(t, &out)
	if out.PreviousKeyID != oldKID || out.KeyID == oldKID || out.KeyID != e.srv.KeyID() || len(out.Keys) != 2 {
		t.Fatalf("rotate response %+v", out)
	}
	b, err := st.GetBundle(ctx)
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]capability.Key{}
	for _, k := range b.Keys {
		keys[k.ID] = k
	}
	oldKey, newKey := keys[oldKID], keys[out.KeyID]
	if len(keys) != 2 || newKey.ID == "" || !newKey.NotAfter.IsZero() || b.Revision != out.BundleRevision {
		t.Fatalf("bundle %+v", b)
	}
	wantNA := start.Add(50*time.Millisecond + capability.RetiredKeyGrace)
	if d := oldKey.NotAfter.Sub(wantNA); d < -time.Second || d > time.Second {
		t.Fatalf("old key NotAfter %s, want about %s", oldKey.NotAfter, wantNA)
	}
	// New tokens use the new kid and verify with the published bundle.
	newCap, _ := e.capability(sb.SandboxID)
	if tokenKID(t, newCap.Token) != out.KeyID {
		t.Fatal("new token not signed with the new key")
	}
	v, err := capability.NewVerifier(b)
	if err != nil {
		t.Fatal(err)
	}
	now := e.clock.Now()
	v.SetClock(func() time.Time { return now })
	if _, err := v.Verify(oldCap.Token, capability.PurposeProcess); err != nil {
		t.Fatalf("old token within grace: %v", err)
	}
	if _, err := v.Verify(newCap.Token, capability.PurposeProcess); err != nil {
		t.Fatalf("new token: %v", err)
	}
	// Past the old key's NotAfter its tokens are rejected even if a token
	// claimed a later expiry.
	later := oldKey.NotAfter.Add(time.Second)
	v.SetClock(func() time.Time { return later })
	if _, err := v.Verify(oldCap.Token, capability.PurposeProcess); err == nil {
		t.Fatal("old key's token accepted after NotAfter")
	}
	// The control calls to workers use the new key too.
	if _, _, err := n1.counts(); err != nil {
		t.Fatal(err)
	}

	// The store's current key is the new one, nothing is pending, and no
	// key file was written to the data dir.
	if k, err := st.GetSigningKey(ctx); err != nil || k.ID != out.KeyID {
		t.Fatalf("stored key %s %v, want %s", k.ID, err, out.KeyID)
	}
	if _, _, err := st.GetRotation(ctx); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("rotation left pending: %v", err)
	}
	for _, f := range []string{SigningKeyFile, nextKeyFile} {
		if _, err := os.Stat(filepath.Join(e.dir, f)); !os.IsNotExist(err) {
			t.Fatalf("%s written: %v", f, err)
		}
	}
	// A restart signs with the new key.
	e.srv.Close()
	e.start(func(c *Config) { c.KeyPropagation = -1 })
	if e.srv.KeyID() != out.KeyID {
		t.Fatalf("restart uses %s, want %s", e.srv.KeyID(), out.KeyID)
	}
	// A later rotation, past the old key's NotAfter, prunes it.
	e.clock.Advance(capability.RetiredKeyGrace + time.Minute)
	r = e.api("POST", "/space/v1/keys/rotate", nil)
	if r.Code != 200 {
		t.Fatalf("second rotate: %d %s", r.Code, r.Body)
	}
	b, _ = st.GetBundle(ctx)
	for _, k := range b.Keys {
		if k.ID == oldKID {
			t.Fatalf("expired key still in bundle %+v", b)
		}
	}
	if len(b.Keys) != 2 {
		t.Fatalf("bundle %+v", b)
	}
}

// A replica that dies after beginning a rotation (its record is in the
// store, its key maybe published) leaves a rotation the leader completes:
// the new key becomes everyone's, the old one retires.
func TestKeyRotationResumesAfterCrash(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	oldKID := e.srv.KeyID()
	e.srv.Close()
	ctx := context.Background()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, _ := x509.MarshalPKCS8PrivateKey(priv)
	now := e.clock.Now()
	rot := store.Rotation{Key: store.SigningKey{ID: KeyID(priv.Public().(ed25519.PublicKey)), PKCS8: der, Created: now},
		Owner: "cp-dead", Started: now, SignAfter: time.Now(), PreviousID: oldKID, PreviousNotAfter: now.Add(capability.RetiredKeyGrace)}
	if _, err := st.BeginRotation(ctx, rot, 0); err != nil {
		t.Fatal(err)
	}
	// Serialised: a second rotation cannot begin meanwhile.
	if _, err := st.BeginRotation(ctx, rot, 0); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second rotation began: %v", err)
	}
	e.start(nil)
	waitFor(t, func() bool { return e.srv.KeyID() == rot.Key.ID })
	if _, _, err := st.GetRotation(ctx); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("rotation still pending: %v", err)
	}
	b, _ := st.GetBundle(ctx)
	var old capability.Key
	for _, k := range b.Keys {
		if k.ID == oldKID {
			old = k
		}
	}
	if old.ID == "" || old.NotAfter.IsZero() || len(b.Keys) != 2 {
		t.Fatalf("bundle after completion %+v", b)
	}
	if k, _ := st.GetSigningKey(ctx); k.ID != rot.Key.ID {
		t.Fatalf("stored key %s", k.ID)
	}
}

// A rotation whose owner is alive is not taken over: a second rotate
// is refused with 409 until it completes.
func TestKeyRotationSerialised(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, func(c *Config) { c.KeyPropagation = time.Hour })
	e2 := newEnv(t, st, nil)
	done := make(chan resp, 1)
	go func() { done <- e.api("POST", "/space/v1/keys/rotate", nil) }()
	waitFor(t, func() bool { _, _, err := st.GetRotation(context.Background()); return err == nil })
	expectError(t, e2.do("POST", "/space/v1/keys/rotate", map[string]string{"X-API-Key": e.key}, nil), 409)
	expectError(t, e.api("POST", "/space/v1/keys/rotate", nil), 409)
	e.srv.Close() // the rotation in flight fails with the replica
	if r := <-done; r.Code != 503 {
		t.Fatalf("rotate during close: %d %s", r.Code, r.Body)
	}
}

// An install whose control plane kept its key in the data dir keeps it;
// a rotation that release had interrupted (signing.key.next) is adopted.
func TestKeyMigratedFromDataDir(t *testing.T) {
	for _, pending := range []bool{false, true} {
		st := openStore(t)
		e := &env{t: t, st: st, dir: t.TempDir(), clock: &fakeClock{t: time.Now()}}
		_, old, _ := ed25519.GenerateKey(rand.Reader)
		_, next, _ := ed25519.GenerateKey(rand.Reader)
		if err := writeKeyFile(e.dir, SigningKeyFile, old); err != nil {
			t.Fatal(err)
		}
		want := old
		if pending {
			if err := writeKeyFile(e.dir, nextKeyFile, next); err != nil {
				t.Fatal(err)
			}
			want = next
			// The old key is published, as the old release did.
			if _, err := publishKey(context.Background(), st, KeyID(old.Public().(ed25519.PublicKey)), old.Public().(ed25519.PublicKey), time.Now()); err != nil {
				t.Fatal(err)
			}
		}
		e.start(nil)
		kid := KeyID(want.Public().(ed25519.PublicKey))
		if e.srv.KeyID() != kid {
			t.Fatalf("pending=%v: kid %s want %s", pending, e.srv.KeyID(), kid)
		}
		if k, err := st.GetSigningKey(context.Background()); err != nil || k.ID != kid {
			t.Fatalf("stored %s %v", k.ID, err)
		}
		b, _ := st.GetBundle(context.Background())
		if pending && (len(b.Keys) != 2 || b.Keys[0].NotAfter.IsZero()) {
			t.Fatalf("pending adoption bundle %+v", b)
		}
		// A replica with another key file joins with the stored key.
		e2 := &env{t: t, st: st, dir: t.TempDir(), clock: e.clock}
		_, other, _ := ed25519.GenerateKey(rand.Reader)
		_ = writeKeyFile(e2.dir, SigningKeyFile, other)
		e2.start(nil)
		if e2.srv.KeyID() != kid {
			t.Fatalf("second replica kid %s want %s", e2.srv.KeyID(), kid)
		}
	}
}

// writeKeyFile writes priv (PKCS#8 PEM, 0600) to dir/name, as the
// per-replica release did.
func writeKeyFile(dir, name string, priv ed25519.PrivateKey) error {
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600)
}

// A stored key that does not parse, or whose id is not its key's, stops
// the replica (it is never replaced by another); so does a key file left
// in the data dir that others may read.
func TestBadSigningKeyRefused(t *testing.T) {
	_, priv, _ := ed25519.GenerateKey(rand.Reader)
	der, _ := x509.MarshalPKCS8PrivateKey(priv)
	for name, k := range map[string]store.SigningKey{
		"junk":     {ID: "ed25519-0000000000000000", PKCS8: []byte("junk")},
		"wrong id": {ID: "ed25519-0000000000000000", PKCS8: der},
	} {
		st := openStore(t)
		if _, _, err := st.InitSigningKey(context.Background(), k); err != nil {
			t.Fatal(err)
		}
		if _, err := New(Config{DataDir: t.TempDir()}, Deps{Store: st, Logger: quiet()}); err == nil {
			t.Fatalf("%s: stored key accepted", name)
		}
		if got, _ := st.GetSigningKey(context.Background()); got.ID != k.ID {
			t.Fatalf("%s: stored key replaced", name)
		}
	}
	st := openStore(t)
	dir := t.TempDir()
	if err := writeKeyFile(dir, SigningKeyFile, priv); err != nil {
		t.Fatal(err)
	}
	_ = os.Chmod(filepath.Join(dir, SigningKeyFile), 0o644)
	if _, err := New(Config{DataDir: dir}, Deps{Store: st, Logger: quiet()}); err == nil {
		t.Fatal("world-readable key file migrated")
	}
	if _, err := st.GetSigningKey(context.Background()); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a key was stored: %v", err)
	}
}
