//go:build linux

package ns

// Writable layers. Every activation directory holds its writable layer as
// upper/ (and the overlay's work dir beside it, work/) at the root of its
// layer: with the disk quota (disk.go) the root of the activation's layer
// disk, mounted detached (no mount namespace has it, so no namespace
// cloned meanwhile keeps it alive) while an instance runs or a caller
// (PrepareLayer: snapshots, restores) needs the files, and reached in this
// process through /proc/self/fd; without the quota, the plain directory
// DiskMountName. The disk is mounted once per activation directory
// however many hold it (the instance, a snapshot of it taken while
// paused): two mounts of one image would be two file systems writing the
// same blocks.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/loopdev"
	"github.com/spacesbx/space/internal/substrate"
)

// layerRef is a layer held by refs holders.
type layerRef struct {
	disk *layerDisk // nil without the quota
	refs int
}

// root is the layer's root in this process: upper/ and work/ are in it.
func (r *layerRef) root(dir string) string {
	if r.disk != nil {
		return r.disk.Dir()
	}
	return filepath.Join(dir, DiskMountName)
}

// diskQuotaUnsupported says why layer disks cannot be used here, or "".
func diskQuotaUnsupported() string {
	if _, err := findE2fs("mkfs.ext4"); err != nil {
		return err.Error()
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		return "no /dev/loop-control (loop devices): " + err.Error()
	}
	return ""
}

// diskSize rounds a quota up to whole MiB, at least MinDiskSizeMB.
func diskSize(b int64) int64 {
	if b < MinDiskSizeMB<<20 {
		b = MinDiskSizeMB << 20
	}
	return (b + 1<<20 - 1) &^ (1<<20 - 1)
}

// acquireLayer makes the writable layer of activation directory dir
// available at dir/DiskMountName (creating dir, and the disk of size
// bytes, when missing) and returns its release. A disk that exists with
// a smaller size is grown when nobody holds it.
func (s *Substrate) acquireLayer(dir string, size int64) (release func() error, err error) {
	s.layerMu.Lock()
	defer s.layerMu.Unlock()
	if ref := s.layers[dir]; ref != nil {
		ref.refs++
		return s.releaser(dir), nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("ns: activation dir: %w", err)
	}
	mnt := filepath.Join(dir, DiskMountName)
	ref := &layerRef{refs: 1}
	if !s.quota {
		for _, d := range []string{mnt, filepath.Join(mnt, diskUpperDir), filepath.Join(mnt, diskWorkDir)} {
			if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
				return nil, fmt.Errorf("ns: writable layer: %w", err)
			}
		}
		s.layers[dir] = ref
		return s.releaser(dir), nil
	}
	img := filepath.Join(dir, DiskImageName)
	size = diskSize(size)
	// The directory stays empty on the host: an init without a user
	// namespace attaches its clone of the disk there in its own namespace.
	if err := os.Mkdir(mnt, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("ns: disk quota: %w", err)
	}
	switch fi, err := os.Stat(img); {
	case errors.Is(err, os.ErrNotExist):
		// A new layer: the disk made ahead of time (spare.go), or one now.
		if ref.disk = s.takeSpare(dir, size); ref.disk == nil {
			if err := createDisk(s.cfg.StateDir, img, size); err != nil {
				return nil, err
			}
		}
	case err != nil:
		return nil, fmt.Errorf("ns: disk quota: %w", err)
	case fi.Size() < size:
		if err := growDisk(img, size); err != nil {
			return nil, err
		}
	}
	if ref.disk == nil {
		// A disk left mounted at the directory by a process that died is
		// unmounted first: mounting it twice would corrupt it.
		if err := unmountDisk(mnt); err != nil {
			return nil, err
		}
		if err := s.waitDiskFree(img); err != nil {
			return nil, err
		}
		if err := waitUnattached(img); err != nil {
			return nil, err
		}
		if ref.disk, err = openDisk(img); err != nil {
			return nil, err
		}
	}
	s.lastLoop[img] = ref.disk.Device()
	s.layers[dir] = ref
	return s.releaser(dir), nil
}

// releaser returns a function that drops one reference on dir's layer
// (unmounting its disk with the last); calling it again does nothing.
func (s *Substrate) releaser(dir string) func() error {
	done := false
	return func() error {
		s.layerMu.Lock()
		defer s.layerMu.Unlock()
		if done {
			return nil
		}
		done = true
		ref := s.layers[dir]
		if ref == nil {
			return nil
		}
		if ref.refs--; ref.refs > 0 {
			return nil
		}
		delete(s.layers, dir)
		if ref.disk == nil {
			return nil
		}
		err := ref.disk.Unmount()
		// The file system ends (journal flushed, loop device released)
		// once the last clone is gone too, asynchronously; the next mount
		// of the image waits for that (waitDiskFree), nothing else needs to.
		if !loopBacks(ref.disk.Device(), ref.disk.img) {
			delete(s.lastLoop, ref.disk.img) // ended with the unmount
		}
		if len(s.lastLoop) > maxLastLoops {
			// Disks of sandboxes that never come back: forget the ones
			// that have ended, so the map stays as small as the number of
			// disks still ending.
			for img, loop := range s.lastLoop {
				if !loopBacks(loop, img) {
					delete(s.lastLoop, img)
				}
			}
		}
		return err
	}
}

// Unmounting a disk on the host does not end its file system while a copy
// of the mount lives on in another mount namespace: every namespace cloned
// while the disk was mounted has one (a warm init waiting for its
// configuration, an init that has not pivoted yet), and the loop device
// stays attached until the last copy goes. Mounting the image again then
// would make a second file system on the same blocks, each writing over
// the other. So before a disk is mounted, its previous loop device must be
// gone: the warm init is discarded (its namespace holds copies for as
// long as it waits), inits that are starting let go within milliseconds.

// maxLastLoops is how many ending disks lastLoop holds before a release
// prunes the ones that have ended.
const maxLastLoops = 256

// diskFreeWait bounds how long a mount waits for the previous one to end.
const diskFreeWait = 10 * time.Second

// waitDiskFree waits until no loop device this process attached to img
// is still attached to it. Called with layerMu held.
func (s *Substrate) waitDiskFree(img string) error {
	loop, ok := s.lastLoop[img]
	if !ok {
		return nil
	}
	deadline := time.Now().Add(diskFreeWait)
	for dropped := false; loopBacks(loop, img); {
		if !dropped {
			s.dropWarm()
			dropped = true
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("ns: disk quota: %s is still in use through %s (a mount of it outlives its unmount); refusing to mount it twice", img, loop)
		}
		time.Sleep(5 * time.Millisecond)
	}
	delete(s.lastLoop, img)
	return nil
}

// waitUnattached waits until no loop device is attached to img, which
// waitDiskFree does not know of when another process attached it: a
// sandbox of a previous worker process still running (not adopted yet,
// or being reclaimed), or its file system still ending. Mounting the image
// again then would make a second file system on the same blocks.
func waitUnattached(img string) error {
	deadline := time.Now().Add(diskFreeWait)
	for {
		loop := loopBacking(img)
		if loop == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("ns: disk quota: %s is attached to %s by a sandbox this process does not hold; refusing to mount it twice", img, loop)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// loopBacks reports whether loop device dev (/dev/loopN) is attached to
// the file img.
func loopBacks(dev, img string) bool {
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "backing_file"))
	if err != nil {
		return false
	}
	p := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), " (deleted)")
	return p == img
}

// PrepareLayer implements substrate.LayerPreparer: it makes the writable
// layer of activation directory dir (with the disk quota lim.DiskBytes,
// or the default, when it has to be created) available on the host and
// returns its path (an overlay upper dir) and the release to call when
// done with it.
func (s *Substrate) PrepareLayer(ctx context.Context, dir string, lim substrate.Limits) (string, func() error, error) {
	if !filepath.IsAbs(dir) {
		return "", nil, fmt.Errorf("ns: activation dir %q is not absolute", dir)
	}
	if err := ctx.Err(); err != nil {
		return "", nil, err
	}
	lim = mergeLimits(lim, s.cfg.Limits)
	release, err := s.acquireLayer(dir, lim.DiskBytes)
	if err != nil {
		return "", nil, err
	}
	return s.LayerDir(dir), release, nil
}

// layerDir is the writable layer (overlay upper dir) of activation
// directory dir as this process reaches it while the layer is held.
func (s *Substrate) LayerDir(dir string) string {
	s.layerMu.Lock()
	defer s.layerMu.Unlock()
	if ref := s.layers[dir]; ref != nil {
		return filepath.Join(ref.root(dir), diskUpperDir)
	}
	return filepath.Join(dir, DiskMountName, diskUpperDir)
}

var _ substrate.LayerPreparer = (*Substrate)(nil)

// attachLayerDisks makes layerClone take its fallback (tests).
var attachLayerDisks = false

// layerClone returns a detached copy of the layer of dir (held by the
// caller), idmapped for usernsFD unless that is -1. A kernel that cannot
// clone a detached mount (open_tree of one was allowed later than fsmount)
// gets the disk attached at dir/DiskMountName instead, and a clone of that.
func (s *Substrate) layerClone(dir string, usernsFD int) (int, error) {
	s.layerMu.Lock()
	defer s.layerMu.Unlock()
	ref := s.layers[dir]
	if ref == nil {
		return -1, fmt.Errorf("ns: writable layer of %s is not held", dir)
	}
	const attrs = unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV
	if ref.disk == nil {
		return idmapClone(ref.root(dir), usernsFD, attrs)
	}
	fd, err := -1, error(unix.EINVAL)
	if !attachLayerDisks {
		fd, err = ref.disk.Clone(usernsFD, attrs)
	}
	if err == nil || ref.disk.mfd < 0 || !errors.Is(err, unix.EINVAL) {
		return fd, err
	}
	mnt := filepath.Join(dir, DiskMountName)
	if err := os.Mkdir(mnt, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return -1, fmt.Errorf("ns: disk quota: %w", err)
	}
	// The disk goes on a shared bind of mnt to itself: every mount
	// namespace cloned while it is attached (another worker's warm init)
	// holds a peer copy, and the unmount propagates to it, so the loop
	// device ends when this process unmounts, not when that init does.
	if err := unix.Mount(mnt, mnt, "", unix.MS_BIND, ""); err != nil {
		return -1, fmt.Errorf("ns: disk quota: bind %s: %w", mnt, err)
	}
	if err := unix.Mount("", mnt, "", unix.MS_SHARED, ""); err != nil {
		unix.Unmount(mnt, unix.MNT_DETACH)
		return -1, fmt.Errorf("ns: disk quota: share %s: %w", mnt, err)
	}
	if err := unix.MoveMount(ref.disk.mfd, "", unix.AT_FDCWD, mnt, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		unix.Unmount(mnt, unix.MNT_DETACH)
		return -1, fmt.Errorf("ns: disk quota: attach %s: %w", mnt, err)
	}
	unix.Close(ref.disk.mfd)
	ref.disk.mfd, ref.disk.dir, ref.disk.sharedBind = -1, mnt, true
	return ref.disk.Clone(usernsFD, attrs)
}

// adoptLayer takes back the writable layer of activation directory dir
// for an adopted sandbox. A layer disk is mounted in the sandbox's own
// namespace: its loop device is found (the one whose backing file is
// dir's image, by device and inode) and mounted again, detached: a block
// device mounted twice is one superblock, so this is the same file
// system, never a second one on the same blocks.
func (s *Substrate) adoptLayer(dir string, st adoptState) (func() error, error) {
	s.layerMu.Lock()
	defer s.layerMu.Unlock()
	ref := s.layers[dir]
	if !st.Disk {
		if ref != nil && ref.disk != nil {
			return nil, fmt.Errorf("layer of %s is held here as a disk; the sandbox's is a directory", dir)
		}
		upper := filepath.Join(dir, DiskMountName, diskUpperDir)
		if fi, err := os.Lstat(upper); err != nil || !fi.IsDir() {
			return nil, fmt.Errorf("writable layer %s: not a directory (%v)", upper, err)
		}
		if ref != nil {
			ref.refs++
		} else {
			s.layers[dir] = &layerRef{refs: 1}
		}
		return s.releaser(dir), nil
	}
	img := filepath.Join(dir, DiskImageName)
	loop, dev, err := findLoop(img, st.Loop)
	if err != nil {
		return nil, err
	}
	if ref != nil {
		// Held here already (PrepareLayer): only if that is the same
		// file system.
		if ref.disk == nil || ref.disk.dev != dev {
			return nil, fmt.Errorf("layer of %s is held here on another device than the sandbox's %s", dir, loop)
		}
		ref.refs++
		return s.releaser(dir), nil
	}
	mfd, err := loopdev.MountExt4(loop, diskMountData)
	if err != nil {
		return nil, fmt.Errorf("layer disk %s (%s): %w", img, loop, err)
	}
	d := &layerDisk{img: img, dir: fmt.Sprintf("/proc/self/fd/%d/", mfd), loop: loop, dev: dev, mfd: mfd}
	// The loop device may have been detached and reused between the
	// lookup and the mount: the mount must be of dir's image still.
	var rst unix.Stat_t
	if err := unix.Fstat(mfd, &rst); err != nil || rst.Dev != dev || !loopBacksFile(loop, img) {
		_ = d.Unmount()
		return nil, fmt.Errorf("layer disk %s: %s changed while it was mounted (%v)", img, loop, err)
	}
	if fi, err := os.Lstat(d.Upper()); err != nil || !fi.IsDir() {
		_ = d.Unmount()
		return nil, fmt.Errorf("layer disk %s has no upper dir (%v)", img, err)
	}
	s.layers[dir] = &layerRef{disk: d, refs: 1}
	s.lastLoop[img] = loop
	return s.releaser(dir), nil
}

// findLoop returns the loop device attached to the file img (by its
// device and inode: the path a loop device shows is the one it was
// attached through, which a spare disk's link no longer is) and the
// device's number; hint is tried first.
func findLoop(img, hint string) (string, uint64, error) {
	cands := []string{}
	if strings.HasPrefix(hint, "/dev/loop") {
		cands = append(cands, hint)
	}
	ents, err := os.ReadDir("/sys/block")
	if err != nil {
		return "", 0, err
	}
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		if _, err := os.Stat(filepath.Join("/sys/block", e.Name(), "loop", "backing_file")); err == nil {
			cands = append(cands, "/dev/"+e.Name())
		}
	}
	for _, c := range cands {
		if rdev, ok := loopOf(c, img); ok {
			return c, rdev, nil
		}
	}
	return "", 0, fmt.Errorf("no loop device backs %s", img)
}

// loopBacksFile reports whether loop device dev is attached to the file
// img (by device and inode).
func loopBacksFile(dev, img string) bool {
	_, ok := loopOf(dev, img)
	return ok
}

// loopOf checks with LOOP_GET_STATUS64 that loop device dev is attached
// to img and returns the device's number.
func loopOf(dev, img string) (uint64, bool) {
	var ist unix.Stat_t
	if err := unix.Stat(img, &ist); err != nil {
		return 0, false
	}
	fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, false
	}
	defer unix.Close(fd)
	info, err := unix.IoctlLoopGetStatus64(fd)
	if err != nil || info.Device != ist.Dev || info.Inode != ist.Ino {
		return 0, false
	}
	var dst unix.Stat_t
	if err := unix.Fstat(fd, &dst); err != nil || dst.Mode&unix.S_IFMT != unix.S_IFBLK || unix.Major(dst.Rdev) != loopdev.Major {
		return 0, false
	}
	return dst.Rdev, true
}
