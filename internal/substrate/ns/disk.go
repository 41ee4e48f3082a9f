//go:build linux

package ns

// Layer disks: the per-activation disk quota (issue 11).
//
// A sandbox's writable layer lives on a disk of its own: a sparse ext4
// image file of exactly the quota's size (DiskImageName in the activation
// dir), attached to a loop device and mounted on the host (nosuid, nodev,
// noatime) at a directory (DiskMountName in the activation dir). Inside the
// mounted file system mountDisk keeps two directories, upper/ and work/:
// overlayfs needs its upperdir and workdir on the same file system, so both
// are on the disk and the overlay's writable layer is bounded by it.
//
//	createDisk(stateDir, img, size)  once per writable layer (the next
//	                                 activation on the same Dir reuses img)
//	d, err := mountDisk(img, dir)    before the overlay is mounted
//	d.Upper(), d.Work()              upperdir and workdir for the overlay
//	d.Unmount()                      after the sandbox is gone (idempotent)
//	growDisk(img, size)              the quota grew (unmounted; never
//	                                 shrinks)
//	unmountDisk(dir)                 crash recovery: a mount left by a
//	                                 previous process
//
// What the quota guarantees: a sandbox that writes past it gets ENOSPC
// inside (from the inner ext4's block allocator), and
// the host file system holding the image loses at most the image's size
// (plus its extent tree: a few MiB at worst) however the sandbox writes,
// because the image file never grows past its size. The space usable
// inside is a little smaller than the quota: the journal (4-16 MiB),
// inode tables and bitmaps live in it, no blocks are reserved for root
// (-m 0); measured: 1984 MiB usable of 2 GiB, 119 MiB of 128 MiB.
//
// The image is sparse: an empty 2 GiB layer costs about 0.2 MiB on the host,
// and the inner file system is mounted with discard, so files deleted in
// the sandbox punch holes in the image and give their space back to the
// host. Sparse images overcommit: if the host file system fills up before
// a sandbox reaches its quota, its writes fail with EIO inside and the
// inner ext4 goes read-only (errors=remount-ro) - the host's free space
// must be watched (or the images preallocated, which this code does not do).
//
// Formatting costs ~20 ms (mkfs.ext4), too much for the create path, so one
// golden image per size is formatted once and cached under
// stateDir/disks/, keyed by the size, the mke2fs version, its options and
// mke2fs.conf; each activation gets a sparse copy of it (FICLONE where the
// host file system can share extents, else SEEK_DATA/SEEK_HOLE plus
// copy_file_range of the 0.1-0.2 MiB of data). The copies share the golden
// image's UUID and directory hash seed; the kernel does not care, and a
// sandbox learns nothing from them it could use outside its own disk.
//
// Security: the sandbox sees only the files of the mounted file system,
// through the overlay; the image file, the loop device and the host mount
// point stay outside its root (pivot_root detaches the host tree, /dev has
// no block devices and every mount it can reach is nodev). The kernel's
// ext4 parser is not hardened against hostile images, so only images this
// file formatted (and that since then only the kernel wrote, through the
// loop device) are ever mounted: never mount an image that came from a
// sandbox, a snapshot archive or another host - restore such a layer by
// copying its files into a fresh image.
//
// Mount namespaces: the mount exists in the caller's mount namespace and
// in those cloned from it afterwards (the host's / is usually private, so
// nothing propagates). An init whose namespace was cloned before the disk
// was mounted (a warm init, warm.go) does not see it at dir, and
// overlayfs refuses layers reached through /proc/<host pid>/root (it
// clones the upper mount, which must be in its own namespace: "failed to
// clone upperpath"). Two ways that work (both tried here):
//
//   - a detached mount: open_tree(d.Dir(), OPEN_TREE_CLONE), idmapped
//     with mount_setattr for a user-namespaced init (userns.go), sent to
//     the init, which move_mounts it and takes upper/ and work/ from it
//     (TestDiskIdmappedClone). open_tree of the activation dir without
//     AT_RECURSIVE does not carry the disk mounted under it: clone the
//     disk's own mount;
//   - without a user namespace, the init mounts Device() itself (ext4,
//     the same flags and data): a block device mounted twice is one
//     superblock, so the host and the sandbox see the same files. An init
//     in a user namespace cannot (ext4 is not mountable there).
//
// Either way the loop device stays attached until the host's mount and
// the sandbox's are all gone (autoclear), so Unmount at Stop while a
// sandbox namespace still holds the disk is safe.
//
// Host requirements: root, the loop driver (/dev/loop-control) and
// mkfs.ext4 (Debian package e2fsprogs) for the golden images.

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/loopdev"
)

// Names in an activation dir and defaults for the layer disk.
const (
	// DiskImageName is the layer disk's image file in the activation dir.
	DiskImageName = "layer.img"
	// DiskMountName is where the disk is mounted in the activation dir;
	// the overlay's upper and work dirs are DiskMountName/upper and
	// DiskMountName/work.
	DiskMountName = "layer"

	diskUpperDir  = "upper"
	diskWorkDir   = "work"
	diskBlockSize = 4096
	// diskMountData: remount read-only on an I/O error (the host file
	// system full under a sparse image) rather than go on; discard gives
	// deleted blocks back to the host (the loop driver punches holes).
	diskMountData  = "errors=remount-ro,discard"
	diskMountFlags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOATIME
)

// layerDisk is a mounted layer disk. Its methods are not safe for
// concurrent use.
type layerDisk struct {
	img string
	dir string
	// mfd is the detached mount's descriptor (openDisk), -1 for a disk
	// mounted at a directory (mountDisk); dir is then /proc/self/fd/<mfd>.
	mfd  int
	loop string // /dev/loopN
	dev  uint64 // the loop device's number = st_dev of files on the disk
	// gone is set once Unmount has unmounted dir (or found it gone).
	gone bool
	// sharedBind: dir is a shared bind of itself under the disk
	// (layerClone's fallback), unmounted after the disk.
	sharedBind bool
}

// Dir is the mount point; Upper and Work are the overlay's upperdir and
// workdir on the disk.
func (d *layerDisk) Dir() string   { return d.dir }
func (d *layerDisk) Upper() string { return filepath.Join(d.dir, diskUpperDir) }
func (d *layerDisk) Work() string  { return filepath.Join(d.dir, diskWorkDir) }

// Device is the loop block device the disk is attached to (for an init
// that mounts it in its own namespace; see the mount namespaces note).
func (d *layerDisk) Device() string { return d.loop }

// mountDisk attaches img (made by createDisk) to a free loop device and
// mounts it at dir (created 0700 if missing; it must not be a mount point
// already), then makes sure the disk's root is 0:0 0755 and holds upper/
// (0755) and work/ (0700). lost+found stays at the disk's root: e2fsck
// puts what it recovers there, and the sandbox never sees the root, only
// upper/ through the overlay.
//
// The loop device is set up with LO_FLAGS_AUTOCLEAR and not held open:
// the kernel detaches it as soon as the last mount of the file system is
// gone (the host's, and copies in mount namespaces cloned meanwhile), so
// no error path or crash of this process leaks a loop device. Direct I/O
// keeps the image's pages out of the host page cache (the inner file
// system caches them already); a host file system that cannot do direct
// I/O gets buffered I/O.
func mountDisk(img, dir string) (*layerDisk, error) {
	f, err := openImage(img)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("ns: disk quota: %w", err)
	}
	if mounted, err := isMountPoint(dir); err != nil {
		return nil, fmt.Errorf("ns: disk quota: %w", err)
	} else if mounted {
		return nil, fmt.Errorf("ns: disk quota: %s is already a mount point", dir)
	}
	loop, dev, err := loopdev.Attach(int(f.Fd()), diskBlockSize)
	if err != nil {
		return nil, fmt.Errorf("ns: disk quota: attach %s: %w", img, err)
	}
	// Closing loop (below, after the mount holds the device, or on error)
	// is what lets autoclear detach it.
	defer loop.Close()
	if err := unix.Mount(loop.Name(), dir, "ext4", diskMountFlags, diskMountData); err != nil {
		return nil, fmt.Errorf("ns: disk quota: mount %s (%s) on %s: %w", img, loop.Name(), dir, err)
	}
	d := &layerDisk{img: img, dir: dir, loop: loop.Name(), dev: dev, mfd: -1}
	if err := d.prepare(); err != nil {
		_ = d.Unmount()
		return nil, fmt.Errorf("ns: disk quota: %w", err)
	}
	return d, nil
}

// openImage opens img, a layer disk image, for the loop device.
func openImage(img string) (*os.File, error) {
	f, err := os.OpenFile(img, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("ns: disk quota: %w", err)
	}
	fi, err := f.Stat()
	if err == nil && (!fi.Mode().IsRegular() || checkDiskSize(fi.Size()) != nil) {
		err = fmt.Errorf("%s is not a layer disk image", img)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("ns: disk quota: %w", err)
	}
	return f, nil
}

// openDisk is mountDisk without a mount point: the file system is mounted
// detached (fsopen, fsmount) and belongs to no mount namespace, so no
// namespace cloned later (a warm init's, another worker's) holds a copy
// that would keep it alive after Unmount; its files are reached through
// Dir() (/proc/self/fd/<fd>, in this process) and an init gets a clone of
// the mount (Clone).
func openDisk(img string) (*layerDisk, error) {
	f, err := openImage(img)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	loop, dev, err := loopdev.Attach(int(f.Fd()), diskBlockSize)
	if err != nil {
		return nil, fmt.Errorf("ns: disk quota: attach %s: %w", img, err)
	}
	defer loop.Close() // the mount holds the device; autoclear after it
	mfd, err := loopdev.MountExt4(loop.Name(), diskMountData)
	if err != nil {
		return nil, fmt.Errorf("ns: disk quota: mount %s (%s): %w", img, loop.Name(), err)
	}
	// The trailing slash makes lstat of Dir() follow the magic link.
	d := &layerDisk{img: img, dir: fmt.Sprintf("/proc/self/fd/%d/", mfd), loop: loop.Name(), dev: dev, mfd: mfd}
	if err := d.prepare(); err != nil {
		_ = d.Unmount()
		return nil, fmt.Errorf("ns: disk quota: %w", err)
	}
	return d, nil
}

// Clone returns a detached copy of the disk's mount with attrs set and,
// unless usernsFD is -1, that user namespace's idmapping.
func (d *layerDisk) Clone(usernsFD int, attrs uint64) (int, error) {
	if d.mfd < 0 {
		return idmapClone(d.dir, usernsFD, attrs)
	}
	return idmapCloneFD(d.mfd, usernsFD, attrs)
}

// prepare fixes the disk root's owner and mode and creates upper/ and
// work/ (no-ops when the disk was used before).
func (d *layerDisk) prepare() error {
	var st unix.Stat_t
	if err := unix.Lstat(d.dir, &st); err != nil {
		return err
	}
	if st.Dev != d.dev {
		return fmt.Errorf("%s is not on %s after the mount", d.dir, d.Device())
	}
	if st.Uid != 0 || st.Gid != 0 {
		if err := unix.Lchown(d.dir, 0, 0); err != nil {
			return err
		}
	}
	if st.Mode&0o7777 != 0o755 {
		if err := unix.Chmod(d.dir, 0o755); err != nil {
			return err
		}
	}
	for _, sub := range []struct {
		name string
		mode uint32
	}{{diskUpperDir, 0o755}, {diskWorkDir, 0o700}} {
		p := filepath.Join(d.dir, sub.name)
		if err := unix.Mkdir(p, sub.mode); err != nil && err != unix.EEXIST {
			return err
		}
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			return fmt.Errorf("%s is not a directory", p)
		}
	}
	return nil
}

// isMountPoint reports whether dir is a mount point (its device differs
// from its parent's, or it is the root of a bind mount of the same file
// system, which /proc/self/mountinfo tells).
func isMountPoint(dir string) (bool, error) {
	// statx says it directly (Linux 5.8), without reading mountinfo,
	// whose length grows with every sandbox's mount.
	var sx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, dir, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &sx); err == nil &&
		sx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 {
		return sx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, nil
	}
	var st, pst unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return false, err
	}
	if err := unix.Lstat(filepath.Dir(filepath.Clean(dir)), &pst); err != nil {
		return false, err
	}
	if st.Dev != pst.Dev {
		return true, nil
	}
	return mountInfoHas(filepath.Clean(dir))
}

func mountInfoHas(dir string) (bool, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return false, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && unescapeMount(fields[4]) == dir {
			return true, nil
		}
	}
	return false, sc.Err()
}

// Unmount unmounts the disk; the loop device detaches itself once no
// mount of the file system is left (autoclear). If the mount is busy (an
// open file, a process's cwd) it is detached lazily: gone from dir now,
// released when the last user lets go. Calling it again, or after
// somebody else unmounted dir, returns nil; dir itself is left in place.
func (d *layerDisk) Unmount() error {
	if d.gone {
		return nil
	}
	if d.mfd >= 0 {
		// The last reference: the file system ends once the clones given
		// to inits are gone too (their namespaces die with them).
		err := unix.Close(d.mfd)
		d.mfd, d.gone = -1, true
		if err != nil {
			return fmt.Errorf("ns: disk quota: unmount %s: %w", d.img, err)
		}
		return nil
	}
	var st unix.Stat_t
	if err := unix.Lstat(d.dir, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			d.gone = true
			return nil
		}
		return fmt.Errorf("ns: disk quota: unmount %s: %w", d.dir, err)
	}
	if st.Dev != d.dev {
		d.gone = true // not our disk at dir any more
		return nil
	}
	if err := unmountDisk(d.dir); err != nil {
		return err
	}
	if d.sharedBind {
		// The bind the disk was attached on (layerClone's fallback).
		if err := unmountDisk(d.dir); err != nil {
			return err
		}
	}
	d.gone = true
	return nil
}

// unmountDisk unmounts whatever is mounted at dir (lazily if busy); nil if
// nothing is. For recovery: a disk mounted by a previous process, known
// only by its mount point.
func unmountDisk(dir string) error {
	err := unix.Unmount(dir, unix.UMOUNT_NOFOLLOW)
	if err == unix.EBUSY {
		err = unix.Unmount(dir, unix.UMOUNT_NOFOLLOW|unix.MNT_DETACH)
	}
	if err == nil || err == unix.EINVAL || err == unix.ENOENT {
		return nil // EINVAL: not a mount point
	}
	return fmt.Errorf("ns: disk quota: unmount %s: %w", dir, err)
}
