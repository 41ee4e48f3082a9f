//go:build linux

package volume

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/loopdev"
	"github.com/spacesbx/space/internal/testenv"
)

func newManager(t *testing.T, root string, size int64) *Manager {
	t.Helper()
	testenv.RequireRoot(t, "loop devices and mounts")
	if why := Unsupported(); why != "" {
		testenv.Skipf(t, "volumes unsupported here: %s", why)
	}
	m, err := New(Config{Root: root, SizeBytes: size})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []Config{{}, {Root: "rel"}, {Root: "/a/../b"}, {Root: "/v", SizeBytes: 1 << 20}} {
		if err := c.Validate(); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%+v: %v", c, err)
		}
	}
	if err := (Config{Root: "/v"}).Validate(); err != nil {
		t.Fatal(err)
	}
}

func stDev(t *testing.T, p string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Dev
}

// waitDeleted retries Delete until the kernel let go of the loop device
// (the last mount's release is asynchronous).
func waitDeleted(t *testing.T, m *Manager, id string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := m.Delete(context.Background(), id)
		if err == nil {
			return
		}
		if !errors.Is(err, errdefs.ErrConflict) || time.Now().After(deadline) {
			t.Fatalf("delete %s: %v", id, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// One volume is one file system however many hold it, in this process or
// another manager (another worker process) of the host; its data dir is
// owned by the sandbox user; its quota holds; it survives release and is
// deleted only when nothing uses it.
func TestAcquireSharesOneFileSystem(t *testing.T) {
	root := t.TempDir()
	m := newManager(t, root, 32<<20)
	id := NewID()
	d1, rel1, err := m.Acquire(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	d2, rel2, err := m.Acquire(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if d1 != d2 {
		t.Fatalf("two acquires in one process gave %s and %s", d1, d2)
	}
	var st unix.Stat_t
	if err := unix.Stat(d1, &st); err != nil || st.Uid != UserID || st.Gid != GroupID || st.Mode&0o7777 != 0o755 {
		t.Fatalf("data dir: %+v %v", st, err)
	}
	// Another worker process on the host: a manager of its own.
	other, err := New(Config{Root: root, SizeBytes: 32 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	d3, rel3, err := other.Acquire(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if stDev(t, d1) != stDev(t, d3) {
		t.Fatal("a second manager mounted a second file system on the image")
	}
	if err := os.WriteFile(filepath.Join(d1, "hello"), []byte("hi"), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(d3, "hello")); err != nil || string(b) != "hi" {
		t.Fatalf("other manager reads %q %v", b, err)
	}
	if err := m.Delete(context.Background(), id); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("delete while held: %v", err)
	}
	// Quota: the image's size bounds what fits.
	f, err := os.Create(filepath.Join(d1, "fill"))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	var werr error
	for i := 0; i < 64 && werr == nil; i++ {
		_, werr = f.Write(buf)
	}
	if werr == nil {
		werr = f.Sync()
	}
	f.Close()
	if !errors.Is(werr, syscall.ENOSPC) {
		t.Fatalf("writing 64 MiB into a 32 MiB volume: %v", werr)
	}
	if err := os.Remove(filepath.Join(d1, "fill")); err != nil {
		t.Fatal(err)
	}
	var img unix.Stat_t
	if err := unix.Stat(m.Image(id), &img); err != nil || img.Size != 32<<20 {
		t.Fatalf("image: %+v %v", img, err)
	}
	rel1()
	rel1() // idempotent
	rel2()
	rel3()
	// Kept: a later acquire sees the file.
	d4, rel4, err := m.Acquire(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(d4, "hello")); err != nil || string(b) != "hi" {
		t.Fatalf("after release: %q %v", b, err)
	}
	rel4()
	waitDeleted(t, m, id)
	if _, err := os.Stat(m.Image(id)); !os.IsNotExist(err) {
		t.Fatalf("image left after delete: %v", err)
	}
}

func TestAcquireRejectsBadIDs(t *testing.T) {
	m := newManager(t, t.TempDir(), 0)
	for _, id := range []string{"../x", "vol_x", ""} {
		if _, _, err := m.Acquire(context.Background(), id); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("Acquire(%q): %v", id, err)
		}
		if err := m.Delete(context.Background(), id); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("Delete(%q): %v", id, err)
		}
	}
	// An image that is not a regular file is refused, never mounted.
	id := NewID()
	if err := os.Symlink("/etc/passwd", m.Image(id)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := m.Acquire(context.Background(), id); err == nil {
		t.Fatal("a symlinked image was mounted")
	}
}

// Collect removes the images of volumes that no longer exist, never one
// that exists or is in use, and never on a failed listing.
func TestCollect(t *testing.T) {
	m := newManager(t, t.TempDir(), 16<<20)
	ctx := context.Background()
	keep, gone, busy := NewID(), NewID(), NewID()
	for _, id := range []string{keep, gone} {
		_, rel, err := m.Acquire(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		rel()
	}
	_, relBusy, err := m.Acquire(ctx, busy)
	if err != nil {
		t.Fatal(err)
	}
	defer relBusy()
	if _, err := m.Collect(ctx, func(context.Context) (map[string]bool, error) { return nil, errdefs.ErrUnavailable }); err == nil {
		t.Fatal("a failed listing collected")
	}
	live := func(context.Context) (map[string]bool, error) { return map[string]bool{keep: true}, nil }
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := m.Collect(ctx, live); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(m.Image(gone)); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the deleted volume's image stayed")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, id := range []string{keep, busy} {
		if _, err := os.Stat(m.Image(id)); err != nil {
			t.Fatalf("image of %s: %v", id, err)
		}
	}
}

// A second block device on one image (what another host sharing the
// volume root would mount) is refused by the image's multi-mount
// protection while the volume is in use here.
func TestSecondDeviceRefused(t *testing.T) {
	if testing.Short() {
		testenv.Skipf(t, "waits for the multi-mount protection interval (skipped by -short)")
	}
	old := mmpInterval
	mmpInterval = 1
	defer func() { mmpInterval = old }()
	m := newManager(t, t.TempDir(), 16<<20)
	id := NewID()
	_, rel, err := m.Acquire(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	defer rel()
	f, err := os.OpenFile(m.Image(id), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	loop, _, err := loopdev.Attach(int(f.Fd()), blockSize)
	if err != nil {
		t.Fatal(err)
	}
	defer loop.Close()
	t0 := time.Now()
	if mfd, err := loopdev.MountExt4(loop.Name(), mountData); err == nil {
		unix.Close(mfd)
		t.Fatal("a second device mounted the image while it is in use")
	}
	t.Logf("refused after %v", time.Since(t0))
}
