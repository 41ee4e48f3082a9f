//go:build linux

package ns

// Volumes (Spec.Volumes): each Source (a host directory on the volume's
// own file system, internal/volume) reaches the init as a detached clone
// of that directory, nosuid and nodev, idmapped to the sandbox's user
// namespace when it has one (disk id N reads as N inside, as the writable
// layer), read-only when asked. The init attaches each at its Path in the
// new root after the rootfs is built and before pivot_root. The mount
// point is reached one component at a time with openat2
// (RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_XDEV): a symlink in the
// image, "..", or another mount on the way (/proc, /dev, /usr, another
// volume) is refused, so a volume never lands outside the rootfs's own
// tree whatever the image holds; missing directories are made (0755,
// root's).

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/volume"
)

// validateVolumes checks spec's volumes: paths (volume.ValidatePaths) and
// sources (absolute).
func validateVolumes(vols []substrate.VolumeMount) error {
	paths := make([]string, len(vols))
	for i, v := range vols {
		if !filepath.IsAbs(v.Source) {
			return fmt.Errorf("ns: volume %q: source must be an absolute path", v.Name)
		}
		paths[i] = v.Path
	}
	if err := volume.ValidatePaths(paths); err != nil {
		return fmt.Errorf("ns: %w", err)
	}
	return nil
}

// volumeFiles returns a detached clone of each volume's Source for the
// init (pid): idmapped to its user namespace when userns.
func volumeFiles(pid int, userns bool, vols []substrate.VolumeMount) (fds []int, err error) {
	uns := -1
	if userns {
		if uns, err = unix.Open(fmt.Sprintf("/proc/%d/ns/user", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
			return nil, fmt.Errorf("ns: user namespace of init %d: %w", pid, err)
		}
		defer unix.Close(uns)
	}
	for _, v := range vols {
		attrs := uint64(unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV)
		if v.ReadOnly {
			attrs |= unix.MOUNT_ATTR_RDONLY
		}
		fd, err := idmapClone(v.Source, uns, attrs)
		if err != nil {
			closeFDs(fds)
			return nil, fmt.Errorf("ns: volume %q: %w", v.Name, err)
		}
		fds = append(fds, fd)
	}
	return fds, nil
}

func volumePaths(vols []substrate.VolumeMount) []string {
	out := make([]string, len(vols))
	for i, v := range vols {
		out[i] = v.Path
	}
	return out
}

// mountVolumes (in the init) attaches the detached mount fds[i] at
// paths[i] under root.
func mountVolumes(root string, paths []string, fds []int) error {
	if len(paths) != len(fds) {
		return fmt.Errorf("%d volume paths for %d volume descriptors", len(paths), len(fds))
	}
	if len(paths) == 0 {
		return nil
	}
	if err := volume.ValidatePaths(paths); err != nil {
		return err
	}
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open the new root: %w", err)
	}
	defer unix.Close(rfd)
	for i, p := range paths {
		t, err := volumeMountPoint(rfd, p)
		if err != nil {
			return err
		}
		err = unix.MoveMount(fds[i], "", t, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH)
		unix.Close(t)
		if err != nil {
			return fmt.Errorf("volume at %s: attach: %w", p, err)
		}
		unix.Close(fds[i])
	}
	return nil
}

// volumeMountPoint opens (O_PATH) the directory p under the root open at
// rfd, making missing components, refusing symlinks and mount crossings.
func volumeMountPoint(rfd int, p string) (int, error) {
	cur, err := unix.Dup(rfd)
	if err != nil {
		return -1, err
	}
	how := unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	}
	for _, c := range strings.Split(strings.TrimPrefix(p, "/"), "/") {
		next, err := unix.Openat2(cur, c, &how)
		if errors.Is(err, unix.ENOENT) {
			if merr := unix.Mkdirat(cur, c, 0o755); merr != nil && merr != unix.EEXIST {
				unix.Close(cur)
				return -1, fmt.Errorf("volume at %s: mkdir %s: %w", p, c, merr)
			}
			next, err = unix.Openat2(cur, c, &how)
		}
		unix.Close(cur)
		switch {
		case errors.Is(err, unix.ELOOP), errors.Is(err, unix.ENOTDIR):
			return -1, fmt.Errorf("volume at %s: %s is not a directory in the sandbox's root (a symlink or a file)", p, c)
		case errors.Is(err, unix.EXDEV):
			return -1, fmt.Errorf("volume at %s: %s is another mount (volumes go on the root file system only)", p, c)
		case err != nil:
			return -1, fmt.Errorf("volume at %s: open %s: %w", p, c, err)
		}
		cur = next
	}
	return cur, nil
}
