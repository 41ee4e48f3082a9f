//go:build linux

package volume

// File operations on a volume without a sandbox (E2B's volume content
// API). Every path is taken relative to the volume's data directory and
// resolved with openat2(RESOLVE_IN_ROOT): ".." and symlinks (absolute
// ones included) stay inside the volume, whatever a sandbox left there;
// the last component of a change (mkdir, unlink, chown) is acted on with
// *at calls that do not follow it. Files the API makes get the sandbox
// user's ids unless the caller names others.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// Dir is a volume's data directory open for file operations.
type Dir struct {
	fd      int
	release func()
}

// OpenDir makes volume id available (as Acquire) and opens its data
// directory. Close it when done.
func (m *Manager) OpenDir(ctx context.Context, id string) (*Dir, error) {
	dir, release, err := m.Acquire(ctx, id)
	if err != nil {
		return nil, err
	}
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		release()
		return nil, fmt.Errorf("volume %s: %w", id, err)
	}
	return &Dir{fd: fd, release: release}, nil
}

// Close lets go of the directory and the volume.
func (d *Dir) Close() {
	if d.fd >= 0 {
		unix.Close(d.fd)
		d.fd = -1
		d.release()
	}
}

// classify turns a file system error into its class, keeping the text.
func classify(op, p string, err error) error {
	var class error
	switch {
	case errors.Is(err, unix.ENOENT):
		class = errdefs.ErrNotFound
	case errors.Is(err, unix.EEXIST), errors.Is(err, unix.ENOTEMPTY), errors.Is(err, unix.EBUSY):
		class = errdefs.ErrConflict
	case errors.Is(err, unix.ENOSPC), errors.Is(err, unix.EDQUOT), errors.Is(err, unix.EFBIG):
		class = errdefs.ErrTooLarge
	case errors.Is(err, unix.EACCES), errors.Is(err, unix.EPERM), errors.Is(err, unix.EROFS):
		class = errdefs.ErrDenied
	case errors.Is(err, unix.ENOTDIR), errors.Is(err, unix.EISDIR), errors.Is(err, unix.EINVAL),
		errors.Is(err, unix.ELOOP), errors.Is(err, unix.ENAMETOOLONG), errors.Is(err, unix.EXDEV):
		class = errdefs.ErrInvalid
	default:
		return fmt.Errorf("%s %s: %w", op, p, err)
	}
	var errno syscall.Errno
	msg := err.Error()
	if errors.As(err, &errno) {
		msg = errno.Error()
	}
	return errdefs.Message(class, fmt.Sprintf("%s %s: %s", op, p, msg))
}

// open resolves p (clean, absolute in the volume) inside the volume.
func (d *Dir) open(p string, flags uint64, mode uint32) (int, error) {
	rel := strings.TrimPrefix(p, "/")
	if rel == "" {
		rel = "."
	}
	how := unix.OpenHow{Flags: flags | unix.O_CLOEXEC, Mode: uint64(mode), Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV}
	for {
		fd, err := unix.Openat2(d.fd, rel, &how)
		if err == unix.EAGAIN || err == unix.EINTR {
			continue // a rename raced the lookup
		}
		return fd, err
	}
}

// parent opens the directory holding p and returns it with p's last
// component (ErrInvalid for the root).
func (d *Dir) parent(p string) (int, string, error) {
	if p == "/" {
		return -1, "", errdefs.Message(errdefs.ErrInvalid, "the volume's root cannot be changed this way")
	}
	fd, err := d.open(path.Dir(p), unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return -1, "", classify("open", path.Dir(p), err)
	}
	return fd, path.Base(p), nil
}

func entryOf(p string, st *unix.Stat_t, target string) Entry {
	e := Entry{Name: path.Base(p), Path: p, Size: st.Size, Mode: st.Mode & 0o7777, UID: st.Uid, GID: st.Gid,
		Atime: time.Unix(st.Atim.Unix()).UTC(), Mtime: time.Unix(st.Mtim.Unix()).UTC(), Ctime: time.Unix(st.Ctim.Unix()).UTC(), Target: target}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		e.Type = "file"
	case unix.S_IFDIR:
		e.Type = "directory"
	case unix.S_IFLNK:
		e.Type = "symlink"
	default:
		e.Type = "unknown"
	}
	if p == "/" {
		e.Name = "/"
	}
	return e
}

// statAt describes name in the directory open at dfd (not following it).
func statAt(dfd int, name, p string) (Entry, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW|unix.AT_EMPTY_PATH); err != nil {
		return Entry{}, classify("stat", p, err)
	}
	target := ""
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		buf := make([]byte, 4096)
		if n, err := unix.Readlinkat(dfd, name, buf); err == nil {
			target = string(buf[:n])
		}
	}
	return entryOf(p, &st, target), nil
}

// Stat describes p (a symlink itself, not its target).
func (d *Dir) Stat(p string) (Entry, error) {
	p, err := Clean(p)
	if err != nil {
		return Entry{}, err
	}
	if p == "/" {
		return statAt(d.fd, "", p)
	}
	dfd, name, err := d.parent(p)
	if err != nil {
		return Entry{}, err
	}
	defer unix.Close(dfd)
	return statAt(dfd, name, p)
}

// List describes the entries under directory p, depth levels deep (1:
// its own entries), at most MaxListEntries.
func (d *Dir) List(p string, depth int) ([]Entry, error) {
	p, err := Clean(p)
	if err != nil {
		return nil, err
	}
	if depth < 1 {
		depth = 1
	}
	out := []Entry{}
	var walk func(p string, level int) error
	walk = func(p string, level int) error {
		fd, err := d.open(p, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			return classify("list", p, err)
		}
		f := os.NewFile(uintptr(fd), p)
		names, err := f.Readdirnames(-1)
		if err != nil {
			f.Close()
			return classify("list", p, err)
		}
		var dirs []string
		for _, n := range names {
			if len(out) >= MaxListEntries {
				break
			}
			e, err := statAt(fd, n, path.Join(p, n))
			if err != nil {
				continue // removed meanwhile
			}
			out = append(out, e)
			if e.Type == "directory" && level < depth {
				dirs = append(dirs, e.Path)
			}
		}
		f.Close()
		for _, c := range dirs {
			if err := walk(c, level+1); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
				return err
			}
		}
		return nil
	}
	if err := walk(p, 1); err != nil {
		return nil, err
	}
	return out, nil
}

func (a Attrs) owner() (int, int) {
	uid, gid := UserID, GroupID
	if a.UID != nil {
		uid = int(*a.UID)
	}
	if a.GID != nil {
		gid = int(*a.GID)
	}
	return uid, gid
}

func (a Attrs) mode(def uint32) uint32 {
	if a.Mode != nil {
		return *a.Mode & 0o7777
	}
	return def
}

// checkIDs refuses ids past the 16-bit range the sandboxes map.
func (a Attrs) checkIDs() error {
	for _, v := range []*uint32{a.UID, a.GID} {
		if v != nil && *v > 65535 {
			return errdefs.Message(errdefs.ErrInvalid, "uid and gid must be 0..65535")
		}
	}
	return nil
}

// Mkdir makes directory p (with its missing parents when parents; then an
// existing directory is no error) owned and moded by a.
func (d *Dir) Mkdir(p string, a Attrs, parents bool) (Entry, error) {
	p, err := Clean(p)
	if err != nil {
		return Entry{}, err
	}
	if err := a.checkIDs(); err != nil {
		return Entry{}, err
	}
	if parents && path.Dir(p) != p {
		if _, err := d.Stat(path.Dir(p)); errors.Is(err, errdefs.ErrNotFound) {
			if _, err := d.Mkdir(path.Dir(p), a, true); err != nil {
				return Entry{}, err
			}
		}
	}
	dfd, name, err := d.parent(p)
	if err != nil {
		return Entry{}, err
	}
	defer unix.Close(dfd)
	if err := unix.Mkdirat(dfd, name, 0o700); err != nil {
		if err == unix.EEXIST && parents {
			if e, serr := statAt(dfd, name, p); serr == nil && e.Type == "directory" {
				return e, nil
			}
		}
		return Entry{}, classify("mkdir", p, err)
	}
	uid, gid := a.owner()
	if err := unix.Fchownat(dfd, name, uid, gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return Entry{}, classify("chown", p, err)
	}
	if err := d.chmod(dfd, name, p, a.mode(0o755)); err != nil {
		return Entry{}, err
	}
	return statAt(dfd, name, p)
}

// chmod sets name's mode through an O_PATH descriptor (never a symlink).
func (d *Dir) chmod(dfd int, name, p string, mode uint32) error {
	fd, err := unix.Openat(dfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return classify("chmod", p, err)
	}
	defer unix.Close(fd)
	if err := unix.Fchmodat(unix.AT_FDCWD, fmt.Sprintf("/proc/self/fd/%d", fd), mode, 0); err != nil {
		return classify("chmod", p, err)
	}
	return nil
}

// WriteFile writes r to file p (replacing it; missing parent directories
// are made), owned and moded by a, at most limit bytes.
func (d *Dir) WriteFile(p string, r io.Reader, a Attrs, limit int64) (Entry, error) {
	p, err := Clean(p)
	if err != nil {
		return Entry{}, err
	}
	if err := a.checkIDs(); err != nil {
		return Entry{}, err
	}
	if p == "/" {
		return Entry{}, errdefs.Message(errdefs.ErrInvalid, "cannot write the volume's root")
	}
	if _, err := d.Stat(path.Dir(p)); errors.Is(err, errdefs.ErrNotFound) {
		if _, err := d.Mkdir(path.Dir(p), Attrs{UID: a.UID, GID: a.GID}, true); err != nil {
			return Entry{}, err
		}
	}
	dfd, name, err := d.parent(p)
	if err != nil {
		return Entry{}, err
	}
	defer unix.Close(dfd)
	// Written under a temporary name and renamed over p: a failed or cut
	// upload leaves p as it was.
	tmp := ".space-upload-" + NewID()[4:]
	fd, err := unix.Openat(dfd, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return Entry{}, classify("write", p, err)
	}
	f := os.NewFile(uintptr(fd), p)
	n, err := io.Copy(f, io.LimitReader(r, limit+1))
	if err == nil && n > limit {
		err = errdefs.Message(errdefs.ErrTooLarge, fmt.Sprintf("write %s: over %d bytes", p, limit))
	}
	if err == nil {
		uid, gid := a.owner()
		if cerr := f.Chown(uid, gid); cerr != nil {
			err = classify("chown", p, cerr)
		} else if cerr := f.Chmod(os.FileMode(a.mode(0o644) & 0o777)); cerr != nil {
			err = classify("chmod", p, cerr)
		}
	}
	if cerr := f.Close(); err == nil && cerr != nil {
		err = classify("write", p, cerr)
	}
	if err == nil {
		if rerr := unix.Renameat(dfd, tmp, dfd, name); rerr != nil {
			err = classify("write", p, rerr)
		}
	}
	if err != nil {
		_ = unix.Unlinkat(dfd, tmp, 0)
		if !isClassed(err) {
			err = classify("write", p, err)
		}
		return Entry{}, err
	}
	return statAt(dfd, name, p)
}

func isClassed(err error) bool {
	for _, c := range []error{errdefs.ErrNotFound, errdefs.ErrConflict, errdefs.ErrInvalid, errdefs.ErrDenied, errdefs.ErrTooLarge} {
		if errors.Is(err, c) {
			return true
		}
	}
	return false
}

// Open opens file p for reading (symlinks followed inside the volume).
func (d *Dir) Open(p string) (*os.File, error) {
	p, err := Clean(p)
	if err != nil {
		return nil, err
	}
	fd, err := d.open(p, unix.O_RDONLY|unix.O_NOCTTY|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, classify("read", p, err)
	}
	f := os.NewFile(uintptr(fd), p)
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, errdefs.Message(errdefs.ErrInvalid, fmt.Sprintf("read %s: not a regular file", p))
	}
	return f, nil
}

// SetAttrs changes p's owner and mode (not following a symlink).
func (d *Dir) SetAttrs(p string, a Attrs) (Entry, error) {
	p, err := Clean(p)
	if err != nil {
		return Entry{}, err
	}
	if err := a.checkIDs(); err != nil {
		return Entry{}, err
	}
	var dfd int
	var name string
	if p == "/" {
		if dfd, err = unix.Dup(d.fd); err != nil {
			return Entry{}, err
		}
	} else if dfd, name, err = d.parent(p); err != nil {
		return Entry{}, err
	}
	defer unix.Close(dfd)
	cur, err := statAt(dfd, name, p)
	if err != nil {
		return Entry{}, err
	}
	if a.UID != nil || a.GID != nil {
		uid, gid := -1, -1
		if a.UID != nil {
			uid = int(*a.UID)
		}
		if a.GID != nil {
			gid = int(*a.GID)
		}
		if err := unix.Fchownat(dfd, name, uid, gid, unix.AT_SYMLINK_NOFOLLOW|unix.AT_EMPTY_PATH); err != nil {
			return Entry{}, classify("chown", p, err)
		}
	}
	if a.Mode != nil && cur.Type != "symlink" {
		if name == "" {
			if err := unix.Fchmodat(unix.AT_FDCWD, fmt.Sprintf("/proc/self/fd/%d", dfd), *a.Mode&0o7777, 0); err != nil {
				return Entry{}, classify("chmod", p, err)
			}
		} else if err := d.chmod(dfd, name, p, *a.Mode&0o7777); err != nil {
			return Entry{}, err
		}
	}
	return statAt(dfd, name, p)
}

// Remove removes p, a directory with everything in it.
func (d *Dir) Remove(p string) error {
	p, err := Clean(p)
	if err != nil {
		return err
	}
	dfd, name, err := d.parent(p)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return classify("remove", p, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		if err := unix.Unlinkat(dfd, name, 0); err != nil {
			return classify("remove", p, err)
		}
		return nil
	}
	// RemoveAll walks with openat and O_NOFOLLOW from the parent's
	// descriptor: a symlink swapped in meanwhile is removed, not followed.
	if err := os.RemoveAll(fmt.Sprintf("/proc/self/fd/%d/%s", dfd, name)); err != nil {
		return classify("remove", p, err)
	}
	return nil
}
