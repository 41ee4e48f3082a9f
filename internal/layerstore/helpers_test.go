//go:build linux

package layerstore

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// tent is one entry of a test tar.
type tent struct {
	Name   string
	Type   byte // default tar.TypeReg
	Body   string
	Link   string
	Mode   int64
	Uid    int
	Gid    int
	Xattrs map[string]string
	Size   int64 // overrides len(Body) (the body is then not written)
	Major  int64
	Minor  int64
}

var testTime = time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)

// mkTar builds a tar from entries. A Size override leaves the tar
// unfinished after that header (a lying header).
func mkTar(t testing.TB, ents ...tent) []byte {
	t.Helper()
	var buf bytes.Buffer
	w := tar.NewWriter(&buf)
	for _, e := range ents {
		typ := e.Type
		if typ == 0 {
			typ = tar.TypeReg
		}
		mode := e.Mode
		if mode == 0 {
			mode = 0o644
			if typ == tar.TypeDir {
				mode = 0o755
			}
		}
		h := &tar.Header{Name: e.Name, Typeflag: typ, Linkname: e.Link, Mode: mode, Uid: e.Uid, Gid: e.Gid,
			ModTime: testTime, Devmajor: e.Major, Devminor: e.Minor}
		if typ == tar.TypeReg {
			h.Size = int64(len(e.Body))
		}
		if len(e.Xattrs) > 0 {
			h.PAXRecords = map[string]string{}
			for k, v := range e.Xattrs {
				h.PAXRecords["SCHILY.xattr."+k] = v
			}
		}
		if e.Size != 0 {
			h.Size = e.Size
			if err := w.WriteHeader(h); err != nil {
				t.Fatalf("tar header %s: %v", e.Name, err)
			}
			return buf.Bytes()
		}
		if err := w.WriteHeader(h); err != nil {
			t.Fatalf("tar header %s: %v", e.Name, err)
		}
		if typ == tar.TypeReg {
			if _, err := w.Write([]byte(e.Body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// treeState describes every node under root (not following symlinks):
// what a test compares before and after, or between two views.
func treeState(t testing.TB, root string, withTimes bool) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		out[rel] = nodeState(t, p, withTimes)
		return nil
	})
	if err != nil {
		t.Fatalf("walk %s: %v", root, err)
	}
	return out
}

func nodeState(t testing.TB, p string, withTimes bool) string {
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatalf("lstat %s: %v", p, err)
	}
	s := fmt.Sprintf("mode=%o uid=%d gid=%d", st.Mode, st.Uid, st.Gid)
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatalf("read %s: %v", p, err)
		}
		h := sha256.Sum256(b)
		s += fmt.Sprintf(" size=%d nlink=%d sha=%s", st.Size, st.Nlink, hex.EncodeToString(h[:8]))
	case unix.S_IFLNK:
		l, _ := os.Readlink(p)
		s += " -> " + l
	case unix.S_IFCHR, unix.S_IFBLK:
		s += fmt.Sprintf(" rdev=%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
	}
	if withTimes && st.Mode&unix.S_IFMT != unix.S_IFLNK {
		s += fmt.Sprintf(" mtime=%d.%09d", st.Mtim.Sec, st.Mtim.Nsec)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFLNK {
		s += " xattrs=" + strings.Join(userXattrs(p), ",")
	}
	return s
}

// userXattrs lists p's xattrs a view shows (overlay's own excluded).
func userXattrs(p string) []string {
	sz, err := unix.Llistxattr(p, nil)
	if err != nil || sz == 0 {
		return nil
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(p, buf)
	if err != nil {
		return nil
	}
	var out []string
	for _, k := range strings.Split(string(buf[:sz]), "\x00") {
		if k == "" || strings.Contains(k, ".overlay.") {
			continue
		}
		v := make([]byte, 256)
		n, _ := unix.Lgetxattr(p, k, v)
		if n < 0 {
			n = 0
		}
		out = append(out, k+"="+hex.EncodeToString(v[:n]))
	}
	sort.Strings(out)
	return out
}

func diffStates(a, b map[string]string) []string {
	var d []string
	for k, v := range a {
		if w, ok := b[k]; !ok {
			d = append(d, "only in first: "+k+" "+v)
		} else if v != w {
			d = append(d, "differs: "+k+"\n\t"+v+"\n\t"+w)
		}
	}
	for k, v := range b {
		if _, ok := a[k]; !ok {
			d = append(d, "only in second: "+k+" "+v)
		}
	}
	sort.Strings(d)
	return d
}

func getX(t testing.TB, p, k string) string {
	t.Helper()
	v := make([]byte, 256)
	n, err := unix.Lgetxattr(p, k, v)
	if err != nil {
		return ""
	}
	return string(v[:n])
}

func lstat(t testing.TB, p string) unix.Stat_t {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatalf("lstat %s: %v", p, err)
	}
	return st
}

func isWhiteout(t testing.TB, p string) bool {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		return false
	}
	return st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0 && st.Uid == 0 && st.Gid == 0
}
