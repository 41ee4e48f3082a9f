//go:build linux

package layerstore

import (
	"archive/tar"
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/testenv"
)

func capV3(rootid uint32) string {
	b := make([]byte, capSizeV3)
	binary.LittleEndian.PutUint32(b, capRevision3|1) // effective
	binary.LittleEndian.PutUint32(b[4:], 1<<10)      // CAP_NET_BIND_SERVICE permitted
	binary.LittleEndian.PutUint32(b[20:], rootid)
	return string(b)
}

func TestApplyTarLayerForm(t *testing.T) {
	testenv.RequireRoot(t, "device nodes (whiteouts), chown, trusted.* xattrs")
	dir := t.TempDir()
	data := mkTar(t,
		tent{Name: "./", Type: tar.TypeDir, Mode: 0o755},
		tent{Name: "etc/", Type: tar.TypeDir, Mode: 0o755},
		tent{Name: "etc/passwd", Body: "root:x:0:0::/root:/bin/sh\n"},
		tent{Name: "usr/bin/su", Body: "ELF", Mode: 0o4755},           // implicit parents, setuid
		tent{Name: "usr/bin/wall", Body: "ELF", Mode: 0o2755, Gid: 5}, // setgid
		tent{Name: "usr/bin/ping", Body: "ELF", Mode: 0o755, Xattrs: map[string]string{"security.capability": capV3(100000)}},
		tent{Name: "home/u/f", Body: "hi", Mode: 0o600, Uid: 1000, Gid: 1000, Xattrs: map[string]string{
			"user.note": "kept", "user.overlay.redirect": "/etc", "trusted.overlay.opaque": "y", "trusted.evil": "x", "security.selinux": "x"}},
		tent{Name: "bin", Type: tar.TypeSymlink, Link: "usr/bin"},
		tent{Name: "usr/bin/su2", Type: tar.TypeLink, Link: "usr/bin/su"},
		tent{Name: "run/fifo", Type: tar.TypeFifo, Mode: 0o600},
		tent{Name: "dev/null", Type: tar.TypeChar, Major: 1, Minor: 3},
		tent{Name: "dev/sda", Type: tar.TypeBlock, Major: 8, Minor: 0},
		tent{Name: "var/lib/.wh.gone", Body: ""},
		tent{Name: "opt/.wh..wh..opq", Body: ""},
		tent{Name: "opt/keep", Body: "k"},
		tent{Name: ".wh..wh.plnk", Body: ""},
		tent{Name: "tmp/dup", Body: "first"},
		tent{Name: "tmp/dup", Body: "second"},
		tent{Name: "tmp/.wh.dup", Body: ""}, // the layer's own file wins
		tent{Name: "tmp/d", Type: tar.TypeDir, Mode: 0o700},
		tent{Name: "tmp/d/x", Body: "x"},
		tent{Name: "tmp/d", Type: tar.TypeDir, Mode: 0o1777}, // dir over dir keeps children
		tent{Name: "tmp/f2d", Body: "file"},
		tent{Name: "tmp/f2d", Type: tar.TypeDir},
	)
	st, err := ApplyTar(dir, bytes.NewReader(data), ApplyOptions{})
	if err != nil {
		t.Fatalf("ApplyTar: %v", err)
	}
	t.Logf("stats %+v", st)
	if st.Devices != 2 || st.Whiteouts != 1 || st.Opaques != 1 || st.Hardlinks != 1 || st.Symlinks != 1 || st.FIFOs != 1 {
		t.Errorf("stats %+v", st)
	}
	if st.XattrsDropped != 4 {
		t.Errorf("XattrsDropped = %d, want 4 (user.overlay.*, trusted.*, trusted.*, security.selinux)", st.XattrsDropped)
	}
	for _, p := range []string{"dev/null", "dev/sda"} {
		if _, err := os.Lstat(filepath.Join(dir, p)); !os.IsNotExist(err) {
			t.Errorf("%s: device node created (%v)", p, err)
		}
	}
	if s := lstat(t, filepath.Join(dir, "usr/bin/su")); s.Mode&0o7777 != 0o4755 || s.Uid != 0 {
		t.Errorf("su mode %o uid %d, want setuid 4755 root", s.Mode&0o7777, s.Uid)
	}
	if s := lstat(t, filepath.Join(dir, "usr/bin/wall")); s.Mode&0o7777 != 0o2755 || s.Gid != 5 {
		t.Errorf("wall mode %o gid %d", s.Mode&0o7777, s.Gid)
	}
	if a, b := lstat(t, filepath.Join(dir, "usr/bin/su")), lstat(t, filepath.Join(dir, "usr/bin/su2")); a.Ino != b.Ino {
		t.Error("hard link not linked")
	}
	if s := lstat(t, filepath.Join(dir, "home/u/f")); s.Uid != 1000 || s.Gid != 1000 || s.Mode&0o7777 != 0o600 || s.Mtim.Sec != testTime.Unix() {
		t.Errorf("home/u/f: uid %d gid %d mode %o mtime %d", s.Uid, s.Gid, s.Mode&0o7777, s.Mtim.Sec)
	}
	if got := getX(t, filepath.Join(dir, "home/u/f"), "user.note"); got != "kept" {
		t.Errorf("user.note = %q", got)
	}
	for _, k := range []string{"user.overlay.redirect", "trusted.overlay.opaque", "trusted.evil", "security.selinux"} {
		if got := getX(t, filepath.Join(dir, "home/u/f"), k); got != "" {
			t.Errorf("%s kept: %q", k, got)
		}
	}
	capv := getX(t, filepath.Join(dir, "usr/bin/ping"), "security.capability")
	if len(capv) != capSizeV2 || binary.LittleEndian.Uint32([]byte(capv))&capRevisionMask != capRevision2 {
		t.Errorf("security.capability not turned into v2: %x", capv)
	}
	if l, _ := os.Readlink(filepath.Join(dir, "bin")); l != "usr/bin" {
		t.Errorf("bin -> %q", l)
	}
	if s := lstat(t, filepath.Join(dir, "run/fifo")); s.Mode&unix.S_IFMT != unix.S_IFIFO {
		t.Error("fifo missing")
	}
	if !isWhiteout(t, filepath.Join(dir, "var/lib/gone")) {
		t.Error("var/lib/gone: no 0:0 whiteout")
	}
	if _, err := os.Lstat(filepath.Join(dir, "var/lib/.wh.gone")); !os.IsNotExist(err) {
		t.Error(".wh. file itself written")
	}
	for _, k := range []string{opaqueTrusted, opaqueUser} {
		if getX(t, filepath.Join(dir, "opt"), k) != "y" {
			t.Errorf("opt: %s not set", k)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "tmp/dup")); string(b) != "second" {
		t.Errorf("tmp/dup = %q (later entry wins, whiteout of own file ignored)", b)
	}
	if s := lstat(t, filepath.Join(dir, "tmp/d")); s.Mode&0o7777 != 0o1777 {
		t.Errorf("tmp/d mode %o", s.Mode&0o7777)
	}
	if _, err := os.Stat(filepath.Join(dir, "tmp/d/x")); err != nil {
		t.Error("dir over dir dropped children")
	}
	if s := lstat(t, filepath.Join(dir, "tmp/f2d")); s.Mode&unix.S_IFMT != unix.S_IFDIR {
		t.Error("tmp/f2d not replaced by a directory")
	}
	if s := lstat(t, filepath.Join(dir, "tmp/d")); s.Mtim.Sec != testTime.Unix() {
		t.Errorf("dir mtime %d, want %d", s.Mtim.Sec, testTime.Unix())
	}
	for _, p := range []string{".wh..wh.plnk", "opt/.wh..wh..opq"} {
		if _, err := os.Lstat(filepath.Join(dir, p)); !os.IsNotExist(err) {
			t.Errorf("%s written", p)
		}
	}
}

// hostileCase is one hostile layer: either it is refused with wantErr, or
// it is applied and check says what landed (inside dir).
type hostileCase struct {
	name    string
	ents    func(sentinel string) []tent
	opt     ApplyOptions
	wantErr error
	check   func(t *testing.T, dir, sentinel string, st ApplyStats)
}

func hostileCases() []hostileCase {
	file := func(n string) tent { return tent{Name: n, Body: "pwned"} }
	inside := func(p string) func(t *testing.T, dir, _ string, _ ApplyStats) {
		return func(t *testing.T, dir, _ string, _ ApplyStats) {
			if b, err := os.ReadFile(filepath.Join(dir, p)); err != nil || string(b) != "pwned" {
				t.Errorf("%s inside the layer: %q %v", p, b, err)
			}
		}
	}
	return []hostileCase{
		{name: "dotdot", ents: func(s string) []tent { return []tent{file("../sentinel/keep")} }, wantErr: errdefs.ErrInvalid},
		{name: "dotdot-middle", ents: func(s string) []tent { return []tent{file("a/../../sentinel/new")} }, wantErr: errdefs.ErrInvalid},
		{name: "dotdot-dir", ents: func(s string) []tent { return []tent{{Name: "../sentinel", Type: tar.TypeDir, Mode: 0o777}} }, wantErr: errdefs.ErrInvalid},
		{name: "absolute", ents: func(s string) []tent { return []tent{file(s + "/keep")} }, wantErr: errdefs.ErrInvalid},
		{name: "symlink-to-root-then-file", ents: func(s string) []tent {
			return []tent{{Name: "r", Type: tar.TypeSymlink, Link: "/"}, file("r" + s + "/keep")}
		}, check: func(t *testing.T, dir, s string, _ ApplyStats) { inside(s+"/keep")(t, dir, s, ApplyStats{}) }},
		{name: "symlink-to-dotdot-then-file", ents: func(s string) []tent {
			return []tent{{Name: "up", Type: tar.TypeSymlink, Link: ".."}, file("up/sentinel/keep")}
		}, check: inside("sentinel/keep")},
		{name: "symlink-deep-dotdot", ents: func(s string) []tent {
			return []tent{{Name: "a/b/up", Type: tar.TypeSymlink, Link: "../../../../../../.."}, file("a/b/up/sentinel/keep")}
		}, check: inside("sentinel/keep")},
		{name: "symlink-absolute-host-path", ents: func(s string) []tent {
			return []tent{{Name: s[1:], Type: tar.TypeDir}, {Name: "s", Type: tar.TypeSymlink, Link: s}, file("s/keep")}
		}, check: func(t *testing.T, dir, s string, _ ApplyStats) { inside(s+"/keep")(t, dir, s, ApplyStats{}) }},
		{name: "symlink-absolute-host-path-dangling", ents: func(s string) []tent {
			return []tent{{Name: "s", Type: tar.TypeSymlink, Link: s}, file("s/keep")}
		}, wantErr: errdefs.ErrInvalid},
		{name: "symlink-chain", ents: func(s string) []tent {
			return []tent{{Name: "sentinel", Type: tar.TypeDir}, {Name: "a", Type: tar.TypeSymlink, Link: "b"}, {Name: "b", Type: tar.TypeSymlink, Link: "../../sentinel"}, file("a/keep")}
		}, check: inside("sentinel/keep")},
		{name: "symlink-proc-magic", ents: func(s string) []tent {
			return []tent{{Name: "p", Type: tar.TypeSymlink, Link: "/proc/self/root"}, file("p" + s + "/keep")}
		}, wantErr: errdefs.ErrInvalid},
		{name: "file-over-escaping-symlink", ents: func(s string) []tent {
			return []tent{{Name: "k", Type: tar.TypeSymlink, Link: s + "/keep"}, file("k")}
		}, check: inside("k")},
		{name: "dir-over-escaping-symlink", ents: func(s string) []tent {
			return []tent{{Name: "d", Type: tar.TypeSymlink, Link: s}, {Name: "d", Type: tar.TypeDir, Mode: 0o777}}
		}, check: func(t *testing.T, dir, _ string, _ ApplyStats) {
			if st := lstat(t, filepath.Join(dir, "d")); st.Mode&unix.S_IFMT != unix.S_IFDIR {
				t.Error("d is not a directory")
			}
		}},
		{name: "whiteout-through-symlink", ents: func(s string) []tent {
			return []tent{{Name: "sentinel", Type: tar.TypeDir}, {Name: "s", Type: tar.TypeSymlink, Link: "../sentinel"}, {Name: "s/.wh.new", Body: ""}}
		}, check: func(t *testing.T, dir, _ string, _ ApplyStats) {
			if !isWhiteout(t, filepath.Join(dir, "sentinel/new")) {
				t.Error("whiteout not made inside the layer")
			}
		}},
		{name: "opaque-through-symlink", ents: func(s string) []tent {
			return []tent{{Name: "sentinel", Type: tar.TypeDir}, {Name: "s", Type: tar.TypeSymlink, Link: "../sentinel"}, {Name: "s/.wh..wh..opq", Body: ""}}
		}, check: func(t *testing.T, dir, _ string, _ ApplyStats) {
			if getX(t, filepath.Join(dir, "sentinel"), opaqueTrusted) != "y" {
				t.Error("opaque marker not set inside the layer")
			}
		}},
		{name: "hardlink-outside-dotdot", ents: func(s string) []tent {
			return []tent{{Name: "h", Type: tar.TypeLink, Link: "../sentinel/keep"}}
		}, wantErr: errdefs.ErrInvalid},
		{name: "hardlink-absolute", ents: func(s string) []tent { return []tent{{Name: "h", Type: tar.TypeLink, Link: s + "/keep"}} }, wantErr: errdefs.ErrInvalid},
		{name: "hardlink-not-yet-seen", ents: func(s string) []tent {
			return []tent{{Name: "h", Type: tar.TypeLink, Link: "later"}, file("later")}
		}, wantErr: errdefs.ErrInvalid},
		{name: "hardlink-through-symlink", ents: func(s string) []tent {
			return []tent{{Name: "s", Type: tar.TypeSymlink, Link: s}, {Name: "h", Type: tar.TypeLink, Link: "s/keep"}}
		}, wantErr: errdefs.ErrInvalid},
		{name: "hardlink-to-dir", ents: func(s string) []tent {
			return []tent{{Name: "d", Type: tar.TypeDir}, {Name: "h", Type: tar.TypeLink, Link: "d"}}
		}, wantErr: errdefs.ErrInvalid},
		{name: "hardlink-to-itself", ents: func(s string) []tent {
			return []tent{file("f"), {Name: "f", Type: tar.TypeLink, Link: "f"}}
		}, wantErr: errdefs.ErrInvalid},
		{name: "hardlink-to-escaping-symlink", ents: func(s string) []tent {
			// Links the symlink itself (never its target).
			return []tent{{Name: "s", Type: tar.TypeSymlink, Link: s + "/keep"}, {Name: "h", Type: tar.TypeLink, Link: "s"}}
		}, check: func(t *testing.T, dir, s string, _ ApplyStats) {
			if l, err := os.Readlink(filepath.Join(dir, "h")); err != nil || l != s+"/keep" {
				t.Errorf("h: %q %v", l, err)
			}
		}},
		{name: "hardlink-target-replaced-by-dir-symlink", ents: func(s string) []tent {
			return []tent{file("a/f"), {Name: "a", Type: tar.TypeSymlink, Link: "../sentinel"}, {Name: "h", Type: tar.TypeLink, Link: "a/f"}}
		}, wantErr: errdefs.ErrInvalid},
		{name: "devices-skipped", ents: func(s string) []tent {
			return []tent{{Name: "mem", Type: tar.TypeChar, Major: 1, Minor: 1}, {Name: "sda", Type: tar.TypeBlock, Major: 8}, {Name: "zero", Type: tar.TypeChar}}
		}, check: func(t *testing.T, dir, _ string, st ApplyStats) {
			ents, _ := os.ReadDir(dir)
			if len(ents) != 0 || st.Devices != 3 {
				t.Errorf("devices: %d entries in dir, %d counted", len(ents), st.Devices)
			}
		}},
		{name: "whiteout-dot", ents: func(s string) []tent { return []tent{{Name: "a/.wh..", Body: ""}} }, wantErr: errdefs.ErrInvalid},
		{name: "whiteout-empty", ents: func(s string) []tent { return []tent{{Name: "a/.wh.", Body: ""}} }, wantErr: errdefs.ErrInvalid},
		{name: "parent-is-file", ents: func(s string) []tent { return []tent{file("f"), file("f/x")} }, wantErr: errdefs.ErrInvalid},
		{name: "parent-dangling-symlink", ents: func(s string) []tent {
			return []tent{{Name: "d", Type: tar.TypeSymlink, Link: "nowhere"}, file("d/x")}
		}, wantErr: errdefs.ErrInvalid},
		{name: "parent-symlink-loop", ents: func(s string) []tent {
			return []tent{{Name: "l", Type: tar.TypeSymlink, Link: "l"}, file("l/x")}
		}, wantErr: errdefs.ErrInvalid},
		{name: "root-not-dir", ents: func(s string) []tent { return []tent{file(".")} }, wantErr: errdefs.ErrInvalid},
		{name: "unknown-type", ents: func(s string) []tent { return []tent{{Name: "v", Type: 'Z'}} }, wantErr: errdefs.ErrInvalid},
		{name: "huge-size", ents: func(s string) []tent { return []tent{{Name: "big", Size: 1 << 40}} }, wantErr: errdefs.ErrTooLarge},
		{name: "too-many-bytes", opt: ApplyOptions{MaxBytes: 10}, ents: func(s string) []tent {
			return []tent{{Name: "a", Body: "123456"}, {Name: "b", Body: "123456"}}
		}, wantErr: errdefs.ErrTooLarge},
		{name: "too-many-entries", opt: ApplyOptions{MaxEntries: 5}, ents: func(s string) []tent {
			var e []tent
			for i := range 6 {
				e = append(e, tent{Name: "f" + string(rune('a'+i)), Body: ""})
			}
			return e
		}, wantErr: errdefs.ErrTooLarge},
		{name: "too-many-implicit-dirs", opt: ApplyOptions{MaxEntries: 5}, ents: func(s string) []tent {
			return []tent{file("a/b/c/d/e/f/g")}
		}, wantErr: errdefs.ErrTooLarge},
		{name: "too-deep", opt: ApplyOptions{MaxDepth: 8}, ents: func(s string) []tent {
			return []tent{file(strings.Repeat("d/", 8) + "f")}
		}, wantErr: errdefs.ErrTooLarge},
		{name: "truncated", ents: func(s string) []tent { return []tent{{Name: "t", Size: 100}} }, wantErr: errdefs.ErrInvalid},
	}
}

func sentinelDir(t testing.TB) (base, sentinel, dir string) {
	t.Helper()
	base = t.TempDir()
	sentinel = filepath.Join(base, "sentinel")
	dir = filepath.Join(base, "layer")
	for _, d := range []string{sentinel, dir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(sentinel, "keep"), []byte("original"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("keep", filepath.Join(sentinel, "link")); err != nil {
		t.Fatal(err)
	}
	return base, sentinel, dir
}

func TestApplyTarHostile(t *testing.T) {
	testenv.RequireRoot(t, "device nodes (whiteouts), chown, trusted.* xattrs")
	for _, tc := range hostileCases() {
		t.Run(tc.name, func(t *testing.T) {
			base, sentinel, dir := sentinelDir(t)
			before := treeState(t, base, true)
			delete(before, "layer")
			data := mkTar(t, tc.ents(sentinel)...)
			st, err := ApplyTar(dir, bytes.NewReader(data), tc.opt)
			if tc.wantErr != nil {
				var ae *ApplyError
				if !errors.Is(err, tc.wantErr) || !errors.As(err, &ae) {
					t.Fatalf("err = %v, want an *ApplyError matching %v", err, tc.wantErr)
				}
				t.Logf("refused: %v", err)
			} else {
				if err != nil {
					t.Fatalf("ApplyTar: %v", err)
				}
				tc.check(t, dir, sentinel, st)
			}
			after := treeState(t, base, true)
			for k := range after {
				if k == "layer" || strings.HasPrefix(k, "layer/") {
					delete(after, k)
				}
			}
			if d := diffStates(before, after); len(d) > 0 {
				t.Fatalf("outside the layer changed:\n%s", strings.Join(d, "\n"))
			}
		})
	}
}

func TestApplyTarNotADirectory(t *testing.T) {
	_, err := ApplyTar(filepath.Join(t.TempDir(), "missing"), bytes.NewReader(nil), ApplyOptions{})
	if err == nil {
		t.Fatal("ApplyTar into a missing dir succeeded")
	}
}

func TestApplyTarMalformed(t *testing.T) {
	dir := t.TempDir()
	_, err := ApplyTar(dir, strings.NewReader(strings.Repeat("not a tar archive ", 64)), ApplyOptions{})
	if !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("err = %v, want ErrInvalid", err)
	}
}

func TestFilterXattr(t *testing.T) {
	v2 := make([]byte, capSizeV2)
	binary.LittleEndian.PutUint32(v2, capRevision2)
	for _, tc := range []struct {
		name string
		val  []byte
		keep bool
	}{
		{"user.x", []byte("1"), true},
		{"user.overlay.opaque", []byte("y"), false},
		{"trusted.overlay.opaque", []byte("y"), false},
		{"trusted.x", []byte("y"), false},
		{"security.selinux", []byte("x"), false},
		{"security.ima", []byte("x"), false},
		{"system.posix_acl_access", []byte("x"), true},
		{"security.capability", v2, true},
		{"security.capability", []byte(capV3(5)), true},
		{"security.capability", v2[:7], false},
		{"security.capability", []byte("\x00\x00\x00\x09garbagegarbage12"), false},
	} {
		v, ok := filterXattr(tc.name, tc.val)
		if ok != tc.keep {
			t.Errorf("%s %x: kept=%v, want %v", tc.name, tc.val, ok, tc.keep)
		}
		if ok && tc.name == "security.capability" && binary.LittleEndian.Uint32(v)&capRevisionMask == capRevision3 {
			t.Errorf("v3 capability kept as v3")
		}
	}
}

// BenchmarkApplyTar: a layer of 2000 files of 16 KiB in 20 directories.
func BenchmarkApplyTar(b *testing.B) {
	testenv.RequireRoot(b, "chown")
	var ents []tent
	body := strings.Repeat("x", 16<<10)
	for i := range 2000 {
		ents = append(ents, tent{Name: filepath.Join("d"+string(rune('a'+i%20)), "f"+strings.Repeat("0", i%7)+string(rune('a'+i%26))+string(rune('a'+i/26%26))+string(rune('a'+i/676))), Body: body})
	}
	data := mkTar(b, ents...)
	b.SetBytes(int64(len(data)))
	b.ResetTimer()
	for b.Loop() {
		dir := b.TempDir()
		if _, err := ApplyTar(dir, bytes.NewReader(data), ApplyOptions{}); err != nil {
			b.Fatal(err)
		}
	}
}
