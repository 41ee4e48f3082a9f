//go:build linux

// AddFromUpper: an overlay upper dir (a build sandbox's writable layer)
// copied into layer form. The upper's content was written by the sandbox,
// so it is walked with descriptors only (O_NOFOLLOW on every open, no
// path the sandbox could redirect).

package layerstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// maxUpperDepth bounds the walk's recursion.
const maxUpperDepth = 1024

// AddFromUpper publishes the overlay upper dir upper as layer id in layer
// form: whiteouts (0:0 character devices) are kept, a directory opaque in
// either overlay namespace (trusted.* or user.*, with or without
// userxattr) is marked opaque in both, overlay's other markers are
// dropped, hard links within upper stay hard links, owners, modes, times
// and the kept xattrs (see ApplyTar) are copied. Other device nodes and
// sockets are skipped. An upper holding what cannot be expressed as a
// layer without its lower layers (a redirected directory, a metacopy
// file: redirect_dir or metacopy was on) is refused with ErrInvalid. The
// upper must not change while it is copied (its sandbox is stopped or
// frozen).
func (s *Store) AddFromUpper(ctx context.Context, id, upper string) (string, error) {
	return s.Add(ctx, id, func(dir string) error {
		src, err := unix.Open(upper, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open upper: %w", err)
		}
		defer unix.Close(src)
		dst, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(dst)
		c := &upperCopier{ctx: ctx, dstRoot: dst, links: map[[2]uint64]string{}}
		if err := c.dir(src, dst, "", 0); err != nil {
			return err
		}
		var fst unix.Stat_t
		if err := unix.Fstat(src, &fst); err != nil {
			return err
		}
		return c.attrs(src, dst, &fst, true)
	})
}

type upperCopier struct {
	ctx     context.Context
	dstRoot int
	// links: (dev, inode) of a multiply linked file -> its first copy's
	// path in the layer.
	links map[[2]uint64]string
}

func (c *upperCopier) dir(src, dst int, rel string, depth int) error {
	if depth > maxUpperDepth {
		return fmt.Errorf("upper %s: %w: deeper than %d levels", rel, errdefs.ErrInvalid, maxUpperDepth)
	}
	if err := c.ctx.Err(); err != nil {
		return err
	}
	d, err := unix.FcntlInt(uintptr(src), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(d), rel)
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return fmt.Errorf("read upper %s: %w", rel, err)
	}
	slices.Sort(names)
	for _, n := range names {
		if err := c.entry(src, dst, rel, n, depth); err != nil {
			return err
		}
	}
	return nil
}

func (c *upperCopier) entry(src, dst int, rel, name string, depth int) error {
	p := name
	if rel != "" {
		p = rel + "/" + name
	}
	var fst unix.Stat_t
	if err := unix.Fstatat(src, name, &fst, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("upper %s: %w", p, err)
	}
	switch fst.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		sfd, err := unix.Openat(src, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("upper %s: %w", p, err)
		}
		defer unix.Close(sfd)
		if err := unix.Mkdirat(dst, name, 0o700); err != nil {
			return err
		}
		dfd, err := unix.Openat(dst, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(dfd)
		if err := c.dir(sfd, dfd, p, depth+1); err != nil {
			return err
		}
		return c.attrs(sfd, dfd, &fst, true)
	case unix.S_IFREG:
		if fst.Nlink > 1 {
			key := [2]uint64{fst.Dev, fst.Ino}
			if first, ok := c.links[key]; ok {
				return c.link(first, dst, name)
			}
			c.links[key] = p
		}
		sfd, err := unix.Openat(src, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
		if err != nil {
			return fmt.Errorf("upper %s: %w", p, err)
		}
		sf := os.NewFile(uintptr(sfd), p)
		defer sf.Close()
		var st2 unix.Stat_t
		if err := unix.Fstat(sfd, &st2); err != nil || st2.Ino != fst.Ino || st2.Mode&unix.S_IFMT != unix.S_IFREG {
			return fmt.Errorf("upper %s: %w: changed while copied", p, errdefs.ErrConflict)
		}
		if metacopy(sfd) {
			return fmt.Errorf("upper %s: %w: overlay metacopy file (mount the build overlay with metacopy=off)", p, errdefs.ErrInvalid)
		}
		dfd, err := unix.Openat(dst, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		df := os.NewFile(uintptr(dfd), name)
		defer df.Close()
		if _, err := io.Copy(df, sf); err != nil {
			return fmt.Errorf("copy %s: %w", p, err)
		}
		if err := c.attrs(sfd, dfd, &fst, false); err != nil {
			return err
		}
		return df.Close()
	case unix.S_IFLNK:
		buf := make([]byte, unix.PathMax)
		n, err := unix.Readlinkat(src, name, buf)
		if err != nil {
			return fmt.Errorf("upper %s: %w", p, err)
		}
		if err := unix.Symlinkat(string(buf[:n]), dst, name); err != nil {
			return err
		}
		if err := unix.Fchownat(dst, name, int(fst.Uid), int(fst.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		return unix.UtimesNanoAt(dst, name, []unix.Timespec{fst.Atim, fst.Mtim}, unix.AT_SYMLINK_NOFOLLOW)
	case unix.S_IFCHR:
		if fst.Rdev != 0 {
			return nil // a device node, never part of a layer
		}
		if err := unix.Mknodat(dst, name, unix.S_IFCHR, 0); err != nil {
			return err
		}
		return unix.Fchownat(dst, name, 0, 0, unix.AT_SYMLINK_NOFOLLOW)
	case unix.S_IFIFO:
		if err := unix.Mknodat(dst, name, unix.S_IFIFO|0o600, 0); err != nil {
			return err
		}
		if err := unix.Fchownat(dst, name, int(fst.Uid), int(fst.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		if err := unix.Fchmodat(dst, name, fst.Mode&0o7777, 0); err != nil {
			return err
		}
		return unix.UtimesNanoAt(dst, name, []unix.Timespec{fst.Atim, fst.Mtim}, unix.AT_SYMLINK_NOFOLLOW)
	}
	return nil // block devices, sockets
}

// link makes name in dst a hard link of the layer's file at first (a
// path inside the fresh layer, made of directories this copy created).
func (c *upperCopier) link(first string, dst int, name string) error {
	i := strings.LastIndexByte(first, '/')
	dir, base := ".", first
	if i >= 0 {
		dir, base = first[:i], first[i+1:]
	}
	pfd, err := unix.Openat2(c.dstRoot, dir, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS})
	if err != nil {
		return fmt.Errorf("hard link %s: %w", first, err)
	}
	defer unix.Close(pfd)
	return unix.Linkat(pfd, base, dst, name, 0)
}

func metacopy(fd int) bool {
	for _, k := range []string{"trusted.overlay.metacopy", "user.overlay.metacopy"} {
		if _, err := unix.Fgetxattr(fd, k, nil); err == nil {
			return true
		}
	}
	return false
}

// attrs copies owner, mode, kept xattrs and times from src to dst (both
// open descriptors of a regular file or directory); a directory opaque in
// either namespace becomes opaque in both; a redirected one is refused.
func (c *upperCopier) attrs(src, dst int, fst *unix.Stat_t, isDir bool) error {
	if err := unix.Fchown(dst, int(fst.Uid), int(fst.Gid)); err != nil {
		return err
	}
	if err := unix.Fchmod(dst, fst.Mode&0o7777); err != nil {
		return err
	}
	names, err := listXattrs(src)
	if err != nil {
		return err
	}
	opaque := false
	for _, k := range names {
		v, err := getXattr(src, k)
		if errors.Is(err, unix.ENODATA) {
			continue
		}
		if err != nil {
			return fmt.Errorf("get xattr %s: %w", k, err)
		}
		switch k {
		case opaqueTrusted, opaqueUser:
			opaque = opaque || (isDir && string(v) == "y")
			continue
		case "trusted.overlay.redirect", "user.overlay.redirect":
			return fmt.Errorf("%w: overlay redirected directory (mount the build overlay with redirect_dir=off)", errdefs.ErrInvalid)
		}
		kv, ok := filterXattr(k, v)
		if !ok {
			continue
		}
		if err := unix.Fsetxattr(dst, k, kv, 0); err != nil {
			return fmt.Errorf("set xattr %s: %w", k, err)
		}
	}
	if opaque {
		for _, k := range []string{opaqueTrusted, opaqueUser} {
			if err := unix.Fsetxattr(dst, k, []byte("y"), 0); err != nil {
				return fmt.Errorf("set %s: %w", k, err)
			}
		}
	}
	return unix.UtimesNanoAt(dst, "", []unix.Timespec{fst.Atim, fst.Mtim}, unix.AT_EMPTY_PATH)
}

func listXattrs(fd int) ([]string, error) {
	for {
		n, err := unix.Flistxattr(fd, nil)
		if err != nil {
			if errors.Is(err, unix.EOPNOTSUPP) {
				return nil, nil
			}
			return nil, err
		}
		if n == 0 {
			return nil, nil
		}
		buf := make([]byte, n)
		n, err = unix.Flistxattr(fd, buf)
		if errors.Is(err, unix.ERANGE) {
			continue // grew meanwhile
		}
		if err != nil {
			return nil, err
		}
		var out []string
		for _, b := range bytes.Split(buf[:n], []byte{0}) {
			if len(b) > 0 {
				out = append(out, string(b))
			}
		}
		return out, nil
	}
}

func getXattr(fd int, name string) ([]byte, error) {
	for {
		n, err := unix.Fgetxattr(fd, name, nil)
		if err != nil {
			return nil, err
		}
		buf := make([]byte, n)
		n, err = unix.Fgetxattr(fd, name, buf)
		if errors.Is(err, unix.ERANGE) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}
