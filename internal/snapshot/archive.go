//go:build linux

package snapshot

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/errdefs"
)

// The archive format.
//
// A snapshot is a tar archive (PAX format, archive/tar) of an overlayfs
// upper directory, entries in lexical walk order (parents first), names
// relative to the upper directory ("etc/", "etc/hosts"), directories with a
// trailing slash. The upper directory itself is not an entry. Each entry
// keeps its permission bits (including setuid, setgid and sticky), numeric
// owner and group, and modification time with nanoseconds. Supported
// entries:
//
//   - directories, regular files, symbolic links (the target is stored as
//     is: absolute targets are normal inside a sandbox and are never
//     followed by Restore), FIFOs;
//   - sparse regular files: TypeSparse entries holding only the data
//     extents (see sparse.go); files without holes are TypeReg;
//   - hard links: the second and later names of a regular file are
//     TypeLink entries naming the first;
//   - overlay whiteouts: character devices 0:0 (TypeChar, major and minor
//     0). Any other device node is left out of the archive (and refused by
//     Restore); sockets are left out;
//   - extended attributes as PAX "SCHILY.xattr.<name>" records, only those
//     in the allowlist (see keepXattr): the overlay opaque-directory markers
//     trusted.overlay.opaque and user.overlay.opaque, and user.* attributes
//     that are not overlay's own. Other trusted.overlay.* attributes (origin,
//     impure, redirect) describe the lower layer of this host and are
//     dropped; security.* (file capabilities, SELinux labels) is dropped.

// Stats summarizes an archive or a restore.
type Stats struct {
	Entries int
	Bytes   int64 // regular file content stored (holes of sparse files excluded)
	Logical int64 // regular file sizes (holes included)
	// Skipped counts files Archive left out (sockets, device nodes other
	// than whiteouts).
	Skipped int
}

// ErrHostileArchive is matched (errors.Is) by every *ArchiveError.
var ErrHostileArchive = errors.New("snapshot: archive rejected")

// ArchiveError rejects one entry of an archive given to Restore. It
// matches ErrHostileArchive and errdefs.ErrInvalid, and Err when set (an
// archive over the restore's Limits is also ErrOverLimit).
type ArchiveError struct {
	Entry  string
	Reason string
	Err    error
}

func (e *ArchiveError) Error() string {
	return fmt.Sprintf("snapshot: archive entry %q rejected: %s", e.Entry, e.Reason)
}

func (e *ArchiveError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrHostileArchive) and errors.Is(err,
// errdefs.ErrInvalid) hold.
func (e *ArchiveError) Is(target error) bool {
	return target == ErrHostileArchive || target == errdefs.ErrInvalid
}

const xattrPrefix = "SCHILY.xattr."

// The opaque-directory markers of overlayfs without and with userxattr.
const (
	opaqueTrusted = "trusted.overlay.opaque"
	opaqueUser    = "user.overlay.opaque"
)

// keepXattr is the allowlist of extended attributes an archive carries.
func keepXattr(name string) bool {
	switch name {
	case "trusted.overlay.opaque", "user.overlay.opaque":
		return true
	}
	return strings.HasPrefix(name, "user.") && !strings.HasPrefix(name, "user.overlay.")
}

// ArchiveOptions bound what Archive writes.
type ArchiveOptions struct {
	Limits
	// SpaceDir is a directory on the file system the archive ends up on
	// (a local store's directory), whose free space is checked before and
	// while writing; empty (an object store): not checked.
	SpaceDir string
	Space    FreeSpace
}

// Archive writes the tree under dir to w as described above. The tree must
// be quiescent (a paused or stopped sandbox); Archive never follows
// symbolic links. It stops with an error matching ErrOverLimit before the
// archive would exceed opts' Limits, and with one matching ErrNoSpace when
// opts.SpaceDir's file system runs short; w then holds a partial archive
// the caller discards (a store's Put does when its reader fails).
func Archive(ctx context.Context, dir string, w io.Writer, opts ArchiveOptions) (Stats, error) {
	opts.defaults()
	var st Stats
	guard := newSpaceGuard(opts.SpaceDir, opts.Space)
	if err := guard.check(0); err != nil {
		return st, fmt.Errorf("snapshot: archive: %w", err)
	}
	if guard != nil {
		w = guardWriter{w, guard}
	}
	tw := tar.NewWriter(w)
	type inode struct{ dev, ino uint64 }
	links := map[inode]string{}
	buf := make([]byte, 256<<10)
	tooLarge := func(name, what string, limit int64) error {
		return fmt.Errorf("%w: %s exceeds %d at %q", ErrOverLimit, what, limit, name)
	}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		if rel == "." {
			return nil
		}
		name := filepath.ToSlash(rel)
		var s unix.Stat_t
		if err := unix.Lstat(p, &s); err != nil {
			return fmt.Errorf("lstat %s: %w", name, err)
		}
		hdr := &tar.Header{
			Name:    name,
			Mode:    int64(s.Mode & 0o7777),
			Uid:     int(s.Uid),
			Gid:     int(s.Gid),
			ModTime: time.Unix(s.Mtim.Unix()),
			Format:  tar.FormatPAX,
		}
		var f *os.File // regular file content
		defer func() {
			if f != nil {
				f.Close()
			}
		}()
		var ext []extent
		switch s.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			hdr.Typeflag, hdr.Name = tar.TypeDir, name+"/"
		case unix.S_IFREG:
			if s.Nlink > 1 {
				k := inode{uint64(s.Dev), s.Ino}
				if first, ok := links[k]; ok {
					hdr.Typeflag, hdr.Linkname = tar.TypeLink, first
					break
				}
				links[k] = name
			}
			if f, err = os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0); err != nil {
				return fmt.Errorf("open %s: %w", name, err)
			}
			hdr.Typeflag, hdr.Size = tar.TypeReg, s.Size
			// Blocks cover the size: no holes, no need to look for them.
			if s.Blocks*512 < s.Size {
				if ext, err = dataExtents(int(f.Fd()), s.Size); err != nil {
					return fmt.Errorf("%s: %w", name, err)
				}
				if stored := storedBytes(ext); stored < s.Size {
					hdr.Typeflag, hdr.Size = TypeSparse, stored
					hdr.PAXRecords = map[string]string{sparseRecord: formatSparse(s.Size, ext)}
				}
			}
			if st.Bytes+hdr.Size > opts.MaxBytes {
				return tooLarge(name, "file content", opts.MaxBytes)
			}
			if st.Logical+s.Size > opts.MaxLogical {
				return tooLarge(name, "logical file size", opts.MaxLogical)
			}
		case unix.S_IFLNK:
			target, err := os.Readlink(p)
			if err != nil {
				return fmt.Errorf("readlink %s: %w", name, err)
			}
			hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
		case unix.S_IFCHR:
			if unix.Major(uint64(s.Rdev)) != 0 || unix.Minor(uint64(s.Rdev)) != 0 {
				st.Skipped++
				return nil
			}
			hdr.Typeflag = tar.TypeChar // overlay whiteout
		case unix.S_IFIFO:
			hdr.Typeflag = tar.TypeFifo
		default: // sockets, block devices
			st.Skipped++
			return nil
		}
		if st.Entries+1 > opts.MaxEntries {
			return fmt.Errorf("%w: more than %d entries at %q", ErrOverLimit, opts.MaxEntries, name)
		}
		if hdr.Typeflag == tar.TypeDir || f != nil {
			xa, err := readXattrs(p)
			if err != nil {
				return fmt.Errorf("xattrs of %s: %w", name, err)
			}
			for k, v := range xa {
				if hdr.PAXRecords == nil {
					hdr.PAXRecords = map[string]string{}
				}
				hdr.PAXRecords[xattrPrefix+k] = v
			}
		}
		if err := guard.large(hdr.Size); err != nil {
			return err
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		st.Entries++
		if f == nil {
			crashpoint.Hit(crashpoint.ArchiveEntry)
			return nil
		}
		if hdr.Typeflag == tar.TypeReg {
			ext = []extent{{0, s.Size}}
		}
		for _, e := range ext {
			n, err := io.CopyBuffer(tw, io.NewSectionReader(f, e.off, e.len), buf)
			if err != nil {
				return fmt.Errorf("copy %s: %w", name, err)
			}
			if n != e.len {
				return fmt.Errorf("copy %s: file changed size while archiving (is the sandbox paused?)", name)
			}
		}
		st.Bytes += hdr.Size
		st.Logical += s.Size
		crashpoint.Hit(crashpoint.ArchiveEntry)
		return nil
	})
	if err != nil {
		return st, fmt.Errorf("snapshot: archive: %w", err)
	}
	if err := tw.Close(); err != nil {
		return st, fmt.Errorf("snapshot: archive: %w", err)
	}
	return st, nil
}

func readXattrs(p string) (map[string]string, error) {
	sz, err := unix.Llistxattr(p, nil)
	if err != nil || sz == 0 {
		if errors.Is(err, unix.ENOTSUP) {
			err = nil
		}
		return nil, err
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(p, buf)
	if err != nil {
		return nil, err
	}
	var out map[string]string
	for _, name := range strings.Split(string(buf[:sz]), "\x00") {
		if name == "" || !keepXattr(name) {
			continue
		}
		vsz, err := unix.Lgetxattr(p, name, nil)
		if err != nil {
			if errors.Is(err, unix.ENODATA) {
				continue
			}
			return nil, err
		}
		v := make([]byte, vsz)
		if vsz > 0 {
			if vsz, err = unix.Lgetxattr(p, name, v); err != nil {
				return nil, err
			}
		}
		if out == nil {
			out = map[string]string{}
		}
		out[name] = string(v[:vsz])
	}
	return out, nil
}
