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
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
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
	// loopMajor is the block major of loop devices.
	loopMajor = 7
)

// mkfsArgs are the options every golden image is formatted with (the
// journal size, -d with the initial tree and the image path are
// appended). -i and -I hold for every size (mke2fs.conf's "small" type
// would pick 128-byte inodes, whose timestamps end in 2038, and an inode
// per 4 KiB). No resize_inode: the descriptor blocks it reserves for
// growth are written, so an empty 4 GiB image holds 2.2 MiB of data with
// it and 0.2 MiB without (less to copy and flush per activation);
// growDisk's resize2fs makes room itself. lazy_itable_init and
// lazy_journal_init skip zeroing: mke2fs first discards (punches) the
// whole new file, so those blocks read as zeros already and it marks the
// inode tables zeroed (no ext4lazyinit work after mount, nothing
// allocated on the host). root_owner makes the root 0:0 whoever runs
// mkfs.
var mkfsArgs = []string{
	"-q", "-F", "-t", "ext4", "-m", "0", "-b", strconv.Itoa(diskBlockSize),
	"-i", "16384", "-I", "256", "-L", "space-layer", "-O", "^resize_inode",
	"-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0",
}

// diskLayoutVersion names the initial tree goldenImage puts in an image
// (upper/ 0755, work/ 0700, made by mkfs -d so a fresh disk needs no
// write at mount); part of the golden images' key.
const diskLayoutVersion = "upper0755,work0700"

// mkfsJournalArgs: a journal of size/64, at least 4 MiB (mke2fs's
// minimum) and at most 16 MiB: mke2fs would take 16 MiB from 128 MiB on,
// 64 MiB from 2 GiB and 128 MiB from 16 GiB, all of it out of the
// sandbox's quota. The journal is kept: without one, a host crash while
// the sandbox writes leaves a layer that needs a full fsck; 16 MiB is
// what mke2fs itself gives a 1 GiB file system.
func mkfsJournalArgs(size int64) []string {
	mb := min(max(size>>20/64, 4), 16)
	return []string{"-J", fmt.Sprintf("size=%d", mb)}
}

// e2fsDirs are searched for the e2fsprogs tools (mkfs.ext4; e2fsck and
// resize2fs for growDisk) after PATH: a PATH without /usr/sbin is common
// for services.
var e2fsDirs = []string{"/usr/sbin", "/sbin"}

// findE2fs finds an e2fsprogs tool, or says which package is missing.
func findE2fs(tool string) (string, error) {
	if p, err := exec.LookPath(tool); err == nil {
		return p, nil
	}
	for _, d := range e2fsDirs {
		if p, err := exec.LookPath(filepath.Join(d, tool)); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("ns: disk quota: %s not found (install the e2fsprogs package)", tool)
}

var (
	goldenMu   sync.Mutex
	mkfsKeys   = map[string]string{} // mkfs path -> key part (under goldenMu)
	goldenSeen = map[string]bool{}   // golden paths known to exist (under goldenMu)
)

// mkfsKey returns a short hash of what determines a golden image's
// content besides its size: mke2fs's version, our options and the
// mke2fs.conf it reads. Computed once per process and mkfs path.
func mkfsKey(mkfs string) (string, error) {
	if k, ok := mkfsKeys[mkfs]; ok {
		return k, nil
	}
	var stderr bytes.Buffer
	cmd := exec.Command(mkfs, "-V")
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("ns: disk quota: %s -V: %v: %s", mkfs, err, strings.TrimSpace(stderr.String()))
	}
	ver, _, _ := strings.Cut(stderr.String(), "\n")
	h := sha256.New()
	fmt.Fprintf(h, "%s\n%q\n%s\n", ver, mkfsArgs, diskLayoutVersion)
	conf := os.Getenv("MKE2FS_CONFIG")
	if conf == "" {
		conf = "/etc/mke2fs.conf"
	}
	if b, err := os.ReadFile(conf); err == nil {
		h.Write(b)
	}
	k := hex.EncodeToString(h.Sum(nil))[:12]
	mkfsKeys[mkfs] = k
	return k, nil
}

func checkDiskSize(size int64) error {
	if size < MinDiskSizeMB<<20 || size%(1<<20) != 0 {
		return fmt.Errorf("ns: disk size %d: must be a whole number of MiB, at least %d MiB", size, MinDiskSizeMB)
	}
	return nil
}

// goldenImage returns the cached, formatted image of size bytes under
// stateDir/disks, formatting it first if needed. Safe for concurrent use
// by several processes (the image is renamed into place when complete).
func goldenImage(stateDir string, size int64) (string, error) {
	goldenMu.Lock()
	defer goldenMu.Unlock()
	mkfs, err := findE2fs("mkfs.ext4")
	if err != nil {
		return "", err
	}
	key, err := mkfsKey(mkfs)
	if err != nil {
		return "", err
	}
	dir := filepath.Join(stateDir, "disks")
	golden := filepath.Join(dir, fmt.Sprintf("golden-ext4-%dM-%s.img", size>>20, key))
	if goldenSeen[golden] {
		return golden, nil
	}
	if fi, err := os.Stat(golden); err == nil && fi.Size() == size {
		goldenSeen[golden] = true
		return golden, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("ns: disk quota: %w", err)
	}
	tmp := fmt.Sprintf("%s.tmp-%d", golden, os.Getpid())
	_ = os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return "", fmt.Errorf("ns: disk quota: %w", err)
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = formatImage(mkfs, tmp, size)
	}
	if err == nil {
		err = syncPath(tmp)
	}
	if err == nil {
		err = os.Rename(tmp, golden)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return "", fmt.Errorf("ns: disk quota: format %d MiB image: %w", size>>20, err)
	}
	_ = syncPath(dir)
	goldenSeen[golden] = true
	return golden, nil
}

// formatImage runs mkfs on the empty file img, with upper/ and work/ in
// its root.
func formatImage(mkfs, img string, size int64) error {
	src, err := os.MkdirTemp(filepath.Dir(img), ".layout-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(src)
	if err := os.Chmod(src, 0o755); err != nil {
		return err
	}
	if err := os.Mkdir(filepath.Join(src, diskUpperDir), 0o755); err != nil {
		return err
	}
	if err := os.Mkdir(filepath.Join(src, diskWorkDir), 0o700); err != nil {
		return err
	}
	for _, p := range []string{src, filepath.Join(src, diskUpperDir), filepath.Join(src, diskWorkDir)} {
		if err := os.Chmod(p, map[bool]os.FileMode{true: 0o700, false: 0o755}[filepath.Base(p) == diskWorkDir]); err != nil {
			return err // umask-proof
		}
		if err := os.Lchown(p, 0, 0); err != nil {
			return err
		}
	}
	args := append(append(slices.Clone(mkfsArgs), mkfsJournalArgs(size)...), "-d", src, img)
	if out, err := exec.Command(mkfs, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %v: %s", mkfs, err, strings.TrimSpace(string(out)))
	}
	return nil
}

func syncPath(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// createDisk creates img, a new layer disk of size bytes (a whole number
// of MiB, at least MinDiskSizeMB): a sparse copy of the golden image of
// that size, formatted under stateDir/disks on first use. It fails with an
// error satisfying errors.Is(err, os.ErrExist) if img exists (an existing
// layer is never overwritten). The image is mode 0600; its directory
// should be the activation dir (0700, root's).
func createDisk(stateDir, img string, size int64) error {
	if err := checkDiskSize(size); err != nil {
		return err
	}
	golden, err := goldenImage(stateDir, size)
	if err != nil {
		return err
	}
	src, err := os.Open(golden)
	if err != nil {
		return fmt.Errorf("ns: disk quota: %w", err)
	}
	defer src.Close()
	tmp := img + ".tmp"
	_ = os.Remove(tmp)
	dst, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("ns: disk quota: %w", err)
	}
	err = sparseCopy(dst, src, size)
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		// link fails if img exists, where a rename would replace it.
		err = os.Link(tmp, img)
	}
	_ = os.Remove(tmp)
	if err != nil {
		return fmt.Errorf("ns: disk quota: create %s: %w", img, err)
	}
	return nil
}

// sparseCopy copies size bytes of src to the empty dst keeping holes:
// one FICLONE where the file system shares extents (btrfs, xfs), else
// copy_file_range of each data extent (SEEK_DATA/SEEK_HOLE).
// No fsync: the inner ext4's first journal commit flushes the loop
// device, which fsyncs the image; an image cut short by a host crash
// before that fails to mount, it is never half-trusted.
func sparseCopy(dst, src *os.File, size int64) error {
	if err := unix.IoctlFileClone(int(dst.Fd()), int(src.Fd())); err == nil {
		return nil
	}
	if err := dst.Truncate(size); err != nil {
		return err
	}
	sfd, dfd := int(src.Fd()), int(dst.Fd())
	var off int64
	for off < size {
		data, err := unix.Seek(sfd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole left
		}
		if err != nil {
			return fmt.Errorf("seek data: %w", err)
		}
		hole, err := unix.Seek(sfd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("seek hole: %w", err)
		}
		hole = min(hole, size)
		for in, out := data, data; in < hole; {
			n, err := unix.CopyFileRange(sfd, &in, dfd, &out, int(hole-in), 0)
			if errors.Is(err, unix.EXDEV) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EINVAL) {
				if err := copyRange(dst, src, in, hole-in); err != nil {
					return err
				}
				break
			}
			if err != nil {
				return fmt.Errorf("copy_file_range: %w", err)
			}
			if n == 0 {
				return io.ErrUnexpectedEOF
			}
		}
		off = hole
	}
	return nil
}

func copyRange(dst, src *os.File, off, n int64) error {
	_, err := io.Copy(io.NewOffsetWriter(dst, off), io.NewSectionReader(src, off, n))
	return err
}

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
	loop, dev, err := attachLoop(int(f.Fd()))
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
	loop, dev, err := attachLoop(int(f.Fd()))
	if err != nil {
		return nil, fmt.Errorf("ns: disk quota: attach %s: %w", img, err)
	}
	defer loop.Close() // the mount holds the device; autoclear after it
	mfd, err := fsmountExt4(loop.Name())
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

// fsmountExt4 mounts the ext4 on dev detached, with the flags and data
// mountDisk uses.
func fsmountExt4(dev string) (int, error) {
	fsfd, err := unix.Fsopen("ext4", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen: %w", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigSetString(fsfd, "source", dev); err != nil {
		return -1, fmt.Errorf("fsconfig source: %w", err)
	}
	for _, opt := range strings.Split(diskMountData, ",") {
		k, v, ok := strings.Cut(opt, "=")
		if ok {
			err = unix.FsconfigSetString(fsfd, k, v)
		} else {
			err = unix.FsconfigSetFlag(fsfd, k)
		}
		if err != nil {
			return -1, fmt.Errorf("fsconfig %s: %w", opt, err)
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return -1, fmt.Errorf("fsconfig create: %w", err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOATIME)
	if err != nil {
		return -1, fmt.Errorf("fsmount: %w", err)
	}
	return mfd, nil
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

// attachLoop binds the image open at fd to a free loop device
// (LOOP_CTL_GET_FREE + LOOP_CONFIGURE) and returns the device, open, and
// its number. Another process may configure the same free device between
// the two calls (EBUSY): then it asks for another one.
func attachLoop(fd int) (*os.File, uint64, error) {
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, 0, fmt.Errorf("loop driver: %w", err)
	}
	defer ctl.Close()
	cfg := unix.LoopConfig{Fd: uint32(fd), Size: diskBlockSize}
	cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR | unix.LO_FLAGS_DIRECT_IO
	var lastErr error
	for attempt := 0; attempt < 64; attempt++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, 0, fmt.Errorf("LOOP_CTL_GET_FREE: %w", err)
		}
		loop, err := openLoop(n)
		if errors.Is(err, unix.ENXIO) || errors.Is(err, os.ErrNotExist) {
			lastErr = err // removed meanwhile (LOOP_CTL_REMOVE)
			continue
		}
		if err != nil {
			return nil, 0, err
		}
		err = unix.IoctlLoopConfigure(int(loop.Fd()), &cfg)
		if err == unix.EINVAL && cfg.Info.Flags&unix.LO_FLAGS_DIRECT_IO != 0 {
			// The backing file system cannot do direct I/O here.
			cfg.Info.Flags &^= unix.LO_FLAGS_DIRECT_IO
			err = unix.IoctlLoopConfigure(int(loop.Fd()), &cfg)
		}
		if err == nil {
			var st unix.Stat_t
			if err := unix.Fstat(int(loop.Fd()), &st); err != nil {
				loop.Close()
				return nil, 0, err
			}
			return loop, st.Rdev, nil
		}
		loop.Close()
		if err != unix.EBUSY {
			return nil, 0, fmt.Errorf("LOOP_CONFIGURE %s: %w", loop.Name(), err)
		}
		lastErr = err
		if attempt >= 8 {
			time.Sleep(time.Millisecond)
		}
	}
	return nil, 0, fmt.Errorf("no free loop device: %w", lastErr)
}

// openLoop opens /dev/loop<n>, making the node if /dev lacks it (a /dev
// that is not a devtmpfs).
func openLoop(n int) (*os.File, error) {
	name := fmt.Sprintf("/dev/loop%d", n)
	f, err := os.OpenFile(name, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err == nil || !errors.Is(err, os.ErrNotExist) {
		return f, err
	}
	b, rerr := os.ReadFile(fmt.Sprintf("/sys/block/loop%d/dev", n))
	if rerr != nil {
		return nil, err
	}
	maj, mnr, ok := strings.Cut(strings.TrimSpace(string(b)), ":")
	ma, _ := strconv.ParseUint(maj, 10, 32)
	mi, _ := strconv.ParseUint(mnr, 10, 32)
	if !ok || ma != loopMajor {
		return nil, err
	}
	if merr := unix.Mknod(name, unix.S_IFBLK|0o600, int(unix.Mkdev(uint32(ma), uint32(mi)))); merr != nil && merr != unix.EEXIST {
		return nil, fmt.Errorf("mknod %s: %w", name, merr)
	}
	return os.OpenFile(name, os.O_RDWR|unix.O_CLOEXEC, 0)
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

// growDisk raises the size of the unmounted disk img to size bytes
// (a template's quota grew): e2fsck -fp (resize2fs wants a checked file
// system), then the image grows (sparse) and resize2fs -f grows the file
// system into it. A disk is never shrunk: a smaller size is an error; the
// same size is a no-op. Rare, so it runs the tools (tens of ms) instead
// of resizing online (EXT4_IOC_RESIZE_FS, which needs CAP_SYS_RESOURCE).
// resize2fs refuses an image that is mounted (it checks loop devices).
func growDisk(img string, size int64) error {
	if err := checkDiskSize(size); err != nil {
		return err
	}
	fi, err := os.Stat(img)
	if err != nil {
		return fmt.Errorf("ns: disk quota: grow: %w", err)
	}
	switch {
	case !fi.Mode().IsRegular():
		return fmt.Errorf("ns: disk quota: grow: %s is not a layer disk image", img)
	case size < fi.Size():
		return fmt.Errorf("ns: disk quota: grow %s: %d MiB is smaller than its %d MiB", img, size>>20, fi.Size()>>20)
	case size == fi.Size():
		return nil
	}
	fsck, err := findE2fs("e2fsck")
	if err != nil {
		return err
	}
	resize, err := findE2fs("resize2fs")
	if err != nil {
		return err
	}
	// e2fsck exit status 1: errors corrected; anything above is a failure.
	out, err := exec.Command(fsck, "-f", "-p", img).CombinedOutput()
	var ee *exec.ExitError
	if err != nil && !(errors.As(err, &ee) && ee.ExitCode() == 1) {
		return fmt.Errorf("ns: disk quota: grow: %s: %v: %s", fsck, err, strings.TrimSpace(string(out)))
	}
	if err := os.Truncate(img, size); err != nil {
		return fmt.Errorf("ns: disk quota: grow: %w", err)
	}
	// On failure the file stays large: harmless, the file system inside
	// keeps its old size and a later growDisk tries again.
	if out, err := exec.Command(resize, "-f", img, fmt.Sprintf("%dM", size>>20)).CombinedOutput(); err != nil {
		return fmt.Errorf("ns: disk quota: grow: %s: %v: %s", resize, err, strings.TrimSpace(string(out)))
	}
	return nil
}
