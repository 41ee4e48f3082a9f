//go:build linux

package volume

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
)

func u32(v uint32) *uint32 { return &v }

// The content operations, and what a sandbox may have left in a volume
// (symlinks out, "..") never reaching outside it.
func TestContent(t *testing.T) {
	m := newManager(t, t.TempDir(), 16<<20)
	ctx := context.Background()
	id := NewID()
	d, err := m.OpenDir(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()

	e, err := d.WriteFile("/a/b/hello.txt", strings.NewReader("hi"), Attrs{}, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if e.Type != "file" || e.Size != 2 || e.UID != UserID || e.GID != GroupID || e.Mode != 0o644 || e.Path != "/a/b/hello.txt" || e.Name != "hello.txt" {
		t.Fatalf("written %+v", e)
	}
	if e, err := d.Stat("/a/b"); err != nil || e.Type != "directory" || e.UID != UserID || e.Mode != 0o755 {
		t.Fatalf("parent made %+v %v", e, err)
	}
	if _, err := d.WriteFile("/a/b/hello.txt", strings.NewReader("again"), Attrs{Mode: u32(0o600), UID: u32(0)}, 1<<20); err != nil {
		t.Fatal(err)
	}
	f, err := d.Open("a/b/../b/hello.txt")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(f)
	f.Close()
	if string(b) != "again" {
		t.Fatalf("read %q", b)
	}
	if e, _ := d.Stat("/a/b/hello.txt"); e.Mode != 0o600 || e.UID != 0 {
		t.Fatalf("attrs on overwrite %+v", e)
	}
	if _, err := d.WriteFile("/big", strings.NewReader(strings.Repeat("x", 100)), Attrs{}, 10); !errors.Is(err, errdefs.ErrTooLarge) {
		t.Fatalf("over the limit: %v", err)
	}
	// Mkdir: parents only with force; an existing dir is a conflict without it.
	if _, err := d.Mkdir("/x/y", Attrs{}, false); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("mkdir without parents: %v", err)
	}
	if _, err := d.Mkdir("/x/y", Attrs{Mode: u32(0o700)}, true); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Mkdir("/x/y", Attrs{}, false); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("mkdir of an existing dir: %v", err)
	}
	if e, err := d.SetAttrs("/x/y", Attrs{Mode: u32(0o750), GID: u32(5)}); err != nil || e.Mode != 0o750 || e.GID != 5 || e.UID != UserID {
		t.Fatalf("set attrs %+v %v", e, err)
	}
	if _, err := d.SetAttrs("/x/y", Attrs{UID: u32(70000)}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("uid past 65535: %v", err)
	}
	list, err := d.List("/", 1)
	if err != nil || len(list) != 2 {
		t.Fatalf("list depth 1: %+v %v", list, err)
	}
	if list, err := d.List("/", 3); err != nil || len(list) != 5 {
		t.Fatalf("list depth 3: %+v %v", list, err)
	}

	// What a sandbox may leave: links out of the volume. Files are made
	// through the host view (as a sandbox would through its mount).
	host, release, err := m.Acquire(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	secret := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(secret, []byte("host secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, target := range map[string]string{"abs": secret, "up": "../../../../../../" + secret, "dirout": filepath.Dir(secret)} {
		if err := os.Symlink(target, filepath.Join(host, name)); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []string{"/abs", "/up", "/../../" + secret, "/dirout/secret"} {
		if f, err := d.Open(p); err == nil {
			b, _ := io.ReadAll(f)
			f.Close()
			if strings.Contains(string(b), "host secret") {
				t.Fatalf("read %s reached the host file", p)
			}
		}
	}
	if _, err := d.WriteFile("/dirout/secret", strings.NewReader("pwned"), Attrs{}, 100); err == nil {
		if b, _ := os.ReadFile(secret); string(b) != "host secret" {
			t.Fatal("write through a symlinked dir reached the host")
		}
	}
	if e, err := d.Stat("/abs"); err != nil || e.Type != "symlink" || e.Target != secret {
		t.Fatalf("stat of a symlink %+v %v", e, err)
	}
	if _, err := d.SetAttrs("/abs", Attrs{Mode: u32(0o777)}); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(secret); fi.Mode().Perm() != 0o600 {
		t.Fatal("chmod followed a symlink out")
	}
	if err := d.Remove("/dirout"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(secret); err != nil {
		t.Fatalf("remove of a symlink removed its target: %v", err)
	}
	if err := d.Remove("/a"); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Stat("/a/b/hello.txt"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("after remove: %v", err)
	}
	for _, bad := range []string{"/", "/.."} {
		if err := d.Remove(bad); !errors.Is(err, errdefs.ErrInvalid) {
			t.Fatalf("remove %q: %v", bad, err)
		}
	}
	if _, err := Clean("a\x00b"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatal("NUL accepted")
	}
}
