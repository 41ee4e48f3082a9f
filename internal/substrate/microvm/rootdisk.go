//go:build linux

package microvm

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
)

// Root disks: a sandbox whose Spec.Image is set boots that image's root
// file system. The layer stack is flattened once per Image.ID into one
// ext4 disk image in Config.RootDiskDir, which every VM of the image
// attaches read-only (virtio-blk, readonly=on) and the guest mounts as the
// lower layer of its root overlay.
//
// Flattening lets the host kernel do the merging: the layers are mounted
// as a read-only overlay (lower layers only, detached: fsopen/fsmount, in
// no mount namespace), which applies whiteouts and opaque directories
// exactly as the ns substrate's overlay does, and mkfs.ext4 -d copies the
// merged view (owners, modes, setuid bits, symlinks, hard links, xattrs)
// into a fresh file system. The image has no journal (nobody writes it).
// It is built into a temporary file under an flock, fsynced, made 0400
// and renamed into place, so a reader never sees half an image; a sidecar
// (<key>.json) records its SHA-256, which a saved state names: a VM's
// memory caches the image's blocks, so a restore needs the very same
// bytes, and mke2fs does not promise the same bytes on another host.
//
// The host never mounts a disk a guest wrote: the image is written by
// mkfs from layers the platform keeps, and the writable layer disk
// (layerdisk.go) is only ever copied as bytes.

// rootDiskVersion is hashed into every root disk's key: bump it when the
// flattening or mkfs options change.
const rootDiskVersion = "space-microvm-rootdisk-v1"

// Guest-visible serial numbers of the two disks (the init finds them in
// /sys/block/vd*/serial, whatever order the kernel probed them in).
const (
	rootDiskSerial  = "space-root"
	layerDiskSerial = "space-layer"
)

// rootDisk is one flattened image.
type rootDisk struct {
	// ImageID is Image.ID; SHA256 the disk image's content hash.
	ImageID string `json:"image_id"`
	SHA256  string `json:"sha256"`
	Size    int64  `json:"size"`
	// path is the cached image.
	path string
}

// rootDiskKey names the cached disk of img: a hash of the flattening
// version and the image's ID (the ID names the stack's content).
func rootDiskKey(img *substrate.Image) (string, error) {
	if err := validateImage(img); err != nil {
		return "", err
	}
	h := sha256.New()
	writeField(h, rootDiskVersion)
	writeField(h, img.ID)
	return hex.EncodeToString(h.Sum(nil)), nil
}

// validateImage checks what the substrate needs of an Image: an ID, and
// layers that are absolute, clean paths overlayfs can take in a lowerdir
// list.
func validateImage(img *substrate.Image) error {
	switch {
	case img.ID == "" || len(img.ID) > 512 || strings.ContainsRune(img.ID, 0):
		return fmt.Errorf("microvm: %w: image id %q", errdefs.ErrInvalid, img.ID)
	case len(img.Layers) == 0:
		return fmt.Errorf("microvm: %w: image %s has no layers", errdefs.ErrInvalid, img.ID)
	case len(img.Layers) > 500:
		return fmt.Errorf("microvm: %w: image %s has %d layers (at most 500)", errdefs.ErrInvalid, img.ID, len(img.Layers))
	}
	for _, l := range img.Layers {
		if !filepath.IsAbs(l) || filepath.Clean(l) != l || strings.ContainsAny(l, ":,\\\x00\n") {
			return fmt.Errorf("microvm: %w: image %s: layer path %q must be absolute and clean, without : , or \\", errdefs.ErrInvalid, img.ID, l)
		}
	}
	return nil
}

// PrepareImage flattens img into its cached root disk now, when it is not
// there yet, so that the first Start of the image does not spend its time
// on it (flattening a Debian base takes tens of seconds: more than a
// start may wait). Safe to call concurrently, from several processes too.
func (s *Substrate) PrepareImage(img *substrate.Image) error {
	if err := validateImage(img); err != nil {
		return err
	}
	_, err := s.ensureRootDisk(img)
	return err
}

// ensureRootDisk returns the flattened disk of img, building it first when
// it is not in the cache. A build runs to its end whatever the caller's
// deadline: a build cut short would be started over by every later start.
func (s *Substrate) ensureRootDisk(img *substrate.Image) (*rootDisk, error) {
	key, err := rootDiskKey(img)
	if err != nil {
		return nil, err
	}
	dir := s.cfg.RootDiskDir
	path := filepath.Join(dir, key+".img")
	meta := filepath.Join(dir, key+".json")
	s.imgMu.Lock()
	d, ok := s.rootDisks[key]
	s.imgMu.Unlock()
	if ok && fileExists(d.path) {
		return d, nil
	}
	if d, err := readRootDisk(path, meta, img.ID); err == nil {
		return s.rememberRootDisk(key, d), nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("microvm: root disks: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, key+".lock"), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("microvm: root disk lock: %w", err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return nil, fmt.Errorf("microvm: root disk lock: %w", err)
	}
	if d, err := readRootDisk(path, meta, img.ID); err == nil {
		return s.rememberRootDisk(key, d), nil
	}
	d, err = s.buildRootDisk(img, dir, path, meta)
	if err != nil {
		return nil, fmt.Errorf("microvm: image %s: %w", img.ID, err)
	}
	return s.rememberRootDisk(key, d), nil
}

func (s *Substrate) rememberRootDisk(key string, d *rootDisk) *rootDisk {
	s.imgMu.Lock()
	defer s.imgMu.Unlock()
	s.rootDisks[key] = d
	return d
}

// readRootDisk reads a complete cached disk's sidecar and checks it
// against the image file.
func readRootDisk(path, meta, imageID string) (*rootDisk, error) {
	b, err := os.ReadFile(meta)
	if err != nil {
		return nil, err
	}
	var d rootDisk
	if err := json.Unmarshal(b, &d); err != nil {
		return nil, err
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if d.ImageID != imageID || d.Size != fi.Size() || len(d.SHA256) != 64 {
		return nil, fmt.Errorf("microvm: root disk %s does not match its sidecar", path)
	}
	d.path = path
	return &d, nil
}

// buildRootDisk flattens img into path (see the top of this file). Runs
// under the key's flock.
func (s *Substrate) buildRootDisk(img *substrate.Image, dir, path, meta string) (*rootDisk, error) {
	for _, l := range img.Layers {
		fi, err := os.Lstat(l)
		if err != nil {
			return nil, fmt.Errorf("%w: layer: %w", errdefs.ErrNotFound, err)
		}
		if !fi.IsDir() {
			return nil, fmt.Errorf("%w: layer %s is not a directory", errdefs.ErrInvalid, l)
		}
	}
	mkfs, err := findMkfs(s.cfg.MkfsPath)
	if err != nil {
		return nil, err
	}
	// What a build of this key cut short by a crash left (its detached
	// mount died with its process).
	stale, _ := filepath.Glob(filepath.Join(dir, ".build-"+filepath.Base(path)+"-*"))
	for _, p := range stale {
		_ = os.RemoveAll(p)
	}
	work, err := os.MkdirTemp(dir, ".build-"+filepath.Base(path)+"-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	layers := img.Layers
	if len(layers) == 1 {
		// Overlay without an upper layer wants two lower ones; an empty
		// top layer changes nothing.
		empty := filepath.Join(work, "empty")
		if err := os.Mkdir(empty, 0o755); err != nil {
			return nil, err
		}
		layers = append([]string{layers[0]}, empty)
	}
	mnt, err := mountMerged(layers)
	if err != nil {
		return nil, err
	}
	defer mnt.Close()
	// The merged view reached through the mount's descriptor: the walk
	// and mkfs (as its fd 3) both use /proc/self/fd paths.
	inodes, bytes, err := measureTree(procSelfFD(mnt) + "/.")
	if err != nil {
		return nil, fmt.Errorf("measure merged layers: %w", err)
	}
	tmp := filepath.Join(work, "disk.img")
	size := rootDiskSize(bytes, inodes)
	for attempt := 0; ; attempt++ {
		err = mkfsRoot(mkfs, mnt, tmp, size, inodes)
		if err == nil {
			break
		}
		if attempt == 2 || !strings.Contains(err.Error(), "Could not allocate") && !strings.Contains(err.Error(), "No space") {
			return nil, err
		}
		size *= 2 // an estimate too small (large xattrs, many directories)
	}
	f, err := os.Open(tmp)
	if err != nil {
		return nil, err
	}
	h := sha256.New()
	_, err = io.Copy(h, f)
	if err == nil {
		err = f.Sync()
	}
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("hash root disk: %w", err)
	}
	d := &rootDisk{ImageID: img.ID, SHA256: hex.EncodeToString(h.Sum(nil)), Size: size, path: path}
	b, err := json.Marshal(d)
	if err != nil {
		return nil, err
	}
	// The sidecar first: the image's presence is what says "complete".
	if err := writeFileAtomic(meta, b, 0o600); err != nil {
		return nil, err
	}
	if err := os.Chmod(tmp, 0o400); err != nil {
		return nil, err
	}
	if err := os.Rename(tmp, path); err != nil {
		return nil, err
	}
	_ = syncDir(dir)
	s.cfg.Logger.Info("microvm: flattened image into a root disk", "image", img.ID, "layers", len(img.Layers),
		"path", path, "size_mib", size>>20, "inodes", inodes)
	return d, nil
}

// mountMerged mounts layers (bottom first) as a read-only overlay that is
// attached nowhere and returns the mount's descriptor (closing it unmounts).
// redirect_dir=nofollow and metacopy=off: a layer's overlay xattrs other
// than whiteouts and opaque markers are not interpreted.
func mountMerged(layers []string) (*os.File, error) {
	fsfd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("overlay: fsopen: %w", err)
	}
	defer unix.Close(fsfd)
	lower := make([]string, len(layers))
	for i, l := range layers {
		lower[len(layers)-1-i] = l // overlay lists the top layer first
	}
	for _, kv := range [][2]string{{"lowerdir", strings.Join(lower, ":")}, {"redirect_dir", "nofollow"}, {"metacopy", "off"}} {
		if err := unix.FsconfigSetString(fsfd, kv[0], kv[1]); err != nil {
			return nil, fmt.Errorf("overlay: %s: %w", kv[0], err)
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return nil, fmt.Errorf("overlay: create: %w", err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_RDONLY|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOSUID)
	if err != nil {
		return nil, fmt.Errorf("overlay: fsmount: %w", err)
	}
	return os.NewFile(uintptr(mfd), "merged-layers"), nil
}

// measureTree counts the inodes under root and the bytes their data takes
// in 4 KiB blocks (hard links counted once).
func measureTree(root string) (inodes, bytes int64, err error) {
	type ino struct{ dev, ino uint64 }
	seen := map[ino]bool{}
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return errors.New("no stat")
		}
		if st.Nlink > 1 && !d.IsDir() {
			k := ino{st.Dev, st.Ino}
			if seen[k] {
				return nil
			}
			seen[k] = true
		}
		inodes++
		switch {
		case fi.Mode().IsRegular():
			bytes += (fi.Size() + 4095) &^ 4095
		case d.IsDir():
			bytes += 4096
		case fi.Mode()&fs.ModeSymlink != 0 && fi.Size() >= 60:
			bytes += 4096
		}
		return nil
	})
	return inodes, bytes, err
}

// rootDiskSize is the file system size for data bytes in inodes files:
// the data plus an eighth (extent trees, directories grown by mkfs,
// xattr blocks), the inode tables and 16 MiB of metadata, in whole MiB.
func rootDiskSize(data, inodes int64) int64 {
	size := data + data/8 + (inodes+1024)*256 + 16<<20
	return (size + (1<<20 - 1)) &^ (1<<20 - 1)
}

// mkfsRoot formats img (created here, size bytes) with the tree of the
// mount mnt. The root of the new file system takes the tree root's owner
// and mode.
func mkfsRoot(mkfs string, mnt *os.File, img string, size, inodes int64) error {
	_ = os.Remove(img)
	f, err := os.OpenFile(img, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(mnt.Fd()), &st); err != nil {
		return err
	}
	args := []string{
		"-q", "-F", "-t", "ext4", "-b", "4096", "-m", "0", "-I", "256",
		"-N", strconv.FormatInt(inodes+1024, 10), "-L", "space-image",
		"-O", "^has_journal,^resize_inode",
		"-E", fmt.Sprintf("root_owner=%d:%d,lazy_itable_init=1", st.Uid, st.Gid),
		"-d", "/proc/self/fd/3/.", img,
	}
	cmd := exec.Command(mkfs, args...)
	cmd.ExtraFiles = []*os.File{mnt}
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %v: %s", mkfs, err, strings.TrimSpace(out.String()))
	}
	return nil
}

// findMkfs returns configured, or mkfs.ext4 from PATH, /usr/sbin or /sbin.
func findMkfs(configured string) (string, error) {
	if configured != "" {
		return configured, nil
	}
	if p, err := exec.LookPath("mkfs.ext4"); err == nil {
		return p, nil
	}
	for _, d := range []string{"/usr/sbin", "/sbin"} {
		if p := filepath.Join(d, "mkfs.ext4"); isExecutable(p) {
			return p, nil
		}
	}
	return "", fmt.Errorf("microvm: %w: mkfs.ext4 not found (make sandbox-deps installs e2fsprogs)", errdefs.ErrUnavailable)
}

func isExecutable(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// writeFileAtomic writes b to path through a synced temporary file and a
// rename.
func writeFileAtomic(path string, b []byte, perm os.FileMode) error {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY|unix.O_CLOEXEC, perm)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
	}
	return err
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}
