//go:build linux

// Restoring an archive (the format is described in archive.go): every
// entry is created relative to an open parent directory, never through a
// path the archive could redirect.

package snapshot

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/errdefs"
)

// RestoreOptions bound what Restore accepts and writes.
type RestoreOptions struct {
	Limits
	// Space is the free-space reserve kept on the target's file system,
	// checked before and while extracting.
	Space FreeSpace
}

// Restore extracts an archive written by Archive into dir, which must
// exist and be empty. It refuses hostile archives with an *ArchiveError
// (errors.Is(err, ErrHostileArchive)):
//
//   - absolute names, ".." or "." components, empty or unclean names, NUL
//     bytes, duplicate names;
//   - an entry whose parent is not a directory created earlier by the same
//     archive (this is what stops "symlink escapes": a symlink entry is
//     never a parent, so nothing is ever written through one);
//   - hard links whose target is not a regular file extracted earlier;
//   - device nodes other than 0:0 whiteouts, block devices, and any other
//     entry type (GNU sparse files and other GNU extensions);
//   - extended attributes outside the allowlist, GNU.sparse.* records,
//     SPACE.* records other than a valid SPACE.sparse on a TypeSparse
//     entry (see sparse.go);
//   - archives over opts' Limits (these also match ErrOverLimit).
//
// Sparse entries are restored sparse: only their data extents are
// written. Restore refuses to start, and stops, when the target's file
// system would drop below opts.Space's reserve (ErrNoSpace).
//
// All file system operations are relative to dir (os.Root and *at system
// calls on directory descriptors, never following the final component), so
// even a bug in these checks cannot write outside dir. On error dir holds a
// partial tree: the caller removes it.
func Restore(ctx context.Context, r io.Reader, dir string, opts RestoreOptions) (Stats, error) {
	opts.defaults()
	var st Stats
	ents, err := os.ReadDir(dir)
	if err != nil {
		return st, fmt.Errorf("snapshot: restore: %w", err)
	}
	if len(ents) > 0 {
		return st, fmt.Errorf("snapshot: restore: %w: target directory %s is not empty", errdefs.ErrConflict, dir)
	}
	guard := newSpaceGuard(dir, opts.Space)
	if err := guard.check(0); err != nil {
		return st, fmt.Errorf("snapshot: restore: %w", err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return st, fmt.Errorf("snapshot: restore: %w", err)
	}
	defer root.Close()
	x := &extractor{root: root, guard: guard, dirs: map[string]bool{"": true}, files: map[string]bool{}, seen: map[string]bool{}}
	defer x.closeParent()
	tr := tar.NewReader(r)
	buf := make([]byte, 256<<10)
	for {
		if err := ctx.Err(); err != nil {
			return st, fmt.Errorf("snapshot: restore: %w", err)
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return st, fmt.Errorf("snapshot: restore: %w", &ArchiveError{Entry: "", Reason: "malformed archive: " + err.Error()})
		}
		if hdr.Typeflag == tar.TypeXGlobalHeader {
			continue
		}
		st.Entries++
		if st.Entries > opts.MaxEntries {
			return st, &ArchiveError{Entry: hdr.Name, Reason: fmt.Sprintf("more than %d entries", opts.MaxEntries), Err: ErrOverLimit}
		}
		var sp *sparseFile
		switch hdr.Typeflag {
		case tar.TypeReg, TypeSparse:
			if hdr.Size < 0 || st.Bytes+hdr.Size > opts.MaxBytes {
				return st, &ArchiveError{Entry: hdr.Name, Reason: fmt.Sprintf("content exceeds %d bytes", opts.MaxBytes), Err: ErrOverLimit}
			}
			logical := hdr.Size
			if hdr.Typeflag == TypeSparse {
				v, ok := hdr.PAXRecords[sparseRecord]
				if !ok {
					return st, &ArchiveError{Entry: hdr.Name, Reason: "sparse entry without a " + sparseRecord + " record"}
				}
				size, ext, why := parseSparse(v, hdr.Size)
				if why != "" {
					return st, &ArchiveError{Entry: hdr.Name, Reason: why}
				}
				sp, logical = &sparseFile{size, ext}, size
			}
			if st.Logical+logical > opts.MaxLogical {
				return st, &ArchiveError{Entry: hdr.Name, Reason: fmt.Sprintf("logical file sizes exceed %d bytes", opts.MaxLogical), Err: ErrOverLimit}
			}
			st.Logical += logical
		}
		n, err := x.extract(hdr, tr, buf, sp)
		st.Bytes += n
		if err != nil {
			var ae *ArchiveError
			if errors.As(err, &ae) {
				return st, err
			}
			return st, fmt.Errorf("snapshot: restore %q: %w", hdr.Name, err)
		}
		crashpoint.Hit(crashpoint.RestoreEntry)
	}
	// Directory times last, deepest first: creating children moved them.
	x.closeParent()
	slices.SortFunc(x.dirTimes, func(a, b dirTime) int { return strings.Compare(b.name, a.name) })
	for _, d := range x.dirTimes {
		if err := x.withParent(d.name, func(pfd int, base string) error {
			return setTimes(pfd, base, d.mtime)
		}); err != nil {
			return st, fmt.Errorf("snapshot: restore %q: times: %w", d.name, err)
		}
	}
	return st, nil
}

type dirTime struct {
	name  string
	mtime time.Time
}

// sparseFile is a TypeSparse entry's validated extent map.
type sparseFile struct {
	size int64
	ext  []extent
}

type extractor struct {
	root     *os.Root
	guard    *spaceGuard
	dirs     map[string]bool // directories created by this archive ("" is the root)
	files    map[string]bool // regular files created by this archive
	seen     map[string]bool
	dirTimes []dirTime

	parentName string
	parent     *os.File
}

func (x *extractor) closeParent() {
	if x.parent != nil {
		x.parent.Close()
		x.parent, x.parentName = nil, ""
	}
}

// cleanName validates a tar name and returns it without a trailing slash.
func cleanName(name string) (string, string) {
	n := strings.TrimSuffix(name, "/")
	switch {
	case n == "":
		return "", "empty name"
	case strings.ContainsRune(n, 0):
		return "", "NUL byte in name"
	case strings.HasPrefix(n, "/"):
		return "", "absolute path"
	}
	for _, c := range strings.Split(n, "/") {
		switch c {
		case "..":
			return "", "'..' component"
		case ".", "":
			return "", "unclean path ('.' or empty component)"
		}
	}
	if path.Clean(n) != n {
		return "", "unclean path"
	}
	return n, ""
}

// withParent runs fn with a descriptor of name's parent directory (opened
// beneath the root) and name's last element.
func (x *extractor) withParent(name string, fn func(pfd int, base string) error) error {
	dir, base := path.Split(name)
	dir = strings.TrimSuffix(dir, "/")
	if x.parent == nil || x.parentName != dir {
		x.closeParent()
		open := dir
		if open == "" {
			open = "."
		}
		f, err := x.root.OpenFile(open, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
		if err != nil {
			return err
		}
		x.parent, x.parentName = f, dir
	}
	return fn(int(x.parent.Fd()), base)
}

func (x *extractor) extract(hdr *tar.Header, r io.Reader, buf []byte, sp *sparseFile) (int64, error) {
	name, why := cleanName(hdr.Name)
	if why != "" {
		return 0, &ArchiveError{Entry: hdr.Name, Reason: why}
	}
	if x.seen[name] {
		return 0, &ArchiveError{Entry: hdr.Name, Reason: "duplicate entry"}
	}
	x.seen[name] = true
	parent := path.Dir(name)
	if parent == "." {
		parent = ""
	}
	if !x.dirs[parent] {
		return 0, &ArchiveError{Entry: hdr.Name, Reason: "parent is not a directory created by this archive (symlink escape or missing parent)"}
	}
	xattrs := map[string]string{}
	for k, v := range hdr.PAXRecords {
		if a, ok := strings.CutPrefix(k, xattrPrefix); ok {
			if !keepXattr(a) {
				return 0, &ArchiveError{Entry: hdr.Name, Reason: fmt.Sprintf("extended attribute %q not allowed", a)}
			}
			xattrs[a] = v
		}
		// archive/tar expands GNU sparse files itself (holes read as
		// zeros, a size the archive chooses): Archive never writes them.
		if strings.HasPrefix(k, "GNU.sparse.") {
			return 0, &ArchiveError{Entry: hdr.Name, Reason: "GNU sparse file"}
		}
		if strings.HasPrefix(k, "SPACE.") && (k != sparseRecord || hdr.Typeflag != TypeSparse) {
			return 0, &ArchiveError{Entry: hdr.Name, Reason: fmt.Sprintf("record %q not allowed here", k)}
		}
	}
	mode := uint32(hdr.Mode) & 0o7777
	if hdr.Mode < 0 || hdr.Mode&^0o7777 != 0 {
		return 0, &ArchiveError{Entry: hdr.Name, Reason: fmt.Sprintf("invalid mode %o", hdr.Mode)}
	}
	if hdr.Uid < 0 || hdr.Gid < 0 || hdr.Uid > 1<<31 || hdr.Gid > 1<<31 {
		return 0, &ArchiveError{Entry: hdr.Name, Reason: "invalid owner"}
	}
	if len(xattrs) > 0 && hdr.Typeflag != tar.TypeDir && hdr.Typeflag != tar.TypeReg && hdr.Typeflag != TypeSparse {
		return 0, &ArchiveError{Entry: hdr.Name, Reason: "extended attributes on a non-file entry"}
	}
	var written int64
	err := x.withParent(name, func(pfd int, base string) error {
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := unix.Mkdirat(pfd, base, 0o700); err != nil {
				return err
			}
			if err := x.setAttrsFd(pfd, base, hdr, mode, xattrs, nil); err != nil {
				return err
			}
			x.dirs[name] = true
			x.dirTimes = append(x.dirTimes, dirTime{name, hdr.ModTime})
			return nil
		case tar.TypeReg, TypeSparse: // tar.Reader already turns the old TypeRegA into TypeReg
			if sp == nil {
				sp = &sparseFile{hdr.Size, []extent{{0, hdr.Size}}}
			}
			if err := x.guard.large(hdr.Size); err != nil {
				return err
			}
			fd, err := unix.Openat(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
			if err != nil {
				return err
			}
			f := os.NewFile(uintptr(fd), name)
			defer f.Close()
			for _, e := range sp.ext {
				var w io.Writer = io.NewOffsetWriter(f, e.off)
				if x.guard != nil {
					w = guardWriter{w, x.guard}
				}
				n, err := io.CopyBuffer(w, io.LimitReader(r, e.len), buf)
				written += n
				if err != nil {
					return err
				}
				if n != e.len {
					return &ArchiveError{Entry: hdr.Name, Reason: "truncated content"}
				}
			}
			// The holes: what is past the last extent, and what was
			// never written between them, reads as zeros without blocks.
			if err := f.Truncate(sp.size); err != nil {
				return err
			}
			if err := x.setAttrsFd(pfd, base, hdr, mode, xattrs, f); err != nil {
				return err
			}
			x.files[name] = true
			return nil
		case tar.TypeSymlink:
			if hdr.Linkname == "" || strings.ContainsRune(hdr.Linkname, 0) || len(hdr.Linkname) > 4095 {
				return &ArchiveError{Entry: hdr.Name, Reason: "invalid symlink target"}
			}
			if err := unix.Symlinkat(hdr.Linkname, pfd, base); err != nil {
				return err
			}
			if err := unix.Fchownat(pfd, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				return err
			}
			return setTimes(pfd, base, hdr.ModTime)
		case tar.TypeLink:
			target, why := cleanName(hdr.Linkname)
			if why != "" {
				return &ArchiveError{Entry: hdr.Name, Reason: "hard link target: " + why}
			}
			if !x.files[target] {
				return &ArchiveError{Entry: hdr.Name, Reason: "hard link target is not a regular file extracted earlier"}
			}
			tdir, tbase := path.Split(target)
			topen := strings.TrimSuffix(tdir, "/")
			if topen == "" {
				topen = "."
			}
			td, err := x.root.OpenFile(topen, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
			if err != nil {
				return err
			}
			defer td.Close()
			return unix.Linkat(int(td.Fd()), tbase, pfd, base, 0)
		case tar.TypeChar:
			if hdr.Devmajor != 0 || hdr.Devminor != 0 {
				return &ArchiveError{Entry: hdr.Name, Reason: fmt.Sprintf("device node %d:%d (only 0:0 overlay whiteouts are allowed)", hdr.Devmajor, hdr.Devminor)}
			}
			if err := unix.Mknodat(pfd, base, unix.S_IFCHR|mode&0o777, 0); err != nil {
				return err
			}
			return x.setAttrsPath(pfd, base, hdr, mode)
		case tar.TypeFifo:
			if err := unix.Mknodat(pfd, base, unix.S_IFIFO|mode&0o777, 0); err != nil {
				return err
			}
			return x.setAttrsPath(pfd, base, hdr, mode)
		case tar.TypeBlock:
			return &ArchiveError{Entry: hdr.Name, Reason: "block device"}
		default:
			return &ArchiveError{Entry: hdr.Name, Reason: fmt.Sprintf("unsupported entry type %q", hdr.Typeflag)}
		}
	})
	return written, err
}

// setAttrsFd sets owner, mode, xattrs (and for files times) on a directory
// or regular file, through a descriptor that does not follow symlinks.
func (x *extractor) setAttrsFd(pfd int, base string, hdr *tar.Header, mode uint32, xattrs map[string]string, f *os.File) error {
	if f == nil {
		fd, err := unix.Openat(pfd, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		f = os.NewFile(uintptr(fd), base)
		defer f.Close()
	}
	fd := int(f.Fd())
	if err := unix.Fchown(fd, hdr.Uid, hdr.Gid); err != nil {
		return err
	}
	// After chown: chown clears setuid/setgid bits.
	if err := unix.Fchmod(fd, mode); err != nil {
		return err
	}
	for k, v := range xattrs {
		if err := unix.Fsetxattr(fd, k, []byte(v), 0); err != nil {
			return fmt.Errorf("set xattr %s: %w", k, err)
		}
	}
	// An opaque directory is marked in both of overlayfs's forms: trusted.*
	// (an overlay mounted by host root) and user.* (one mounted in a user
	// namespace with userxattr), so a layer moves between workers with and
	// without user namespaces intact.
	if hdr.Typeflag == tar.TypeDir {
		if xattrs[opaqueTrusted] == "y" || xattrs[opaqueUser] == "y" {
			for _, k := range []string{opaqueTrusted, opaqueUser} {
				if err := unix.Fsetxattr(fd, k, []byte("y"), 0); err != nil {
					return fmt.Errorf("set xattr %s: %w", k, err)
				}
			}
		}
	}
	if hdr.Typeflag != tar.TypeDir {
		ts := []unix.Timespec{unix.NsecToTimespec(hdr.ModTime.UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
		return unix.UtimesNanoAt(pfd, base, ts, unix.AT_SYMLINK_NOFOLLOW)
	}
	return nil
}

// setAttrsPath sets owner, mode and times on a node the extractor just
// created (whiteout or FIFO) without opening it.
func (x *extractor) setAttrsPath(pfd int, base string, hdr *tar.Header, mode uint32) error {
	if err := unix.Fchownat(pfd, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	if err := unix.Fchmodat(pfd, base, mode, 0); err != nil {
		return err
	}
	return setTimes(pfd, base, hdr.ModTime)
}

func setTimes(pfd int, base string, mtime time.Time) error {
	ts := []unix.Timespec{unix.NsecToTimespec(mtime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
	return unix.UtimesNanoAt(pfd, base, ts, unix.AT_SYMLINK_NOFOLLOW)
}
