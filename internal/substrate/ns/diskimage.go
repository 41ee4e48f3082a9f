//go:build linux

package ns

import (
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

	"golang.org/x/sys/unix"
)

// Layer disk images (see disk.go): the golden image formatted once per
// size and mke2fs, sparse copies of it for each activation, and growth.

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
