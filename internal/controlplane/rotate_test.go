package controlplane

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
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

	// The key file is replaced (0600) and nothing is pending.
	fi, err := os.Stat(filepath.Join(e.dir, SigningKeyFile))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("signing key file: %v %v", fi, err)
	}
	if _, err := os.Stat(filepath.Join(e.dir, nextKeyFile)); !os.IsNotExist(err) {
		t.Fatalf("pending key left: %v", err)
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

func TestKeyRotationResumesAfterCrash(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	oldKID := e.srv.KeyID()
	e.srv.Close()
	// A crash after the new key was written: the next start adopts it and
	// retires the old one.
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	if err := writeKeyFile(e.dir, nextKeyFile, priv); err != nil {
		t.Fatal(err)
	}
	e.start(nil)
	if e.srv.KeyID() == oldKID {
		t.Fatal("pending key not adopted")
	}
	b, _ := st.GetBundle(context.Background())
	var old capability.Key
	for _, k := range b.Keys {
		if k.ID == oldKID {
			old = k
		}
	}
	if old.ID == "" || old.NotAfter.IsZero() || len(b.Keys) != 2 {
		t.Fatalf("bundle after adoption %+v", b)
	}
	if _, err := os.Stat(filepath.Join(e.dir, nextKeyFile)); !os.IsNotExist(err) {
		t.Fatal("pending key file left")
	}
}
