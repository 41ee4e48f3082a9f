//go:build linux

package layerstore

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/testenv"
)

const upperID = "sha256:1111111111111111111111111111111111111111111111111111111111111111"

func addBase(t *testing.T, s *Store) string {
	t.Helper()
	data := mkTar(t,
		tent{Name: "etc/", Type: tar.TypeDir},
		tent{Name: "etc/conf", Body: "v1\n"},
		tent{Name: "etc/gone", Body: "bye\n"},
		tent{Name: "data/", Type: tar.TypeDir},
		tent{Name: "data/a", Body: "a"},
		tent{Name: "data/b", Body: "b"},
		tent{Name: "data/sub/", Type: tar.TypeDir},
		tent{Name: "data/sub/c", Body: "c"},
		tent{Name: "data/sub/deeper/d", Body: "d"},
		tent{Name: "keep/", Type: tar.TypeDir},
		tent{Name: "keep/k", Body: "k"},
		tent{Name: "usr/lib/x", Body: "x"},
		tent{Name: "lib", Type: tar.TypeSymlink, Link: "usr/lib"},
		tent{Name: "home/u/", Type: tar.TypeDir, Uid: 1000, Gid: 1000, Mode: 0o750},
	)
	dir, err := s.Add(context.Background(), "sha256:"+strings.Repeat("b", 64), func(dir string) error {
		_, err := ApplyTar(dir, bytes.NewReader(data), ApplyOptions{})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

func mountOverlay(t *testing.T, target, opts string, flags uintptr) {
	t.Helper()
	if err := os.MkdirAll(target, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("overlay", target, "overlay", flags, opts); err != nil {
		testenv.Skipf(t, "overlay mount %q: %v", opts, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestAddFromUpper: changes made through a real overlay mount, copied from
// its upper dir into a layer, give the same view as the upper itself when
// the layer is stacked on the base.
func TestAddFromUpper(t *testing.T) {
	testenv.RequireRoot(t, "overlay mounts, whiteouts, trusted.* xattrs")
	for _, userxattr := range []bool{false, true} {
		name := "trusted"
		if userxattr {
			name = "userxattr"
		}
		t.Run(name, func(t *testing.T) {
			s := newStore(t)
			base := addBase(t, s)
			tmp := t.TempDir()
			upper, work, merged := filepath.Join(tmp, "upper"), filepath.Join(tmp, "work"), filepath.Join(tmp, "merged")
			for _, d := range []string{upper, work} {
				must(t, os.Mkdir(d, 0o755))
			}
			extra := ",redirect_dir=off,metacopy=off"
			if userxattr {
				extra = ",userxattr"
			}
			mountOverlay(t, merged, "lowerdir="+base+",upperdir="+upper+",workdir="+work+extra, 0)
			m := func(p string) string { return filepath.Join(merged, p) }
			must(t, os.WriteFile(m("new.txt"), []byte("new"), 0o640))
			must(t, os.Chown(m("new.txt"), 1000, 1001))
			must(t, os.Link(m("new.txt"), m("new2.txt")))
			must(t, os.WriteFile(m("etc/conf"), []byte("v2\n"), 0o600)) // copy-up
			must(t, unix.Chmod(m("etc/conf"), 0o600))
			must(t, os.Remove(m("etc/gone")))    // whiteout
			must(t, os.Remove(m("data/a")))      // whiteout
			must(t, os.RemoveAll(m("data/sub"))) // dir replaced: opaque
			must(t, os.Mkdir(m("data/sub"), 0o700))
			must(t, os.WriteFile(m("data/sub/fresh"), []byte("f"), 0o644))
			must(t, os.RemoveAll(m("keep"))) // dir replaced by a file
			must(t, os.WriteFile(m("keep"), []byte("now a file"), 0o644))
			must(t, os.WriteFile(m("suid"), []byte("ELF"), 0o755))
			must(t, unix.Chmod(m("suid"), 0o4755))
			must(t, os.Symlink("/etc/conf", m("home/u/link")))
			must(t, unix.Mkfifo(m("fifo"), 0o600))
			must(t, unix.Setxattr(m("new.txt"), "user.note", []byte("hello"), 0))
			must(t, os.MkdirAll(m("deep/x/y"), 0o755))
			must(t, os.Chmod(m("home/u"), 0o700))
			must(t, unix.Unmount(merged, 0))

			// The upper holds overlay's own forms of the changes.
			if !isWhiteout(t, filepath.Join(upper, "data/a")) {
				t.Fatal("upper: data/a is no whiteout")
			}
			ns := opaqueTrusted
			if userxattr {
				ns = opaqueUser
			}
			if getX(t, filepath.Join(upper, "data/sub"), ns) != "y" {
				t.Fatalf("upper: data/sub not opaque in %s", ns)
			}

			layer, err := s.AddFromUpper(context.Background(), upperID, upper)
			if err != nil {
				t.Fatalf("AddFromUpper: %v", err)
			}
			if !isWhiteout(t, filepath.Join(layer, "data/a")) || !isWhiteout(t, filepath.Join(layer, "etc/gone")) {
				t.Error("layer: whiteouts missing")
			}
			for _, k := range []string{opaqueTrusted, opaqueUser} {
				if getX(t, filepath.Join(layer, "data/sub"), k) != "y" {
					t.Errorf("layer: data/sub lacks %s", k)
				}
				if getX(t, filepath.Join(layer, "data"), k) != "" {
					t.Errorf("layer: data (not opaque) has %s", k)
				}
			}
			if a, b := lstat(t, filepath.Join(layer, "new.txt")), lstat(t, filepath.Join(layer, "new2.txt")); a.Ino != b.Ino {
				t.Error("layer: hard link split")
			}
			for _, p := range []string{"new.txt", "etc", "data", "data/sub"} {
				for _, k := range []string{"trusted.overlay.origin", "trusted.overlay.impure", "user.overlay.origin", "user.overlay.impure"} {
					if getX(t, filepath.Join(layer, p), k) != "" {
						t.Errorf("layer: %s kept %s", p, k)
					}
				}
			}

			// The views: base+upper (read-only, as the sandbox saw it)
			// and base+layer, both mounted for real, must be equal. The
			// layer view is mounted both with and without userxattr:
			// the layer form serves both.
			w2 := filepath.Join(tmp, "work2")
			must(t, os.Mkdir(w2, 0o755))
			viewUpper := filepath.Join(tmp, "view-upper")
			mountOverlay(t, viewUpper, "lowerdir="+base+",upperdir="+upper+",workdir="+w2+extra, unix.MS_RDONLY)
			want := treeState(t, viewUpper, true)
			for _, ux := range []bool{false, true} {
				opts := "lowerdir=" + layer + ":" + base
				if ux {
					opts += ",userxattr"
				}
				viewLayer := filepath.Join(tmp, "view-layer")
				if ux {
					viewLayer += "-userxattr"
				}
				mountOverlay(t, viewLayer, opts, unix.MS_RDONLY)
				got := treeState(t, viewLayer, true)
				if d := diffStates(want, got); len(d) > 0 {
					t.Errorf("view of base+layer (userxattr=%v) differs from base+upper:\n%s", ux, strings.Join(d, "\n"))
				}
			}
			// Not a vacuous comparison: the changes are visible.
			for p, present := range map[string]bool{"data/a": false, "etc/gone": false, "data/sub/c": false, "data/sub/deeper": false,
				"data/sub/fresh": true, "data/b": true, "keep/k": false, "new2.txt": true, "deep/x/y": true, "lib": true} {
				if _, ok := want[p]; ok != present {
					t.Errorf("view: %s present=%v, want %v", p, ok, present)
				}
			}
			if !strings.Contains(want["suid"], "mode=104755") || !strings.Contains(want["etc/conf"], "mode=100600") {
				t.Errorf("view: suid %q etc/conf %q", want["suid"], want["etc/conf"])
			}
			t.Logf("view: %d nodes", len(want))
		})
	}
}

func TestAddFromUpperRefusesRedirectAndMetacopy(t *testing.T) {
	testenv.RequireRoot(t, "trusted.* xattrs")
	for _, tc := range []struct{ name, path, xattr string }{
		{"redirect", "d", "trusted.overlay.redirect"},
		{"redirect-user", "d", "user.overlay.redirect"},
		{"metacopy", "f", "trusted.overlay.metacopy"},
		{"metacopy-user", "f", "user.overlay.metacopy"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t)
			upper := t.TempDir()
			must(t, os.Mkdir(filepath.Join(upper, "d"), 0o755))
			must(t, os.WriteFile(filepath.Join(upper, "f"), nil, 0o644))
			must(t, unix.Setxattr(filepath.Join(upper, tc.path), tc.xattr, []byte("/elsewhere"), 0))
			_, err := s.AddFromUpper(context.Background(), upperID, upper)
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("AddFromUpper = %v, want ErrInvalid", err)
			}
			if _, err := s.Dir(upperID); !errors.Is(err, errdefs.ErrNotFound) {
				t.Fatalf("layer published after a refusal: %v", err)
			}
		})
	}
}

// TestAddFromUpperDoesNotFollowSymlinks: symlinks in the upper (the
// sandbox's own) are copied as symlinks, never followed to host files.
func TestAddFromUpperDoesNotFollowSymlinks(t *testing.T) {
	testenv.RequireRoot(t, "chown")
	s := newStore(t)
	upper := t.TempDir()
	secret := filepath.Join(t.TempDir(), "secret")
	must(t, os.WriteFile(secret, []byte("host secret"), 0o600))
	must(t, os.Symlink(secret, filepath.Join(upper, "s")))
	must(t, os.Symlink(filepath.Dir(secret), filepath.Join(upper, "d")))
	must(t, unix.Mknod(filepath.Join(upper, "mem"), unix.S_IFCHR|0o600, int(unix.Mkdev(1, 1))))
	layer, err := s.AddFromUpper(context.Background(), upperID, upper)
	if err != nil {
		t.Fatal(err)
	}
	if l, _ := os.Readlink(filepath.Join(layer, "s")); l != secret {
		t.Errorf("s -> %q", l)
	}
	if fi, err := os.Lstat(filepath.Join(layer, "d")); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Errorf("d not a symlink: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(layer, "mem")); !os.IsNotExist(err) {
		t.Errorf("device node copied: %v", err)
	}
}
