//go:build linux

// ApplyTar: one OCI/Docker layer tar into a directory in layer form. The
// tar is hostile input (anyone can push an image): every file system
// operation is relative to a directory descriptor resolved beneath dir
// with openat2(RESOLVE_IN_ROOT), and the last component is never
// followed, so even a check missed here cannot reach outside dir.

package layerstore

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// ApplyOptions bound what ApplyTar accepts. Zero fields take the defaults.
type ApplyOptions struct {
	// MaxEntries is the most tar entries plus parent directories created
	// without an entry (default 1<<20).
	MaxEntries int64
	// MaxBytes is the most content bytes, the sum of regular files'
	// (logical) sizes (default 32 GiB).
	MaxBytes int64
	// MaxDepth is the most path components of a name (default 256).
	MaxDepth int
}

// Default limits.
const (
	DefaultMaxEntries = 1 << 20
	DefaultMaxBytes   = 32 << 30
	DefaultMaxDepth   = 256
)

func (o *ApplyOptions) defaults() {
	if o.MaxEntries <= 0 {
		o.MaxEntries = DefaultMaxEntries
	}
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultMaxBytes
	}
	if o.MaxDepth <= 0 {
		o.MaxDepth = DefaultMaxDepth
	}
}

// ApplyStats counts what ApplyTar did.
type ApplyStats struct {
	Entries       int64 // tar entries read
	Files         int64 // regular files written
	Dirs          int64 // directories from entries
	ImplicitDirs  int64 // parents created without an entry (0755, 0:0)
	Symlinks      int64
	Hardlinks     int64
	FIFOs         int64
	Whiteouts     int64 // .wh.<name> turned into 0:0 character devices
	Opaques       int64 // .wh..wh..opq turned into opaque markers
	Devices       int64 // character and block devices skipped
	Skipped       int64 // other entries skipped (aufs .wh..wh.* metadata, whiteouts of same-layer files)
	XattrsDropped int64 // xattrs not kept (see filterXattr)
	Bytes         int64 // content bytes written
}

// ApplyError is a layer tar ApplyTar refuses. errors.Is(err,
// errdefs.ErrInvalid) for a hostile or malformed tar, errdefs.ErrTooLarge
// for one over ApplyOptions' limits; Cause (also unwrapped) is the
// underlying error when there is one (a read error of the source).
type ApplyError struct {
	Entry  string
	Reason string
	Class  error
	Cause  error
}

func (e *ApplyError) Error() string {
	s := "layer tar"
	if e.Entry != "" {
		s += fmt.Sprintf(" entry %q", e.Entry)
	}
	s += ": " + e.Class.Error() + ": " + e.Reason
	if e.Cause != nil {
		s += ": " + e.Cause.Error()
	}
	return s
}

func (e *ApplyError) Unwrap() []error {
	if e.Cause != nil {
		return []error{e.Class, e.Cause}
	}
	return []error{e.Class}
}

func invalid(entry, reason string) *ApplyError {
	return &ApplyError{Entry: entry, Reason: reason, Class: errdefs.ErrInvalid}
}

// ApplyTar fills dir (an existing directory, normally fresh and empty)
// from one uncompressed layer tar:
//
//   - names are relative; absolute names, ".." components and NUL bytes
//     are refused; parents missing from the tar are created (0755, 0:0);
//     a parent that is a symlink is resolved inside dir (RESOLVE_IN_ROOT:
//     "/" and ".." end at dir), never outside it;
//   - a later entry replaces an earlier one of the same name (a directory
//     over a directory keeps its children);
//   - .wh.<name> becomes a 0:0 character device <name> (unless this layer
//     itself has <name>: the layer's own file wins), .wh..wh..opq marks
//     its directory opaque (trusted.overlay.opaque=y and
//     user.overlay.opaque=y); other .wh..wh.* entries are skipped;
//   - hard links must name a non-directory entry seen earlier in the tar;
//   - character and block devices are skipped and counted;
//   - owners, modes (setuid/setgid/sticky included), mtimes and the kept
//     xattrs (filterXattr) are applied.
//
// On error dir holds a partial tree: the caller discards it (Store.Add
// does).
func ApplyTar(dir string, r io.Reader, opt ApplyOptions) (ApplyStats, error) {
	opt.defaults()
	var st ApplyStats
	rootFd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return st, fmt.Errorf("layer tar: open %s: %w", dir, err)
	}
	a := &applier{root: rootFd, opt: opt, st: &st, seen: map[string]bool{}, dirTimes: map[string]time.Time{}, cacheFd: -1}
	defer a.close()
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return st, &ApplyError{Reason: "malformed archive", Class: errdefs.ErrInvalid, Cause: err}
		}
		if hdr.Typeflag == tar.TypeXGlobalHeader {
			continue
		}
		st.Entries++
		if st.Entries > opt.MaxEntries {
			return st, &ApplyError{Entry: hdr.Name, Reason: fmt.Sprintf("more than %d entries", opt.MaxEntries), Class: errdefs.ErrTooLarge}
		}
		if err := a.entry(hdr, tr); err != nil {
			var ae *ApplyError
			if errors.As(err, &ae) {
				return st, err
			}
			return st, &ApplyError{Entry: hdr.Name, Reason: "extract", Class: classify(err), Cause: err}
		}
	}
	if err := a.finishDirs(); err != nil {
		return st, fmt.Errorf("layer tar: directory times: %w", err)
	}
	return st, nil
}

// classify gives a file system error met while extracting its class: the
// ones a tar's content causes are ErrInvalid, the rest (ENOSPC, EIO)
// carry no class of their own.
func classify(err error) error {
	switch {
	case errors.Is(err, unix.ENOTDIR), errors.Is(err, unix.ELOOP), errors.Is(err, unix.EXDEV),
		errors.Is(err, unix.ENOENT), errors.Is(err, unix.EEXIST), errors.Is(err, unix.EPERM),
		errors.Is(err, unix.EISDIR), errors.Is(err, unix.ENAMETOOLONG), errors.Is(err, unix.EINVAL),
		errors.Is(err, unix.EMLINK), errors.Is(err, unix.ENOTEMPTY):
		return errdefs.ErrInvalid
	case errors.Is(err, unix.ENOSPC), errors.Is(err, unix.EDQUOT):
		return errdefs.ErrUnavailable
	}
	return errdefs.ErrUpstream
}

type applier struct {
	root int
	opt  ApplyOptions
	st   *ApplyStats
	// seen: names of non-directory entries this tar created (hard link
	// targets must be among them).
	seen map[string]bool
	// dirTimes: directories' mtimes, set at the end (adding children
	// changes them).
	dirTimes map[string]time.Time
	// One cached parent descriptor: consecutive entries mostly share it.
	// Dropped whenever an entry could change what a path resolves to.
	cacheDir string
	cacheFd  int
}

func (a *applier) entry(hdr *tar.Header, r io.Reader) error {
	name, aerr := a.cleanName(hdr.Name)
	if aerr != nil {
		return aerr
	}
	if hdr.Uid < 0 || hdr.Gid < 0 || int64(hdr.Uid) > 0xfffffffe || int64(hdr.Gid) > 0xfffffffe {
		return invalid(hdr.Name, "owner out of range")
	}
	dir, base := path.Split(name)
	dir = strings.TrimSuffix(dir, "/")
	if strings.HasPrefix(base, ".wh.") {
		return a.whiteout(hdr.Name, dir, base)
	}
	if name == "" {
		if hdr.Typeflag != tar.TypeDir {
			return invalid(hdr.Name, "the root is not a directory")
		}
		a.st.Dirs++
		a.dirTimes[""] = hdr.ModTime
		return a.setAttrs(a.root, hdr)
	}
	mode := uint32(hdr.Mode) & 0o7777
	switch hdr.Typeflag {
	case tar.TypeReg, tar.TypeGNUSparse:
		if hdr.Size < 0 {
			return invalid(hdr.Name, "negative size")
		}
		if hdr.Size > a.opt.MaxBytes-a.st.Bytes {
			return &ApplyError{Entry: hdr.Name, Reason: fmt.Sprintf("content exceeds %d bytes", a.opt.MaxBytes), Class: errdefs.ErrTooLarge}
		}
		pfd, err := a.prepare(dir, base, false)
		if err != nil {
			return err
		}
		fd, err := unix.Openat(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), base)
		defer f.Close()
		n, err := io.Copy(f, io.LimitReader(r, hdr.Size))
		a.st.Bytes += n
		if err != nil {
			return &ApplyError{Entry: hdr.Name, Reason: "read content", Class: errdefs.ErrInvalid, Cause: err}
		}
		if n != hdr.Size {
			return &ApplyError{Entry: hdr.Name, Reason: "truncated content", Class: errdefs.ErrInvalid, Cause: io.ErrUnexpectedEOF}
		}
		if err := a.setAttrs(fd, hdr); err != nil {
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
		a.seen[name] = true
		a.st.Files++
		return nil
	case tar.TypeDir:
		pfd, err := a.prepare(dir, base, true)
		if err != nil {
			return err
		}
		if err := unix.Mkdirat(pfd, base, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
			return err
		}
		fd, err := unix.Openat(pfd, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		a.dropCache() // a directory may now stand where a path went elsewhere
		delete(a.seen, name)
		a.dirTimes[name] = hdr.ModTime
		a.st.Dirs++
		return a.setAttrs(fd, hdr)
	case tar.TypeSymlink:
		if hdr.Linkname == "" || strings.ContainsRune(hdr.Linkname, 0) || len(hdr.Linkname) >= unix.PathMax {
			return invalid(hdr.Name, "bad symlink target")
		}
		pfd, err := a.prepare(dir, base, false)
		if err != nil {
			return err
		}
		if err := unix.Symlinkat(hdr.Linkname, pfd, base); err != nil {
			return err
		}
		if err := unix.Fchownat(pfd, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		if err := setTimes(pfd, base, hdr.ModTime); err != nil {
			return err
		}
		a.dropCache() // paths through name now resolve elsewhere
		a.seen[name] = true
		a.st.Symlinks++
		return nil
	case tar.TypeLink:
		target, aerr := a.cleanName(hdr.Linkname)
		if aerr != nil {
			aerr.Entry, aerr.Reason = hdr.Name, "hard link target: "+aerr.Reason
			return aerr
		}
		if target == name {
			return invalid(hdr.Name, "hard link to itself")
		}
		if !a.seen[target] {
			return invalid(hdr.Name, fmt.Sprintf("hard link to %q, not a file seen earlier in this layer", hdr.Linkname))
		}
		tdir, tbase := path.Split(target)
		tfd, err := a.openDir(strings.TrimSuffix(tdir, "/"), unix.O_PATH)
		if err != nil {
			return &ApplyError{Entry: hdr.Name, Reason: "hard link target's directory", Class: errdefs.ErrInvalid, Cause: err}
		}
		defer unix.Close(tfd)
		pfd, err := a.prepare(dir, base, false)
		if err != nil {
			return err
		}
		// flags 0: a symlink target is linked itself, never followed.
		if err := unix.Linkat(tfd, tbase, pfd, base, 0); err != nil {
			return &ApplyError{Entry: hdr.Name, Reason: "hard link", Class: errdefs.ErrInvalid, Cause: err}
		}
		a.seen[name] = true
		a.st.Hardlinks++
		return nil
	case tar.TypeFifo:
		pfd, err := a.prepare(dir, base, false)
		if err != nil {
			return err
		}
		if err := unix.Mknodat(pfd, base, unix.S_IFIFO|0o600, 0); err != nil {
			return err
		}
		if err := unix.Fchownat(pfd, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		if err := unix.Fchmodat(pfd, base, mode, 0); err != nil {
			return err
		}
		if err := setTimes(pfd, base, hdr.ModTime); err != nil {
			return err
		}
		a.seen[name] = true
		a.st.FIFOs++
		return nil
	case tar.TypeChar, tar.TypeBlock:
		a.st.Devices++
		return nil
	}
	return invalid(hdr.Name, fmt.Sprintf("unsupported entry type %q", hdr.Typeflag))
}

// whiteout turns .wh.<name> and .wh..wh..opq into layer form.
func (a *applier) whiteout(entry, dir, base string) error {
	if base == ".wh..wh..opq" {
		if _, err := a.parent(dir); err != nil { // creates dir when missing
			return err
		}
		fd, err := a.openDir(dir, unix.O_RDONLY)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		for _, k := range []string{opaqueTrusted, opaqueUser} {
			if err := unix.Fsetxattr(fd, k, []byte("y"), 0); err != nil {
				return fmt.Errorf("set %s: %w", k, err)
			}
		}
		a.st.Opaques++
		return nil
	}
	if strings.HasPrefix(base, ".wh..wh.") {
		a.st.Skipped++ // aufs metadata (.wh..wh.plnk, .wh..wh.aufs)
		return nil
	}
	target := strings.TrimPrefix(base, ".wh.")
	if target == "" || target == "." || target == ".." {
		return invalid(entry, "whiteout of no name")
	}
	pfd, err := a.parent(dir)
	if err != nil {
		return err
	}
	var fst unix.Stat_t
	if err := unix.Fstatat(pfd, target, &fst, unix.AT_SYMLINK_NOFOLLOW); err == nil {
		// Whiteouts hide lower layers only: this layer's own entry stays.
		a.st.Skipped++
		return nil
	} else if !errors.Is(err, unix.ENOENT) {
		return err
	}
	if err := unix.Mknodat(pfd, target, unix.S_IFCHR, 0); err != nil {
		return fmt.Errorf("whiteout: %w", err)
	}
	if err := unix.Fchownat(pfd, target, 0, 0, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	a.st.Whiteouts++
	return nil
}

// setAttrs applies owner, mode, kept xattrs and (for non-directories)
// times to the open file or directory fd.
func (a *applier) setAttrs(fd int, hdr *tar.Header) error {
	if err := unix.Fchown(fd, hdr.Uid, hdr.Gid); err != nil {
		return err
	}
	// After chown, which clears setuid/setgid.
	if err := unix.Fchmod(fd, uint32(hdr.Mode)&0o7777); err != nil {
		return err
	}
	keys := make([]string, 0, len(hdr.PAXRecords))
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "SCHILY.xattr.") {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		name := strings.TrimPrefix(k, "SCHILY.xattr.")
		v, ok := filterXattr(name, []byte(hdr.PAXRecords[k]))
		if !ok {
			a.st.XattrsDropped++
			continue
		}
		if err := unix.Fsetxattr(fd, name, v, 0); err != nil {
			if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ERANGE) || errors.Is(err, unix.E2BIG) ||
				errors.Is(err, unix.EOPNOTSUPP) {
				a.st.XattrsDropped++ // a value the file system refuses (a malformed ACL, too big)
				continue
			}
			return fmt.Errorf("set xattr %s: %w", name, err)
		}
	}
	if hdr.Typeflag != tar.TypeDir {
		ts := []unix.Timespec{unix.NsecToTimespec(hdr.ModTime.UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
		return unix.UtimesNanoAt(fd, "", ts, unix.AT_EMPTY_PATH)
	}
	return nil
}

// finishDirs sets directories' mtimes, deepest first, once their
// children are all in place.
func (a *applier) finishDirs() error {
	a.dropCache()
	names := make([]string, 0, len(a.dirTimes))
	for n := range a.dirTimes {
		names = append(names, n)
	}
	slices.SortFunc(names, func(x, y string) int { return strings.Count(y, "/") - strings.Count(x, "/") })
	for _, n := range names {
		if n == "" {
			continue
		}
		dir, base := path.Split(n)
		pfd, err := a.openDir(strings.TrimSuffix(dir, "/"), unix.O_PATH)
		if err != nil {
			return err
		}
		err = setTimes(pfd, base, a.dirTimes[n])
		unix.Close(pfd)
		if err != nil && !errors.Is(err, unix.ENOENT) {
			return err
		}
	}
	if t, ok := a.dirTimes[""]; ok {
		ts := []unix.Timespec{unix.NsecToTimespec(t.UnixNano()), unix.NsecToTimespec(t.UnixNano())}
		return unix.UtimesNanoAt(a.root, "", ts, unix.AT_EMPTY_PATH)
	}
	return nil
}

func setTimes(pfd int, base string, mtime time.Time) error {
	ts := []unix.Timespec{unix.NsecToTimespec(mtime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
	return unix.UtimesNanoAt(pfd, base, ts, unix.AT_SYMLINK_NOFOLLOW)
}
