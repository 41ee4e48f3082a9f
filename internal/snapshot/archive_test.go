//go:build linux

package snapshot

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/testenv"
)

func needRoot(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t, "owners, whiteouts, trusted xattrs")
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func setTime(t *testing.T, p string, sec, nsec int64) {
	t.Helper()
	ts := []unix.Timespec{{Sec: sec, Nsec: nsec}, {Sec: sec, Nsec: nsec}}
	must(t, unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW))
}

// describe renders every entry under dir: type, mode, owner, mtime (ns),
// link target or content hash, device, kept xattrs, and hard-link groups.
func describe(t *testing.T, dir string) string {
	t.Helper()
	var lines []string
	inodes := map[uint64][]string{}
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		must(t, err)
		rel, _ := filepath.Rel(dir, p)
		if rel == "." {
			return nil
		}
		var s unix.Stat_t
		must(t, unix.Lstat(p, &s))
		l := fmt.Sprintf("%s type=%o mode=%o uid=%d gid=%d", rel, s.Mode&unix.S_IFMT, s.Mode&0o7777, s.Uid, s.Gid)
		if s.Mode&unix.S_IFMT != unix.S_IFDIR {
			l += fmt.Sprintf(" mtime=%d.%09d", s.Mtim.Sec, s.Mtim.Nsec)
		} else {
			l += fmt.Sprintf(" mtime=%d.%09d", s.Mtim.Sec, s.Mtim.Nsec)
		}
		switch s.Mode & unix.S_IFMT {
		case unix.S_IFLNK:
			target, _ := os.Readlink(p)
			l += " -> " + target
		case unix.S_IFREG:
			b, _ := os.ReadFile(p)
			sum := sha256.Sum256(b)
			l += " sha=" + hex.EncodeToString(sum[:6])
			if s.Nlink > 1 {
				inodes[s.Ino] = append(inodes[s.Ino], rel)
			}
		case unix.S_IFCHR:
			l += fmt.Sprintf(" dev=%d:%d", unix.Major(s.Rdev), unix.Minor(s.Rdev))
		}
		if xa, err := readXattrs(p); err == nil && len(xa) > 0 {
			var ks []string
			for k, v := range xa {
				ks = append(ks, k+"="+v)
			}
			sort.Strings(ks)
			l += " xattrs=" + strings.Join(ks, ",")
		}
		lines = append(lines, l)
		return nil
	})
	for _, g := range inodes {
		sort.Strings(g)
		lines = append(lines, "hardlinks "+strings.Join(g, "="))
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

func TestArchiveRestoreRoundTrip(t *testing.T) {
	needRoot(t)
	src := t.TempDir()
	p := func(s string) string { return filepath.Join(src, s) }
	must(t, os.MkdirAll(p("etc/conf.d"), 0o755))
	must(t, os.Mkdir(p("opaque"), 0o750))
	must(t, unix.Setxattr(p("opaque"), "trusted.overlay.opaque", []byte("y"), 0))
	must(t, os.Mkdir(p("uopaque"), 0o700))
	must(t, unix.Setxattr(p("uopaque"), "user.overlay.opaque", []byte("y"), 0))
	must(t, os.WriteFile(p("etc/hosts"), []byte("127.0.0.1 localhost\n"), 0o644))
	must(t, os.Chown(p("etc/hosts"), 1000, 1001))
	must(t, unix.Setxattr(p("etc/hosts"), "user.note", []byte("kept"), 0))
	must(t, unix.Setxattr(p("etc/hosts"), "trusted.overlay.origin", []byte("dropped"), 0))
	must(t, unix.Setxattr(p("etc/hosts"), "security.capability", []byte("\x01\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"), 0))
	must(t, os.WriteFile(p("suid"), []byte("#!/bin/sh\n"), 0o755))
	must(t, os.Chmod(p("suid"), 0o4755|os.ModeSetuid))
	must(t, unix.Chmod(p("suid"), 0o4755))
	must(t, os.WriteFile(p("opaque/inner"), bytes.Repeat([]byte("x"), 1<<20+7), 0o600))
	must(t, os.Link(p("opaque/inner"), p("etc/conf.d/hard")))
	must(t, os.Symlink("/etc/passwd", p("abs-link")))
	must(t, os.Symlink("../hosts", p("etc/conf.d/rel-link")))
	must(t, unix.Lchown(p("abs-link"), 7, 8))
	must(t, unix.Mknod(p("etc/whiteout"), unix.S_IFCHR, 0))
	must(t, unix.Mkfifo(p("fifo"), 0o640))
	must(t, unix.Mknod(p("null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3)))) // left out
	l, err := net.Listen("unix", p("sock"))                                   // left out
	must(t, err)
	l.Close()
	must(t, os.Mkdir(p("sticky"), 0o755))
	must(t, unix.Chmod(p("sticky"), 0o1777))
	for _, n := range []string{"etc/hosts", "suid", "opaque/inner", "abs-link", "etc/whiteout", "fifo", "etc/conf.d/rel-link"} {
		setTime(t, p(n), 1700000000, 123456789)
	}
	for _, n := range []string{"etc/conf.d", "etc", "opaque", "uopaque", "sticky"} {
		setTime(t, p(n), 1600000000, 987654321)
	}
	os.Remove(p("sock"))
	l, _ = net.Listen("unix", p("sock"))
	defer l.Close()
	os.Remove(p("null"))
	must(t, unix.Mknod(p("null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))

	var buf bytes.Buffer
	st, err := Archive(context.Background(), src, &buf, ArchiveOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if st.Skipped != 2 {
		t.Fatalf("skipped %d, want 2 (socket, device)", st.Skipped)
	}
	dst := t.TempDir()
	rst, err := Restore(context.Background(), bytes.NewReader(buf.Bytes()), dst, RestoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if rst.Entries != st.Entries || rst.Bytes != st.Bytes {
		t.Fatalf("restore stats %+v, archive %+v", rst, st)
	}
	os.Remove(p("sock"))
	os.Remove(p("null"))
	// Dropped xattrs are not expected after restore.
	must(t, unix.Removexattr(p("etc/hosts"), "trusted.overlay.origin"))
	must(t, unix.Removexattr(p("etc/hosts"), "security.capability"))
	// Opaque directories come back marked in both of overlayfs's forms
	// (with and without userxattr).
	must(t, unix.Setxattr(p("opaque"), "user.overlay.opaque", []byte("y"), 0))
	must(t, unix.Setxattr(p("uopaque"), "trusted.overlay.opaque", []byte("y"), 0))
	setTime(t, p("etc/hosts"), 1700000000, 123456789)
	setTime(t, p("etc"), 1600000000, 987654321)
	setTime(t, src, 1, 0)
	want, got := describe(t, src), describe(t, dst)
	if want != got {
		t.Fatalf("round trip differs\nwant:\n%s\ngot:\n%s", want, got)
	}
	for _, s := range []string{"xattrs=trusted.overlay.opaque=y,user.overlay.opaque=y", "xattrs=user.note=kept", "dev=0:0", "mode=4755", "mode=1777", "-> /etc/passwd", "hardlinks etc/conf.d/hard=opaque/inner", "uid=1000 gid=1001"} {
		if !strings.Contains(got, s) {
			t.Errorf("restored tree lacks %q:\n%s", s, got)
		}
	}
	// Restore refuses a non-empty target.
	if _, err := Restore(context.Background(), bytes.NewReader(buf.Bytes()), dst, RestoreOptions{}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("restore into non-empty dir: %v", err)
	}
}

// TestOverlayRoundTrip mounts a real overlay, deletes and replaces lower
// content (whiteouts, opaque dirs), archives the upper dir, restores it
// into a fresh upper dir and checks that the merged view is the same.
func TestOverlayRoundTrip(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	d := func(s string) string { return filepath.Join(base, s) }
	for _, s := range []string{"lower/dir/sub", "upper", "work", "merged", "upper2", "work2", "merged2"} {
		must(t, os.MkdirAll(d(s), 0o755))
	}
	must(t, os.WriteFile(d("lower/gone"), []byte("lower"), 0o644))
	must(t, os.WriteFile(d("lower/dir/old"), []byte("lower"), 0o644))
	must(t, os.WriteFile(d("lower/kept"), []byte("lower"), 0o644))
	mount := func(upper, work, merged string) {
		t.Helper()
		opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", d("lower"), d(upper), d(work))
		if err := unix.Mount("overlay", d(merged), "overlay", 0, opts); err != nil {
			testenv.Skipf(t, "overlay mount: %v", err)
		}
	}
	mount("upper", "work", "merged")
	m := func(s string) string { return filepath.Join(d("merged"), s) }
	must(t, os.Remove(m("gone")))      // whiteout
	must(t, os.RemoveAll(m("dir")))    // whiteout, then ...
	must(t, os.Mkdir(m("dir"), 0o700)) // ... an opaque dir
	must(t, os.WriteFile(m("dir/new"), []byte("upper"), 0o600))
	must(t, os.WriteFile(m("kept"), []byte("changed"), 0o644)) // copy-up
	must(t, os.Symlink("kept", m("link")))
	must(t, unix.Unmount(d("merged"), 0))

	var buf bytes.Buffer
	if _, err := Archive(context.Background(), d("upper"), &buf, ArchiveOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := Restore(context.Background(), &buf, d("upper2"), RestoreOptions{}); err != nil {
		t.Fatal(err)
	}
	mount("upper2", "work2", "merged2")
	defer unix.Unmount(d("merged2"), 0)
	m2 := func(s string) string { return filepath.Join(d("merged2"), s) }
	if _, err := os.Lstat(m2("gone")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("whiteout lost: gone is back (%v)", err)
	}
	if _, err := os.Lstat(m2("dir/old")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("opaque dir lost: dir/old is back (%v)", err)
	}
	if b, _ := os.ReadFile(m2("dir/new")); string(b) != "upper" {
		t.Errorf("dir/new = %q", b)
	}
	if b, _ := os.ReadFile(m2("kept")); string(b) != "changed" {
		t.Errorf("kept = %q", b)
	}
	if b, _ := os.ReadFile(m2("link")); string(b) != "changed" {
		t.Errorf("link = %q", b)
	}
}

type entry struct {
	hdr  tar.Header
	body string
}

func buildTar(t *testing.T, es ...entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range es {
		h := e.hdr
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.body))
		}
		if h.Mode == 0 && h.Typeflag != tar.TypeChar {
			h.Mode = 0o644
		}
		h.Format = tar.FormatPAX
		h.ModTime = time.Unix(1700000000, 0)
		must(t, tw.WriteHeader(&h))
		if e.body != "" {
			tw.Write([]byte(e.body))
		}
	}
	must(t, tw.Close())
	return buf.Bytes()
}

func reg(name, body string) entry {
	return entry{tar.Header{Name: name, Typeflag: tar.TypeReg}, body}
}
func dir(name string) entry {
	return entry{tar.Header{Name: name, Typeflag: tar.TypeDir, Mode: 0o755}, ""}
}
func symlink(name, target string) entry {
	return entry{tar.Header{Name: name, Typeflag: tar.TypeSymlink, Linkname: target}, ""}
}
func hardlink(name, target string) entry {
	return entry{tar.Header{Name: name, Typeflag: tar.TypeLink, Linkname: target}, ""}
}

func TestRestoreRejectsHostileArchives(t *testing.T) {
	needRoot(t)
	xattr := func(e entry, k, v string) entry {
		e.hdr.PAXRecords = map[string]string{xattrPrefix + k: v}
		return e
	}
	cases := map[string][]byte{
		"absolute path":        buildTar(t, reg("/tmp/evil", "x")),
		"dotdot":               buildTar(t, reg("../evil", "x")),
		"inner dotdot":         buildTar(t, dir("a/"), reg("a/../../evil", "x")),
		"dot component":        buildTar(t, dir("a/"), reg("a/./b", "x")),
		"symlink escape":       buildTar(t, symlink("l", "/OUTSIDE"), reg("l/evil", "x")),
		"relative symlink dir": buildTar(t, dir("d/"), symlink("l", "d"), reg("l/evil", "x")),
		"symlink then dir":     buildTar(t, symlink("l", "/OUTSIDE"), dir("l/")),
		"missing parent":       buildTar(t, reg("nodir/file", "x")),
		"device node":          buildTar(t, entry{tar.Header{Name: "mem", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 1}, ""}),
		"block device":         buildTar(t, entry{tar.Header{Name: "sda", Typeflag: tar.TypeBlock, Devmajor: 8}, ""}),
		"hardlink outside":     buildTar(t, hardlink("pw", "/etc/passwd")),
		"hardlink dotdot":      buildTar(t, hardlink("pw", "../OUTSIDE")),
		"hardlink to symlink":  buildTar(t, symlink("l", "/etc/shadow"), hardlink("pw", "l")),
		"hardlink to later":    buildTar(t, hardlink("pw", "f"), reg("f", "x")),
		"duplicate":            buildTar(t, reg("f", "x"), reg("f", "y")),
		"file capability":      buildTar(t, xattr(reg("f", "x"), "security.capability", "x")),
		"overlay redirect":     buildTar(t, xattr(dir("d/"), "trusted.overlay.redirect", "/etc")),
		"xattr on symlink":     buildTar(t, xattr(symlink("l", "x"), "user.a", "b")),
		"gnu sparse":           buildTar(t, entry{tar.Header{Name: "s", Typeflag: tar.TypeGNUSparse}, ""}),
		"garbage":              bytes.Repeat([]byte("not a tar archive "), 64),
	}
	for name, data := range cases {
		t.Run(name, func(t *testing.T) {
			base := t.TempDir()
			outside := filepath.Join(base, "OUTSIDE")
			must(t, os.Mkdir(outside, 0o755))
			target := filepath.Join(base, "upper")
			must(t, os.Mkdir(target, 0o755))
			_, err := Restore(context.Background(), bytes.NewReader(data), target, RestoreOptions{})
			var ae *ArchiveError
			if !errors.As(err, &ae) || !errors.Is(err, ErrHostileArchive) || !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("want *ArchiveError, got %v", err)
			}
			if ents, _ := os.ReadDir(outside); len(ents) > 0 {
				t.Fatalf("wrote outside the target: %v", ents)
			}
			if _, err := os.Lstat(filepath.Join(base, "evil")); err == nil {
				t.Fatal("wrote outside the target")
			}
		})
	}
	// Limits.
	base := t.TempDir()
	_, err := Restore(context.Background(), bytes.NewReader(buildTar(t, reg("a", "0123456789"))), base, RestoreOptions{Limits: Limits{MaxBytes: 5}})
	if !errors.Is(err, ErrHostileArchive) {
		t.Fatalf("max bytes: %v", err)
	}
	base = t.TempDir()
	_, err = Restore(context.Background(), bytes.NewReader(buildTar(t, reg("a", ""), reg("b", ""))), base, RestoreOptions{Limits: Limits{MaxEntries: 1}})
	if !errors.Is(err, ErrHostileArchive) {
		t.Fatalf("max entries: %v", err)
	}
	// A truncated archive fails.
	good := buildTar(t, reg("a", strings.Repeat("x", 4096)))
	base = t.TempDir()
	if _, err := Restore(context.Background(), bytes.NewReader(good[:1024]), base, RestoreOptions{}); err == nil {
		t.Fatal("truncated archive restored")
	}
}

// FuzzRestore: no input makes Restore write outside its target or panic.
func FuzzRestore(f *testing.F) {
	testenv.RequireRoot(f, "owners, whiteouts, trusted xattrs")
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.WriteHeader(&tar.Header{Name: "d/f", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1})
	tw.Write([]byte("x"))
	tw.WriteHeader(&tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "../x"})
	tw.Close()
	f.Add(buf.Bytes())
	// A sparse file: holes, then extents written at their offsets.
	buf.Reset()
	tw = tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "s", Typeflag: TypeSparse, Mode: 0o644, Size: 5, Format: tar.FormatPAX,
		PAXRecords: map[string]string{sparseRecord: "65536,0,2,4096,3"}})
	tw.Write([]byte("abxyz"))
	tw.WriteHeader(&tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "s"})
	tw.Close()
	f.Add(buf.Bytes())
	f.Fuzz(func(t *testing.T, data []byte) {
		base := t.TempDir()
		target := filepath.Join(base, "t")
		os.Mkdir(target, 0o755)
		Restore(context.Background(), bytes.NewReader(data), target, RestoreOptions{Limits: Limits{MaxBytes: 1 << 20, MaxEntries: 1000}})
		ents, _ := os.ReadDir(base)
		if len(ents) != 1 {
			t.Fatalf("wrote outside the target: %v", ents)
		}
	})
}
