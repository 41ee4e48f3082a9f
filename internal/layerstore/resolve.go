//go:build linux

// Where ApplyTar's entries go: names checked, parents resolved inside
// the layer (openat2 RESOLVE_IN_ROOT) and created when missing, and the
// place of an entry cleared without following anything.

package layerstore

import (
	"errors"
	"fmt"
	"os"
	"path"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

func (a *applier) close() {
	a.dropCache()
	unix.Close(a.root)
}

func (a *applier) dropCache() {
	if a.cacheFd >= 0 {
		unix.Close(a.cacheFd)
		a.cacheFd = -1
	}
}

// cleanName validates a tar name and returns it relative to the layer's
// root without a trailing slash ("" is the root itself).
func (a *applier) cleanName(name string) (string, *ApplyError) {
	switch {
	case name == "":
		return "", invalid(name, "empty name")
	case strings.ContainsRune(name, 0):
		return "", invalid(name, "NUL byte in name")
	case strings.HasPrefix(name, "/"):
		return "", invalid(name, "absolute name")
	case len(name) >= unix.PathMax:
		return "", invalid(name, "name too long")
	}
	for _, c := range strings.Split(name, "/") {
		if c == ".." {
			return "", invalid(name, "'..' component")
		}
	}
	n := path.Clean(name)
	if n == "." {
		return "", nil
	}
	if strings.Count(n, "/")+1 > a.opt.MaxDepth {
		return "", &ApplyError{Entry: name, Reason: fmt.Sprintf("deeper than %d components", a.opt.MaxDepth), Class: errdefs.ErrTooLarge}
	}
	return n, nil
}

const resolveFlags = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// openDir opens directory rel (relative to the root, "" = the root)
// resolved inside the root.
func (a *applier) openDir(rel string, flags uint64) (int, error) {
	if rel == "" {
		rel = "."
	}
	for {
		fd, err := unix.Openat2(a.root, rel, &unix.OpenHow{Flags: flags | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: resolveFlags})
		if err == unix.EAGAIN || err == unix.EINTR {
			continue // a concurrent rename elsewhere on the mount: retry
		}
		return fd, err
	}
}

// parent returns a descriptor of directory rel, creating missing
// components (0755, 0:0). The descriptor belongs to the cache: callers do
// not close it.
func (a *applier) parent(rel string) (int, error) {
	if a.cacheFd >= 0 && a.cacheDir == rel {
		return a.cacheFd, nil
	}
	a.dropCache()
	fd, err := a.openDir(rel, unix.O_PATH)
	if errors.Is(err, unix.ENOENT) {
		fd, err = a.mkdirs(rel)
	}
	if err != nil {
		return -1, err
	}
	a.cacheDir, a.cacheFd = rel, fd
	return fd, nil
}

func (a *applier) mkdirs(rel string) (int, error) {
	comps := strings.Split(rel, "/")
	cur := -1 // the root
	defer func() {
		if cur >= 0 {
			unix.Close(cur)
		}
	}()
	for i := range comps {
		prefix := strings.Join(comps[:i+1], "/")
		fd, err := a.openDir(prefix, unix.O_PATH)
		if errors.Is(err, unix.ENOENT) {
			// Implicit parents count as entries: one deep name must not
			// make hundreds of directories on the limit's back.
			if a.st.Entries+a.st.ImplicitDirs >= a.opt.MaxEntries {
				return -1, &ApplyError{Entry: rel, Reason: fmt.Sprintf("more than %d entries (with implicit parents)", a.opt.MaxEntries), Class: errdefs.ErrTooLarge}
			}
			pfd := a.root
			if cur >= 0 {
				pfd = cur
			}
			if err := unix.Mkdirat(pfd, comps[i], 0o755); err != nil {
				return -1, fmt.Errorf("mkdir %s: %w", prefix, err)
			}
			a.st.ImplicitDirs++
			fd, err = a.openDir(prefix, unix.O_PATH)
		}
		if err != nil {
			return -1, fmt.Errorf("open %s: %w", prefix, err)
		}
		if cur >= 0 {
			unix.Close(cur)
		}
		cur = fd
	}
	fd := cur
	cur = -1
	return fd, nil
}

// prepare returns the parent's descriptor with base free for a new entry:
// an existing entry is removed, except a directory when keepDir (a
// directory entry over a directory keeps its children).
func (a *applier) prepare(dir, base string, keepDir bool) (int, error) {
	pfd, err := a.parent(dir)
	if err != nil {
		return -1, err
	}
	var fst unix.Stat_t
	err = unix.Fstatat(pfd, base, &fst, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return pfd, nil
	}
	if err != nil {
		return -1, err
	}
	isDir := fst.Mode&unix.S_IFMT == unix.S_IFDIR
	if isDir && keepDir {
		return pfd, nil
	}
	if err := removeAt(pfd, base, 0); err != nil {
		return -1, err
	}
	rel := path.Join(dir, base)
	delete(a.seen, rel)
	if isDir {
		for k := range a.dirTimes {
			if k == rel || strings.HasPrefix(k, rel+"/") {
				delete(a.dirTimes, k)
			}
		}
		for k := range a.seen {
			if strings.HasPrefix(k, rel+"/") {
				delete(a.seen, k)
			}
		}
	}
	return pfd, nil
}

// removeAt removes name (a whole tree when it is a directory) below the
// directory pfd without following symlinks.
func removeAt(pfd int, name string, depth int) error {
	err := unix.Unlinkat(pfd, name, 0)
	if err == nil || errors.Is(err, unix.ENOENT) {
		return nil
	}
	if !errors.Is(err, unix.EISDIR) {
		return err
	}
	if depth > 4096 {
		return fmt.Errorf("remove %s: %w", name, unix.ELOOP)
	}
	fd, err := unix.Openat(pfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), name)
	names, err := f.Readdirnames(-1)
	if err != nil {
		f.Close()
		return err
	}
	for _, n := range names {
		if err := removeAt(fd, n, depth+1); err != nil {
			f.Close()
			return err
		}
	}
	f.Close()
	return unix.Unlinkat(pfd, name, unix.AT_REMOVEDIR)
}
