//go:build linux

package snapshot

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

func fileHash(t *testing.T, p string) [32]byte {
	t.Helper()
	f, err := os.Open(p)
	must(t, err)
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return [32]byte(h.Sum(nil))
}

// allocated is st_blocks*512 summed over the tree: what it takes on disk.
func allocated(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	must(t, filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		var s unix.Stat_t
		if err := unix.Lstat(p, &s); err != nil {
			return err
		}
		n += s.Blocks * 512
		return nil
	}))
	return n
}

func writeAt(t *testing.T, f *os.File, off int64, b []byte) {
	t.Helper()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// randomBytes is incompressible content (a hole-detecting or compressing
// layer below must not be what makes the numbers small).
func randomBytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed)}).Read(b)
	return b
}

// archiveToStore archives dir through a Local store as sbxmanager does
// (Archive writes into a pipe that Put copies to a temporary file).
func archiveToStore(t *testing.T, l *Local, id, dir string, opts ArchiveOptions) (Stats, int64, error) {
	t.Helper()
	pr, pw := io.Pipe()
	var st Stats
	done := make(chan error, 1)
	go func() {
		var err error
		st, err = Archive(context.Background(), dir, pw, opts)
		pw.CloseWithError(err)
		done <- err
	}()
	n, err := l.Put(context.Background(), id, pr)
	pr.CloseWithError(errors.New("store stopped reading"))
	if aerr := <-done; aerr != nil {
		return st, n, aerr
	}
	return st, n, err
}

// The case: `truncate -s 2G` costs nothing in the sandbox and must
// cost nothing in the archive or the restored layer either.
func TestSparseFileStaysSparse(t *testing.T) {
	needRoot(t)
	const (
		logical = 2 << 30
		real    = 200 << 20
	)
	src := t.TempDir()
	sparse := filepath.Join(src, "sparse")
	f, err := os.Create(sparse)
	must(t, err)
	must(t, f.Truncate(logical))
	// 8 MiB of data in the sparse file: at the start, in the middle
	// (unaligned) and at the very end, so leading, inner and trailing
	// holes all have data around them.
	writeAt(t, f, 0, randomBytes(1, 3<<20))
	writeAt(t, f, 1<<30+12345, randomBytes(2, 4<<20))
	writeAt(t, f, logical-1<<20, randomBytes(3, 1<<20))
	must(t, f.Close())
	dense := filepath.Join(src, "dense")
	must(t, os.WriteFile(dense, randomBytes(4, real-8<<20), 0o644))
	must(t, os.Mkdir(filepath.Join(src, "d"), 0o755))
	must(t, os.WriteFile(filepath.Join(src, "d", "small"), []byte("hi\n"), 0o600))
	empty := filepath.Join(src, "allhole")
	must(t, os.WriteFile(empty, nil, 0o600))
	must(t, os.Truncate(empty, 1<<30))
	srcAlloc := allocated(t, src)

	l, err := NewLocal(t.TempDir())
	must(t, err)
	ast, n, err := archiveToStore(t, l, "s", src, ArchiveOptions{SpaceDir: l.Dir()})
	must(t, err)
	fi, err := os.Stat(filepath.Join(l.Dir(), "s"))
	must(t, err)
	t.Logf("source: %d MiB allocated; archive: %d bytes (%.1f MiB), stats %+v", srcAlloc>>20, fi.Size(), float64(fi.Size())/(1<<20), ast)
	if fi.Size() != n || n >= 250<<20 {
		t.Fatalf("archive is %d bytes (Put reported %d), want under 250 MiB", fi.Size(), n)
	}
	// Data extents are whole blocks: the unaligned island brings a few
	// KiB of zeros along.
	if ast.Bytes < real+3 || ast.Bytes > real+3+64<<10 || ast.Logical != logical+(real-8<<20)+3+1<<30 {
		t.Fatalf("archive stats %+v", ast)
	}

	dst := t.TempDir()
	rc, err := l.Open(context.Background(), "s")
	must(t, err)
	rst, err := Restore(context.Background(), rc, dst, RestoreOptions{})
	rc.Close()
	must(t, err)
	if rst.Bytes != ast.Bytes || rst.Logical != ast.Logical || rst.Entries != ast.Entries {
		t.Fatalf("restore stats %+v, archive %+v", rst, ast)
	}
	dstAlloc := allocated(t, dst)
	var s unix.Stat_t
	must(t, unix.Stat(filepath.Join(dst, "sparse"), &s))
	t.Logf("restored layer: %d bytes (%.1f MiB) allocated; sparse file %d bytes logical, %d allocated", dstAlloc, float64(dstAlloc)/(1<<20), s.Size, s.Blocks*512)
	if dstAlloc >= 250<<20 {
		t.Fatalf("restored layer takes %d bytes on disk, want under 250 MiB", dstAlloc)
	}
	if s.Size != logical || s.Blocks*512 > 16<<20 {
		t.Fatalf("restored sparse file: size %d, %d bytes allocated", s.Size, s.Blocks*512)
	}
	must(t, unix.Stat(filepath.Join(dst, "allhole"), &s))
	if s.Size != 1<<30 || s.Blocks != 0 {
		t.Fatalf("restored all-hole file: size %d, %d blocks", s.Size, s.Blocks)
	}
	// Same content, holes reading as zeros.
	for _, name := range []string{"sparse", "dense", "allhole", "d/small"} {
		if fileHash(t, filepath.Join(src, name)) != fileHash(t, filepath.Join(dst, name)) {
			t.Errorf("%s differs after the round trip", name)
		}
	}
}

// Files without holes are plain TypeReg entries, as before sparse
// support; sparse ones are TypeSparse with their map.
func TestArchiveEntryTypes(t *testing.T) {
	src := t.TempDir()
	must(t, os.WriteFile(filepath.Join(src, "dense"), randomBytes(5, 100<<10), 0o644))
	f, err := os.Create(filepath.Join(src, "sparse"))
	must(t, err)
	must(t, f.Truncate(10<<20))
	writeAt(t, f, 4<<20, []byte("data"))
	must(t, f.Close())
	var buf bytes.Buffer
	if _, err := Archive(context.Background(), src, &buf, ArchiveOptions{}); err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(&buf)
	got := map[string]*tar.Header{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		must(t, err)
		got[h.Name] = h
	}
	if h := got["dense"]; h.Typeflag != tar.TypeReg || h.Size != 100<<10 || h.PAXRecords[sparseRecord] != "" {
		t.Errorf("dense: type %q size %d records %v", h.Typeflag, h.Size, h.PAXRecords)
	}
	h := got["sparse"]
	if h.Typeflag != TypeSparse || h.Size >= 1<<20 {
		t.Fatalf("sparse: type %q size %d", h.Typeflag, h.Size)
	}
	size, ext, why := parseSparse(h.PAXRecords[sparseRecord], h.Size)
	if why != "" || size != 10<<20 || len(ext) != 1 || ext[0].off > 4<<20 || ext[0].off+ext[0].len < 4<<20+4 {
		t.Fatalf("sparse map %q: %d %v %s", h.PAXRecords[sparseRecord], size, ext, why)
	}
}

func TestMergeExtents(t *testing.T) {
	var ext []extent
	for i := range int64(100) {
		// Gaps of varying size, some equal.
		ext = append(ext, extent{i * 1000, 10 + i%7})
	}
	ext[50].off -= 500 // one small gap before 50, one large after
	for _, max := range []int{100, 99, 50, 10, 1} {
		m := mergeExtents(ext, max)
		if len(m) != min(max, len(ext)) {
			t.Fatalf("max %d: %d extents", max, len(m))
		}
		// Every byte of data is still covered, in order, without overlap.
		for i := 1; i < len(m); i++ {
			if m[i].off < m[i-1].off+m[i-1].len {
				t.Fatalf("max %d: overlap at %d: %v", max, i, m)
			}
		}
		for _, e := range ext {
			covered := false
			for _, c := range m {
				if e.off >= c.off && e.off+e.len <= c.off+c.len {
					covered = true
				}
			}
			if !covered {
				t.Fatalf("max %d: extent %v lost", max, e)
			}
		}
		if _, _, why := parseSparse(formatSparse(100000, m), storedBytes(m)); why != "" {
			t.Fatalf("max %d: own map rejected: %s", max, why)
		}
	}
	// The smallest gap is filled first.
	if m := mergeExtents(ext, 99); m[49].off+m[49].len != ext[50].off+ext[50].len {
		t.Fatalf("did not fill the smallest gap: %v", m[48:51])
	}
}

func sparseEntry(name, record string, body string) entry {
	return entry{tar.Header{Name: name, Typeflag: TypeSparse, PAXRecords: map[string]string{sparseRecord: record}}, body}
}

// buildTarSized is buildTar that also sizes TypeSparse entries.
func buildTarSized(t *testing.T, es ...entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range es {
		h := e.hdr
		if h.Typeflag == tar.TypeReg || h.Typeflag == TypeSparse {
			h.Size = int64(len(e.body))
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		h.Format = tar.FormatPAX
		h.ModTime = time.Unix(1700000000, 0)
		must(t, tw.WriteHeader(&h))
		if e.body != "" {
			_, err := tw.Write([]byte(e.body))
			must(t, err)
		}
	}
	must(t, tw.Close())
	return buf.Bytes()
}

func TestRestoreSparseEntry(t *testing.T) {
	needRoot(t)
	dst := t.TempDir()
	data := buildTarSized(t, sparseEntry("f", "1048576,0,3,524288,2,1048570,6", "abcdeXYZXYZ"))
	st, err := Restore(context.Background(), bytes.NewReader(data), dst, RestoreOptions{})
	must(t, err)
	if st.Bytes != 11 || st.Logical != 1<<20 {
		t.Fatalf("stats %+v", st)
	}
	b, err := os.ReadFile(filepath.Join(dst, "f"))
	must(t, err)
	want := make([]byte, 1<<20)
	copy(want, "abc")
	copy(want[524288:], "de")
	copy(want[1048570:], "XYZXYZ")
	if !bytes.Equal(b, want) {
		t.Fatal("restored content differs")
	}
	// All hole, hard-linked, with an xattr.
	dst = t.TempDir()
	e := sparseEntry("h", "4096", "")
	e.hdr.PAXRecords[xattrPrefix+"user.k"] = "v"
	data = buildTarSized(t, e, hardlink("h2", "h"))
	_, err = Restore(context.Background(), bytes.NewReader(data), dst, RestoreOptions{})
	must(t, err)
	var s unix.Stat_t
	must(t, unix.Stat(filepath.Join(dst, "h2"), &s))
	if s.Size != 4096 || s.Blocks != 0 || s.Nlink != 2 {
		t.Fatalf("all-hole file: %+v", s)
	}
}

// gnuSparseTar is a GNU sparse 0.1 file in PAX records (archive/tar
// writes no GNU.sparse records, and refuses to write a PAX header by hand:
// one is written as an unknown type and its type byte patched).
func gnuSparseTar(t *testing.T) []byte {
	t.Helper()
	var body string
	for _, kv := range [][2]string{{"GNU.sparse.major", "0"}, {"GNU.sparse.minor", "1"}, {"GNU.sparse.size", "1073741824"}, {"GNU.sparse.numblocks", "1"}, {"GNU.sparse.map", "0,1"}} {
		r := " " + kv[0] + "=" + kv[1] + "\n"
		n := len(r) + 1
		for len(fmt.Sprint(n))+len(r) != n {
			n = len(fmt.Sprint(n)) + len(r)
		}
		body += fmt.Sprint(n) + r
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	must(t, tw.WriteHeader(&tar.Header{Name: "PaxHeaders/f", Typeflag: 'Z', Size: int64(len(body)), Mode: 0o644, Format: tar.FormatUSTAR}))
	_, err := tw.Write([]byte(body))
	must(t, err)
	must(t, tw.WriteHeader(&tar.Header{Name: "f", Typeflag: tar.TypeReg, Size: 1, Mode: 0o644, Format: tar.FormatUSTAR}))
	_, err = tw.Write([]byte("x"))
	must(t, err)
	must(t, tw.Close())
	b := buf.Bytes()
	b[156] = tar.TypeXHeader
	sum := 0
	for i, c := range b[:512] {
		if i >= 148 && i < 156 {
			c = ' '
		}
		sum += int(c)
	}
	copy(b[148:156], fmt.Sprintf("%06o\x00 ", sum))
	// archive/tar itself expands it into a 1 GiB file of zeros.
	h, err := tar.NewReader(bytes.NewReader(b)).Next()
	if err != nil || h.Size != 1<<30 || h.PAXRecords["GNU.sparse.map"] != "0,1" {
		t.Fatalf("GNU sparse archive: %v %+v", err, h)
	}
	return b
}

func TestRestoreRejectsBadSparseMaps(t *testing.T) {
	needRoot(t)
	many := make([]string, 0, maxExtents+2)
	many = append(many, "1000000000")
	for i := range maxExtents + 1 {
		many = append(many, fmt.Sprint(i*10), "1")
	}
	manyBody := strings.Repeat("x", maxExtents+1)
	cases := map[string][]byte{
		"overlapping":      buildTarSized(t, sparseEntry("f", "100,0,10,5,10", strings.Repeat("x", 20))),
		"unsorted":         buildTarSized(t, sparseEntry("f", "100,50,10,0,10", strings.Repeat("x", 20))),
		"out of range":     buildTarSized(t, sparseEntry("f", "100,95,10", strings.Repeat("x", 10))),
		"offset past size": buildTarSized(t, sparseEntry("f", "100,101,1", "x")),
		"overflow":         buildTarSized(t, sparseEntry("f", "9223372036854775807,9223372036854775800,10", strings.Repeat("x", 10))),
		"too many":         buildTarSized(t, sparseEntry("f", strings.Join(many, ","), manyBody)),
		"sum too small":    buildTarSized(t, sparseEntry("f", "100,0,5", strings.Repeat("x", 10))),
		"sum too large":    buildTarSized(t, sparseEntry("f", "100,0,50", strings.Repeat("x", 10))),
		"empty extent":     buildTarSized(t, sparseEntry("f", "100,0,0,10,5", strings.Repeat("x", 5))),
		"odd fields":       buildTarSized(t, sparseEntry("f", "100,0", "")),
		"negative":         buildTarSized(t, sparseEntry("f", "100,-1,5", strings.Repeat("x", 5))),
		"plus sign":        buildTarSized(t, sparseEntry("f", "+100", "")),
		"leading zero":     buildTarSized(t, sparseEntry("f", "100,05,5", strings.Repeat("x", 5))),
		"not a number":     buildTarSized(t, sparseEntry("f", "1e9", "")),
		"too long number":  buildTarSized(t, sparseEntry("f", "99999999999999999999", "")),
		"empty record":     buildTarSized(t, sparseEntry("f", "", "")),
		"missing record":   buildTarSized(t, entry{tar.Header{Name: "f", Typeflag: TypeSparse}, "x"}),
		"record on file":   buildTarSized(t, entry{tar.Header{Name: "f", Typeflag: tar.TypeReg, PAXRecords: map[string]string{sparseRecord: "100,0,1"}}, "x"}),
		"record on dir":    buildTarSized(t, entry{tar.Header{Name: "d/", Typeflag: tar.TypeDir, PAXRecords: map[string]string{sparseRecord: "0"}}, ""}),
		"unknown record":   buildTarSized(t, entry{tar.Header{Name: "f", Typeflag: tar.TypeReg, PAXRecords: map[string]string{"SPACE.other": "1"}}, "x"}),
		"gnu sparse pax":   gnuSparseTar(t),
		"sparse symlink":   buildTarSized(t, entry{tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "x", PAXRecords: map[string]string{sparseRecord: "0"}}, ""}),
	}
	for name, data := range cases {
		t.Run(name, func(t *testing.T) {
			target := t.TempDir()
			_, err := Restore(context.Background(), bytes.NewReader(data), target, RestoreOptions{})
			var ae *ArchiveError
			if !errors.As(err, &ae) || !errors.Is(err, ErrHostileArchive) || !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("want *ArchiveError, got %v", err)
			}
			t.Log(err)
		})
	}
}

// Exceeding a limit while archiving fails with ErrOverLimit, and a store
// fed by the failed archive keeps nothing of it.
func TestArchiveTooLarge(t *testing.T) {
	src := t.TempDir()
	must(t, os.WriteFile(filepath.Join(src, "a"), randomBytes(6, 1<<20), 0o644))
	must(t, os.WriteFile(filepath.Join(src, "b"), randomBytes(7, 1<<20), 0o644))
	f, err := os.Create(filepath.Join(src, "c-sparse"))
	must(t, err)
	must(t, f.Truncate(1<<30))
	must(t, f.Close())
	cases := map[string]Limits{
		"content": {MaxBytes: 1<<20 + 1<<19},
		"logical": {MaxLogical: 512 << 20},
		"entries": {MaxEntries: 2},
	}
	for name, lim := range cases {
		t.Run(name, func(t *testing.T) {
			l, err := NewLocal(t.TempDir())
			must(t, err)
			_, _, err = archiveToStore(t, l, "s", src, ArchiveOptions{Limits: lim})
			if !errors.Is(err, ErrOverLimit) || !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("want ErrOverLimit, got %v", err)
			}
			t.Log(err)
			if ents, _ := os.ReadDir(l.Dir()); len(ents) != 0 {
				t.Fatalf("store kept %v", ents)
			}
		})
	}
	// The same tree within the limits archives.
	if _, err := Archive(context.Background(), src, io.Discard, ArchiveOptions{Limits: Limits{MaxBytes: 2 << 20, MaxLogical: 1<<30 + 2<<20, MaxEntries: 3}}); err != nil {
		t.Fatal(err)
	}
}

// An archive over the restore's limits is refused before the excess is
// written (a forged archive need not come from Archive's limits).
func TestRestoreTooLarge(t *testing.T) {
	needRoot(t)
	src := t.TempDir()
	must(t, os.WriteFile(filepath.Join(src, "a"), randomBytes(8, 1<<20), 0o644))
	f, err := os.Create(filepath.Join(src, "b-sparse"))
	must(t, err)
	must(t, f.Truncate(1<<30))
	writeAt(t, f, 1<<29, []byte("x"))
	must(t, f.Close())
	var buf bytes.Buffer
	_, err = Archive(context.Background(), src, &buf, ArchiveOptions{})
	must(t, err)
	cases := map[string]Limits{
		"content": {MaxBytes: 1 << 20},
		"logical": {MaxLogical: 1 << 30},
		"entries": {MaxEntries: 1},
	}
	for name, lim := range cases {
		t.Run(name, func(t *testing.T) {
			dst := t.TempDir()
			st, err := Restore(context.Background(), bytes.NewReader(buf.Bytes()), dst, RestoreOptions{Limits: lim})
			if !errors.Is(err, ErrOverLimit) || !errors.Is(err, ErrHostileArchive) || !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("want ErrOverLimit, got %v", err)
			}
			t.Log(err)
			if alloc := allocated(t, dst); st.Bytes > lim.MaxBytes && lim.MaxBytes > 0 || alloc > 2<<20 {
				t.Fatalf("wrote %d bytes (%d allocated) before refusing", st.Bytes, alloc)
			}
		})
	}
}

// fakeStatfs reports a 100 GiB file system whose free space avail()
// decides at each call.
func fakeStatfs(avail func() int64) func(string, *unix.Statfs_t) error {
	return func(_ string, st *unix.Statfs_t) error {
		*st = unix.Statfs_t{Bsize: 4096, Blocks: 100 << 30 / 4096, Bavail: uint64(avail() / 4096)}
		return nil
	}
}

func TestFreeSpace(t *testing.T) {
	needRoot(t)
	src := t.TempDir()
	for i := range 8 {
		must(t, os.WriteFile(filepath.Join(src, fmt.Sprint("f", i)), randomBytes(uint64(i), 1<<20), 0o644))
	}
	var tree bytes.Buffer
	_, err := Archive(context.Background(), src, &tree, ArchiveOptions{})
	must(t, err)
	low := fakeStatfs(func() int64 { return 4 << 30 }) // under 5% of 100 GiB
	wantNoSpace := func(t *testing.T, err error) {
		t.Helper()
		if !errors.Is(err, ErrNoSpace) || !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "not enough free space on ") {
			t.Fatalf("want ErrNoSpace, got %v", err)
		}
		t.Log(err)
	}

	t.Run("archive up front", func(t *testing.T) {
		l, err := NewLocal(t.TempDir())
		must(t, err)
		calls := 0
		st, _, err := archiveToStore(t, l, "s", src, ArchiveOptions{SpaceDir: l.Dir(), Space: FreeSpace{Statfs: func(p string, st *unix.Statfs_t) error {
			calls++
			if p != l.Dir() {
				t.Errorf("statfs of %s, want the store's directory", p)
			}
			return low(p, st)
		}}})
		wantNoSpace(t, err)
		if calls != 1 || st.Entries != 0 {
			t.Fatalf("%d statfs calls, %d entries written", calls, st.Entries)
		}
		if ents, _ := os.ReadDir(l.Dir()); len(ents) != 0 {
			t.Fatalf("store kept %v", ents)
		}
	})
	t.Run("archive while streaming", func(t *testing.T) {
		l, err := NewLocal(t.TempDir())
		must(t, err)
		// Plenty at first; then something else fills the disk.
		free, calls := int64(50<<30), 0
		_, _, err = archiveToStore(t, l, "s", src, ArchiveOptions{SpaceDir: l.Dir(), Space: FreeSpace{CheckEvery: 2 << 20,
			Statfs: fakeStatfs(func() int64 { calls++; f := free; free = 4 << 30; return f })}})
		wantNoSpace(t, err)
		if calls != 2 {
			t.Fatalf("%d statfs calls", calls)
		}
		if ents, _ := os.ReadDir(l.Dir()); len(ents) != 0 {
			t.Fatalf("store kept %v", ents)
		}
	})
	t.Run("archive large file", func(t *testing.T) {
		// 6 GiB free, of which all but 768 KiB is the reserve: a 1 GiB
		// all-hole file stores nothing and archives, a 1 MiB file is
		// refused before its first byte (before any periodic check).
		dir := t.TempDir()
		f, err := os.Create(filepath.Join(dir, "hole"))
		must(t, err)
		must(t, f.Truncate(1<<30))
		must(t, f.Close())
		space := FreeSpace{CheckEvery: 1 << 19, MinFree: 6<<30 - 1<<19 - 1<<18, Statfs: fakeStatfs(func() int64 { return 6 << 30 })}
		_, err = Archive(context.Background(), dir, io.Discard, ArchiveOptions{SpaceDir: dir, Space: space})
		must(t, err)
		var w countWriter
		_, err = Archive(context.Background(), src, &w, ArchiveOptions{SpaceDir: dir, Space: space})
		wantNoSpace(t, err)
		if w.n != 0 {
			t.Fatalf("wrote %d bytes", w.n)
		}
	})
	t.Run("restore up front", func(t *testing.T) {
		dst := t.TempDir()
		_, err := Restore(context.Background(), bytes.NewReader(tree.Bytes()), dst, RestoreOptions{Space: FreeSpace{Statfs: low}})
		wantNoSpace(t, err)
		if ents, _ := os.ReadDir(dst); len(ents) != 0 {
			t.Fatalf("restore wrote %v", ents)
		}
	})
	t.Run("restore while streaming", func(t *testing.T) {
		dst := t.TempDir()
		free, calls := int64(50<<30), 0
		st, err := Restore(context.Background(), bytes.NewReader(tree.Bytes()), dst, RestoreOptions{Space: FreeSpace{CheckEvery: 2 << 20,
			Statfs: fakeStatfs(func() int64 { calls++; f := free; free = 4 << 30; return f })}})
		wantNoSpace(t, err)
		if calls != 2 || st.Bytes < 1<<20 || st.Bytes > 3<<20 {
			t.Fatalf("%d statfs calls, %d bytes restored before refusing", calls, st.Bytes)
		}
	})
	t.Run("restore large file", func(t *testing.T) {
		// A file bigger than CheckEvery is checked whole before it is
		// created.
		dst := t.TempDir()
		_, err := Restore(context.Background(), bytes.NewReader(tree.Bytes()), dst, RestoreOptions{Space: FreeSpace{CheckEvery: 1 << 19,
			MinFree: 6<<30 - 1<<19, Statfs: fakeStatfs(func() int64 { return 6 << 30 })}})
		wantNoSpace(t, err)
		if ents, _ := os.ReadDir(dst); len(ents) != 0 {
			t.Fatalf("restore wrote %v", ents)
		}
	})
	t.Run("statfs fails", func(t *testing.T) {
		_, err := Restore(context.Background(), bytes.NewReader(tree.Bytes()), t.TempDir(), RestoreOptions{Space: FreeSpace{
			Statfs: func(string, *unix.Statfs_t) error { return unix.EIO }}})
		if !errors.Is(err, unix.EIO) {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("enough space", func(t *testing.T) {
		_, err := Restore(context.Background(), bytes.NewReader(tree.Bytes()), t.TempDir(), RestoreOptions{Space: FreeSpace{
			Statfs: fakeStatfs(func() int64 { return 6 << 30 })}})
		must(t, err)
	})
}

type countWriter struct{ n int64 }

func (w *countWriter) Write(p []byte) (int, error) { w.n += int64(len(p)); return len(p), nil }

// FuzzParseSparse: an accepted map is sorted, non-overlapping, non-empty,
// within the logical size, bounded, and holds exactly the stored bytes.
func FuzzParseSparse(f *testing.F) {
	for _, s := range []string{"0", "100,0,10", "100,0,10,20,5", "100,5,10,0,1", "9223372036854775807,0,1", "100,95,10", "1,,", "00", "-1"} {
		f.Add(s, int64(10))
	}
	f.Fuzz(func(t *testing.T, v string, stored int64) {
		size, ext, why := parseSparse(v, stored)
		if why != "" {
			return
		}
		if len(ext) > maxExtents || size < 0 {
			t.Fatalf("accepted %q: size %d, %d extents", v, size, len(ext))
		}
		var end, sum int64
		for _, e := range ext {
			if e.len <= 0 || e.off < end || e.off+e.len > size || e.off+e.len < e.off {
				t.Fatalf("accepted %q: bad extent %v", v, e)
			}
			end = e.off + e.len
			sum += e.len
		}
		if sum != stored {
			t.Fatalf("accepted %q: holds %d, stored %d", v, sum, stored)
		}
		if formatSparse(size, ext) != v {
			t.Fatalf("accepted %q, not canonical: %q", v, formatSparse(size, ext))
		}
	})
}
