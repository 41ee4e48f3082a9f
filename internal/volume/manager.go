//go:build linux

package volume

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/loopdev"
)

// Config configures a worker's volumes.
type Config struct {
	// Root holds the volumes' images and locks (created 0700). Required;
	// the worker's default is <data dir>/volumes.
	Root string
	// SizeBytes is a new volume's quota (its image's size), rounded up to
	// whole MiB. Default DefaultSize (10 GiB); at least MinSize. An image
	// keeps the size it was made with.
	SizeBytes int64
	// Logger receives the manager's logs (default slog.Default()).
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.SizeBytes == 0 {
		c.SizeBytes = DefaultSize
	}
	c.SizeBytes = (c.SizeBytes + 1<<20 - 1) &^ (1<<20 - 1)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate checks c (errdefs.ErrInvalid).
func (c Config) Validate() error {
	if c.Root == "" || !filepath.IsAbs(c.Root) || filepath.Clean(c.Root) != c.Root {
		return fmt.Errorf("volume: %w: Root must be an absolute clean path, got %q", errdefs.ErrInvalid, c.Root)
	}
	if c.SizeBytes != 0 && (c.SizeBytes < MinSize || c.SizeBytes > 16<<40) {
		return fmt.Errorf("volume: %w: SizeBytes must be %d..16 TiB", errdefs.ErrInvalid, MinSize)
	}
	return nil
}

// Manager makes volumes available to the substrate on one worker.
type Manager struct {
	cfg  Config
	mkfs string

	mu   sync.Mutex
	held map[string]*held
}

// held is a volume mounted (detached) in this process.
type held struct {
	mfd  int
	refs int
}

// New checks the host (mkfs.ext4, loop devices) and prepares Root.
func New(cfg Config) (*Manager, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	mkfs, err := findMkfs()
	if err != nil {
		return nil, fmt.Errorf("volume: %w: %v", errdefs.ErrUnavailable, err)
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		return nil, fmt.Errorf("volume: %w: no loop devices: %v", errdefs.ErrUnavailable, err)
	}
	if err := os.MkdirAll(cfg.Root, 0o700); err != nil {
		return nil, fmt.Errorf("volume: root: %w", err)
	}
	if err := os.Chmod(cfg.Root, 0o700); err != nil {
		return nil, fmt.Errorf("volume: root: %w", err)
	}
	return &Manager{cfg: cfg, mkfs: mkfs, held: map[string]*held{}}, nil
}

// Unsupported says why volumes cannot be used on this host, or "".
func Unsupported() string {
	if _, err := findMkfs(); err != nil {
		return err.Error()
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		return "no /dev/loop-control (loop devices)"
	}
	return ""
}

func findMkfs() (string, error) {
	for _, p := range []string{"/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"} {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	p, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		return "", errors.New("mkfs.ext4 not found (Debian package e2fsprogs)")
	}
	return p, nil
}

// Image is the path of volume id's image.
func (m *Manager) Image(id string) string { return filepath.Join(m.cfg.Root, id+".img") }

func (m *Manager) lockPath(id string) string { return filepath.Join(m.cfg.Root, id+".lock") }

// Acquire makes volume id's files available, creating its image on first
// use, and returns the directory sandboxes see (a path into this
// process's descriptor of the detached mount: valid until release) and
// its release. A sandbox given a clone of the mount keeps the file
// system alive on its own: release right after the sandbox started.
func (m *Manager) Acquire(ctx context.Context, id string) (dir string, release func(), err error) {
	if err := ValidateID(id); err != nil {
		return "", nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	h := m.held[id]
	if h == nil {
		mfd, err := m.mount(ctx, id)
		if err != nil {
			return "", nil, err
		}
		h = &held{mfd: mfd}
		m.held[id] = h
	}
	h.refs++
	var once sync.Once
	release = func() {
		once.Do(func() {
			m.mu.Lock()
			defer m.mu.Unlock()
			if h.refs--; h.refs == 0 {
				unix.Close(h.mfd)
				delete(m.held, id)
			}
		})
	}
	return fmt.Sprintf("/proc/self/fd/%d/%s", h.mfd, DataDir), release, nil
}

// lock takes the volume's flock (between worker processes and, where the
// file system carries locks, hosts), waiting at most until ctx ends.
func (m *Manager) lock(ctx context.Context, id string) (unlock func(), err error) {
	f, err := os.OpenFile(m.lockPath(id), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("volume %s: lock: %w", id, err)
	}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if err != unix.EWOULDBLOCK && err != unix.EINTR {
			f.Close()
			return nil, fmt.Errorf("volume %s: lock: %w", id, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("volume %s: %w: locked by another process", id, errdefs.ErrTimeout)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// mount returns a detached mount of volume id's file system: the loop
// device already backing its image if there is one (the same
// superblock), else a new one.
func (m *Manager) mount(ctx context.Context, id string) (int, error) {
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return -1, err
	}
	defer unlock()
	img := m.Image(id)
	created := false
	if _, err := os.Lstat(img); errors.Is(err, os.ErrNotExist) {
		if err := m.create(img); err != nil {
			return -1, fmt.Errorf("volume %s: %w", id, err)
		}
		created = true
	} else if err != nil {
		return -1, fmt.Errorf("volume %s: %w", id, err)
	}
	f, err := os.OpenFile(img, os.O_RDWR|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return -1, fmt.Errorf("volume %s: %w", id, err)
	}
	defer f.Close()
	var ist unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &ist); err != nil || ist.Mode&unix.S_IFMT != unix.S_IFREG {
		return -1, fmt.Errorf("volume %s: %s is not an image file", id, img)
	}
	// Holding the device open keeps autoclear from detaching (and the
	// driver from reusing) it until the mount holds it.
	loop, rdev, err := findLoop(ist)
	if err != nil {
		return -1, fmt.Errorf("volume %s: %w", id, err)
	}
	if loop == nil {
		if loop, rdev, err = loopdev.Attach(int(f.Fd()), blockSize); err != nil {
			return -1, fmt.Errorf("volume %s: attach: %w", id, err)
		}
	}
	defer loop.Close()
	mfd, err := loopdev.MountExt4(loop.Name(), mountData)
	if err != nil {
		return -1, fmt.Errorf("volume %s: mount: %w", id, err)
	}
	if err := prepare(mfd, rdev, created); err != nil {
		unix.Close(mfd)
		return -1, fmt.Errorf("volume %s: %w", id, err)
	}
	return mfd, nil
}

// mmpInterval is the images' ext4 multi-mount protection interval in
// seconds: a mounted volume's kernel thread stamps its MMP block this
// often, and a mount through another block device (another host on
// shared storage, or a second loop device here) that sees the stamp
// change within about 4 intervals is refused ("already active on another
// node") instead of writing the image as a second file system. Mounting
// an image unmounted cleanly is not delayed; one left mounted by a host
// that died waits those 4 intervals once. A variable for the test.
var mmpInterval = 5

// create formats a new image at img (sparse, written to a temporary name
// and renamed into place, so a crash leaves no half-made image).
func (m *Manager) create(img string) error {
	tmp := img + ".new"
	_ = os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(m.cfg.SizeBytes)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		// lazy_itable_init: the inode tables of a fresh sparse file read as
		// zeros already (and noinit_itable keeps the kernel from writing
		// them: the image stays sparse).
		out, xerr := exec.Command(m.mkfs, "-q", "-F", "-m", "0", "-b", "4096", "-L", "space-volume", "-O", "mmp",
			"-E", fmt.Sprintf("lazy_itable_init=1,lazy_journal_init=1,nodiscard,mmp_update_interval=%d", mmpInterval), tmp).CombinedOutput()
		if xerr != nil {
			err = fmt.Errorf("mkfs.ext4: %v: %s", xerr, strings.TrimSpace(string(out)))
		}
	}
	if err == nil {
		err = os.Rename(tmp, img)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("create image: %w", err)
	}
	if d, err := os.Open(filepath.Dir(img)); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}

// prepare checks the mount is the loop device's file system and that
// DataDir is a directory on it, making it (owned by the sandbox user) on
// a new volume.
func prepare(mfd int, rdev uint64, created bool) error {
	var st unix.Stat_t
	if err := unix.Fstat(mfd, &st); err != nil {
		return err
	}
	if st.Dev != rdev {
		return errors.New("the mount is not on the volume's loop device")
	}
	if created {
		if err := unix.Mkdirat(mfd, DataDir, 0o755); err != nil && err != unix.EEXIST {
			return err
		}
		if err := unix.Fchownat(mfd, DataDir, UserID, GroupID, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	}
	if err := unix.Fstatat(mfd, DataDir, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("%s: %w", DataDir, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("%s on the volume is not a directory", DataDir)
	}
	return nil
}

// Delete removes volume id's image, unless it is in use on this host
// (errdefs.ErrConflict). A volume never used here has nothing to remove.
func (m *Manager) Delete(ctx context.Context, id string) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.held[id] != nil {
		return fmt.Errorf("volume %s: %w: in use", id, errdefs.ErrConflict)
	}
	img := m.Image(id)
	var ist unix.Stat_t
	if err := unix.Lstat(img, &ist); errors.Is(err, unix.ENOENT) {
		_ = os.Remove(m.lockPath(id))
		return nil
	} else if err != nil {
		return fmt.Errorf("volume %s: %w", id, err)
	}
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	loop, _, err := findLoop(ist)
	if err != nil {
		return fmt.Errorf("volume %s: %w", id, err)
	}
	if loop != nil {
		loop.Close()
		return fmt.Errorf("volume %s: %w: mounted by a sandbox on this host", id, errdefs.ErrConflict)
	}
	if err := os.Remove(img); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("volume %s: %w", id, err)
	}
	_ = os.Remove(m.lockPath(id))
	return nil
}

// Collect deletes the images of volumes that exist no more: it lists the
// images here first and then asks live for the ids that exist (an image
// is only made for a volume that exists, so one made after the listing is
// never taken for a deleted one). An image in use stays (Delete). It
// returns the ids deleted.
func (m *Manager) Collect(ctx context.Context, live func(context.Context) (map[string]bool, error)) ([]string, error) {
	ents, err := os.ReadDir(m.cfg.Root)
	if err != nil {
		return nil, fmt.Errorf("volume: collect: %w", err)
	}
	var ids []string
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), ".img"); ok && ValidateID(id) == nil {
			ids = append(ids, id)
		}
	}
	if len(ids) == 0 {
		return nil, nil
	}
	exist, err := live(ctx)
	if err != nil {
		return nil, fmt.Errorf("volume: collect: %w", err)
	}
	var done []string
	var errs []error
	for _, id := range ids {
		if exist[id] {
			continue
		}
		if err := m.Delete(ctx, id); err != nil {
			if !errors.Is(err, errdefs.ErrConflict) {
				errs = append(errs, err)
			}
			continue
		}
		m.cfg.Logger.Info("deleted volume's files removed", "volume", id)
		done = append(done, id)
	}
	return done, errors.Join(errs...)
}

// Close lets go of the mounts this process holds (sandboxes keep theirs).
func (m *Manager) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	for id, h := range m.held {
		unix.Close(h.mfd)
		delete(m.held, id)
	}
	return nil
}
