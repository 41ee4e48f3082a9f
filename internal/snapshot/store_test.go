package snapshot

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

func TestLocalPutOpenDelete(t *testing.T) {
	ctx := context.Background()
	l, err := NewLocal(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	n, err := l.Put(ctx, "snap-1", strings.NewReader("hello"))
	if err != nil || n != 5 {
		t.Fatalf("put: %d %v", n, err)
	}
	rc, err := l.Open(ctx, "snap-1")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(rc)
	rc.Close()
	if string(b) != "hello" {
		t.Fatalf("got %q", b)
	}
	// Put of an existing id replaces it.
	if _, err := l.Put(ctx, "snap-1", strings.NewReader("world!")); err != nil {
		t.Fatal(err)
	}
	rc, _ = l.Open(ctx, "snap-1")
	b, _ = io.ReadAll(rc)
	rc.Close()
	if string(b) != "world!" {
		t.Fatalf("after replace %q", b)
	}
	if err := l.Delete(ctx, "snap-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Open(ctx, "snap-1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("open deleted: %v", err)
	}
	if err := l.Delete(ctx, "snap-1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("delete twice: %v", err)
	}
}

type failingReader struct{ n int }

func (f *failingReader) Read(p []byte) (int, error) {
	if f.n <= 0 {
		return 0, errors.New("source broke")
	}
	f.n--
	return copy(p, "partial"), nil
}

// A failed or cancelled Put leaves the previous object and no temp file.
func TestLocalPutIsAtomic(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	l, _ := NewLocal(dir)
	if _, err := l.Put(ctx, "s", strings.NewReader("v1")); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Put(ctx, "s", &failingReader{n: 3}); err == nil {
		t.Fatal("put from a failing reader succeeded")
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := l.Put(cctx, "s", strings.NewReader("v2")); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled put: %v", err)
	}
	rc, _ := l.Open(ctx, "s")
	b, _ := io.ReadAll(rc)
	rc.Close()
	if string(b) != "v1" {
		t.Fatalf("previous object lost: %q", b)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Fatalf("leftover files: %v", ents)
	}
}

func TestLocalRejectsBadIDs(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	l, _ := NewLocal(filepath.Join(dir, "store"))
	os.WriteFile(filepath.Join(dir, "secret"), []byte("x"), 0o600)
	for _, id := range []string{"", ".", "..", "../secret", "a/b", "/etc/passwd", ".tmp-x", "-x", "a\x00b", strings.Repeat("a", MaxIDLen+1), "a b", "é"} {
		if _, err := l.Put(ctx, id, bytes.NewReader(nil)); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("put %q: %v", id, err)
		}
		if _, err := l.Open(ctx, id); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("open %q: %v", id, err)
		}
		if err := l.Delete(ctx, id); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("delete %q: %v", id, err)
		}
	}
	for _, id := range []string{"a", "S1", "sbx1-g7-0123abcd", "x.tar", "a_b", strings.Repeat("z", MaxIDLen)} {
		if err := ValidateID(id); err != nil {
			t.Errorf("valid id %q: %v", id, err)
		}
	}
}

// FuzzValidateID: every accepted id is exactly one path element directly
// inside the store directory, never hidden, never special.
func FuzzValidateID(f *testing.F) {
	for _, s := range []string{"a", "..", "a/../b", "a.b", ".x", "a\x00", "x/", "\\", "snap-1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		if ValidateID(id) != nil {
			return
		}
		base := "/store"
		p := filepath.Join(base, id)
		if filepath.Dir(p) != base || filepath.Base(p) != id {
			t.Fatalf("id %q escapes: %s", id, p)
		}
		if id == "." || id == ".." || strings.HasPrefix(id, ".") || strings.ContainsAny(id, "/\\\x00") || len(id) > MaxIDLen {
			t.Fatalf("accepted %q", id)
		}
	})
}

// A temporary whose writer died (nobody holds its lock) is removed when a
// process opens the directory again; one a live writer holds is not.
func TestNewLocalRemovesDeadWritersTemporaries(t *testing.T) {
	dir := t.TempDir()
	dead := filepath.Join(dir, tmpPrefix+"snap-a-00"+lockedSuffix)
	live := filepath.Join(dir, tmpPrefix+"snap-b-01"+lockedSuffix)
	legacy := filepath.Join(dir, tmpPrefix+"snap-c-02") // an unlocked writer's: kept for an hour
	for _, p := range []string{dead, live, legacy} {
		if err := os.WriteFile(p, []byte("partial"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	f, err := os.Open(live)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	if _, err := NewLocal(dir); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]bool{dead: false, live: true, legacy: true} {
		if _, err := os.Stat(p); (err == nil) != want {
			t.Errorf("%s: exists %v, want %v", filepath.Base(p), err == nil, want)
		}
	}
}
