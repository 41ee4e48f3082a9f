//go:build linux

package ns

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/testenv"
)

// needDisk skips unless layer disks can be made here: root, the loop
// driver and mkfs.ext4.
func needDisk(t *testing.T) string {
	t.Helper()
	testenv.RequireRoot(t, "loop devices, mounts")
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		testenv.Skipf(t, "no loop driver: %v", err)
	}
	if _, err := findE2fs("mkfs.ext4"); err != nil {
		testenv.Skipf(t, "%v", err)
	}
	return t.TempDir()
}

// loopsFor returns the loop devices whose backing file is under prefix.
func loopsFor(t *testing.T, prefix string) []string {
	t.Helper()
	files, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // detached meanwhile
		}
		if strings.HasPrefix(strings.TrimSpace(string(b)), prefix) {
			out = append(out, strings.Split(f, "/")[3])
		}
	}
	return out
}

// waitNoLoops fails unless every loop device backed by a file under
// prefix is gone within a few seconds.
func waitNoLoops(t *testing.T, prefix string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		l := loopsFor(t, prefix)
		if len(l) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("loop devices leaked: %v", l)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func allocated(t *testing.T, p string) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

func hostFree(t *testing.T, p string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(p, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * st.Bsize
}

func mustMount(t *testing.T, img, dir string) *layerDisk {
	t.Helper()
	d, err := mountDisk(img, dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Unmount() })
	return d
}

func TestDiskQuotaENOSPC(t *testing.T) {
	tmp := needDisk(t)
	const quota = 128 << 20
	state, img, dir := filepath.Join(tmp, "state"), filepath.Join(tmp, DiskImageName), filepath.Join(tmp, DiskMountName)
	if _, err := goldenImage(state, quota); err != nil { // format outside the measurement
		t.Fatal(err)
	}
	free0 := hostFree(t, tmp)
	if err := createDisk(state, img, quota); err != nil {
		t.Fatal(err)
	}
	d := mustMount(t, img, dir)
	f, err := os.Create(filepath.Join(d.Upper(), "fill"))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i*7 + 1) // not zeros: nothing may be optimized away
	}
	var written int64
	for written < 2*quota {
		n, err := f.Write(buf)
		written += int64(n)
		if err != nil {
			if !errors.Is(err, unix.ENOSPC) {
				t.Fatalf("write after %d bytes: %v, want ENOSPC", written, err)
			}
			break
		}
	}
	if err := f.Sync(); err != nil && !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("fsync: %v", err)
	}
	f.Close()
	if written >= quota || written < quota*9/10 {
		t.Fatalf("wrote %d bytes into a %d byte quota before ENOSPC", written, quota)
	}
	unix.Sync() // the loop's writes reach the host fs
	used := allocated(t, img)
	drop := free0 - hostFree(t, tmp)
	t.Logf("quota %d MiB: ENOSPC after %.1f MiB written; image allocates %.1f MiB on the host; host free space dropped %.1f MiB",
		quota>>20, float64(written)/(1<<20), float64(used)/(1<<20), float64(drop)/(1<<20))
	if used > quota+(1<<20) {
		t.Errorf("image allocates %d bytes, more than its %d byte quota", used, quota)
	}
	// Other processes share the host fs: the slack covers their noise.
	if drop > quota+(32<<20) {
		t.Errorf("host free space dropped %d bytes for a %d byte quota", drop, quota)
	}

	// discard: deleting inside gives the space back to the host.
	if err := os.Remove(filepath.Join(d.Upper(), "fill")); err != nil {
		t.Fatal(err)
	}
	var after int64
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		unix.Sync()
		if after = allocated(t, img); after < quota/4 || time.Now().After(deadline) {
			break
		}
	}
	t.Logf("after deleting the file inside: image allocates %.1f MiB", float64(after)/(1<<20))
	if after >= quota/4 {
		t.Errorf("deleted blocks not given back to the host: image still allocates %d bytes", after)
	}
	// The disk is usable again.
	if err := os.WriteFile(filepath.Join(d.Upper(), "small"), []byte("ok"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := d.Unmount(); err != nil {
		t.Fatal(err)
	}
	waitNoLoops(t, tmp)
}

// TestDiskOverlayENOSPC: the disk as the overlay's writable layer, the
// way the sandbox's root uses it: writes and copy-ups through the
// overlay stop at the quota, and the overlay shows only the template
// and the disk's upper/ (never the image, work/ or lost+found).
func TestDiskOverlayENOSPC(t *testing.T) {
	tmp := needDisk(t)
	const quota = 64 << 20
	state, img := filepath.Join(tmp, "state"), filepath.Join(tmp, DiskImageName)
	lower, root := filepath.Join(tmp, "lower"), filepath.Join(tmp, "rootfs")
	for _, p := range []string{lower, root} {
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(lower, "template-file"), []byte("from the template"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := createDisk(state, img, quota); err != nil {
		t.Fatal(err)
	}
	d := mustMount(t, img, filepath.Join(tmp, DiskMountName))
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", lower, d.Upper(), d.Work())
	if err := unix.Mount("overlay", root, "overlay", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unix.Unmount(root, unix.MNT_DETACH) }()
	// Copy-up of a template file lands on the disk.
	if err := os.WriteFile(filepath.Join(root, "template-file"), []byte("changed"), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(d.Upper(), "template-file")); err != nil || string(b) != "changed" {
		t.Fatalf("copy-up: %q %v", b, err)
	}
	ents, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != "template-file" {
		t.Fatalf("overlay root holds %v", ents)
	}
	f, err := os.Create(filepath.Join(root, "fill"))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	var written int64
	for written <= quota {
		n, err := f.Write(buf)
		written += int64(n)
		if err != nil {
			if !errors.Is(err, unix.ENOSPC) {
				t.Fatalf("write through the overlay after %d bytes: %v, want ENOSPC", written, err)
			}
			break
		}
	}
	f.Close()
	if written > quota || written < quota*8/10 {
		t.Fatalf("overlay took %d bytes for a %d byte quota", written, quota)
	}
	t.Logf("quota %d MiB: ENOSPC through the overlay after %.1f MiB", quota>>20, float64(written)/(1<<20))
	if err := unix.Unmount(root, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Unmount(); err != nil {
		t.Fatal(err)
	}
	waitNoLoops(t, tmp)
}

// TestDiskIdmappedClone: with user namespaces (userns.go) the writable
// layer reaches the init as an idmapped detached mount. open_tree of the
// activation dir alone (no AT_RECURSIVE) does not carry the disk mounted
// under it, so the disk's own mount is cloned: ext4 on a loop device
// accepts the idmapping.
func TestDiskIdmappedClone(t *testing.T) {
	tmp := needDisk(t)
	state, img := filepath.Join(tmp, "state"), filepath.Join(tmp, DiskImageName)
	if err := createDisk(state, img, 64<<20); err != nil {
		t.Fatal(err)
	}
	d := mustMount(t, img, filepath.Join(tmp, DiskMountName))
	if err := os.WriteFile(filepath.Join(d.Upper(), "f"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	const base = 300000
	cmd := exec.Command("sleep", "30")
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: 65536}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: 65536}},
	}
	if err := cmd.Start(); err != nil {
		testenv.Skipf(t, "no user namespace: %v", err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	uns, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", cmd.Process.Pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(uns)
	fd, err := unix.OpenTree(unix.AT_FDCWD, d.Dir(), unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_SYMLINK_NOFOLLOW)
	if err != nil {
		testenv.Skipf(t, "open_tree: %v", err)
	}
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV, Userns_fd: uint64(uns)}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		unix.Close(fd)
		if errors.Is(err, unix.ENOSYS) {
			testenv.Skipf(t, "no mount_setattr")
		}
		t.Fatalf("idmapping the disk's mount: %v", err)
	}
	tgt := filepath.Join(tmp, "idmapped")
	if err := os.Mkdir(tgt, 0o755); err != nil {
		t.Fatal(err)
	}
	err = unix.MoveMount(fd, "", unix.AT_FDCWD, tgt, unix.MOVE_MOUNT_F_EMPTY_PATH)
	unix.Close(fd) // an open tree fd keeps the mount busy
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unix.Unmount(tgt, unix.MNT_DETACH) }()
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(tgt, diskUpperDir, "f"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != base || st.Gid != base {
		t.Fatalf("file owned by 0:0 on the disk shows as %d:%d through the idmapped clone, want %d", st.Uid, st.Gid, base)
	}
	if err := unix.Unmount(tgt, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Unmount(); err != nil {
		t.Fatal(err)
	}
	waitNoLoops(t, tmp)
}

func TestDiskSparse(t *testing.T) {
	tmp := needDisk(t)
	const size = 2 << 30
	state, img := filepath.Join(tmp, "state"), filepath.Join(tmp, DiskImageName)
	golden, err := goldenImage(state, size)
	if err != nil {
		t.Fatal(err)
	}
	if err := createDisk(state, img, size); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(img)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() != size || fi.Mode().Perm() != 0o600 {
		t.Fatalf("image: size %d mode %v", fi.Size(), fi.Mode())
	}
	empty := allocated(t, img)
	d := mustMount(t, img, filepath.Join(tmp, DiskMountName))
	var sfs unix.Statfs_t
	if err := unix.Statfs(d.Dir(), &sfs); err != nil {
		t.Fatal(err)
	}
	usable := int64(sfs.Bavail) * sfs.Bsize
	if err := os.WriteFile(filepath.Join(d.Upper(), "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := d.Unmount(); err != nil {
		t.Fatal(err)
	}
	used := allocated(t, img)
	t.Logf("2 GiB layer disk: golden allocates %.2f MiB, fresh copy %.2f MiB, after a mount, a write and an unmount %.2f MiB on the host; usable inside %.0f MiB",
		float64(allocated(t, golden))/(1<<20), float64(empty)/(1<<20), float64(used)/(1<<20), float64(usable)/(1<<20))
	if empty > 4<<20 || used > 8<<20 {
		t.Errorf("an empty 2 GiB disk allocates %d (fresh) / %d (used once) bytes", empty, used)
	}
	if usable < size*95/100 {
		t.Errorf("only %d of %d bytes usable inside", usable, size)
	}
	waitNoLoops(t, tmp)
}

func TestDiskPersistsAcrossRemount(t *testing.T) {
	tmp := needDisk(t)
	state, img, dir := filepath.Join(tmp, "state"), filepath.Join(tmp, DiskImageName), filepath.Join(tmp, DiskMountName)
	if err := createDisk(state, img, 64<<20); err != nil {
		t.Fatal(err)
	}
	if err := createDisk(state, img, 64<<20); !errors.Is(err, os.ErrExist) {
		t.Fatalf("createDisk over an existing layer: %v, want ErrExist", err)
	}
	d := mustMount(t, img, dir)
	if d.Upper() != filepath.Join(dir, "upper") || d.Work() != filepath.Join(dir, "work") || !strings.HasPrefix(d.Device(), "/dev/loop") {
		t.Fatalf("paths: %s %s %s", d.Upper(), d.Work(), d.Device())
	}
	var st unix.Stat_t
	for p, mode := range map[string]uint32{dir: 0o755, d.Upper(): 0o755, d.Work(): 0o700} {
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != 0 || st.Gid != 0 || st.Mode&0o7777 != mode || st.Dev != d.dev {
			t.Errorf("%s: uid %d gid %d mode %o dev %d (disk %d)", p, st.Uid, st.Gid, st.Mode&0o7777, st.Dev, d.dev)
		}
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if !slices.Equal(names, []string{"lost+found", "upper", "work"}) {
		t.Errorf("disk root holds %v", names)
	}
	// Mount options as promised.
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var line string
	for _, l := range strings.Split(string(mi), "\n") {
		if f := strings.Fields(l); len(f) > 4 && unescapeMount(f[4]) == dir {
			line = l
		}
	}
	for _, opt := range []string{"nosuid", "nodev", "noatime", " ext4 ", "errors=remount-ro", "discard"} {
		if !strings.Contains(line, opt) {
			t.Errorf("mount lacks %q: %s", opt, line)
		}
	}
	if err := os.WriteFile(filepath.Join(d.Upper(), "kept"), []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := d.Unmount(); err != nil {
		t.Fatal(err)
	}
	if err := d.Unmount(); err != nil {
		t.Fatalf("second Unmount: %v", err)
	}
	if m, err := isMountPoint(dir); err != nil || m {
		t.Fatalf("still mounted after Unmount: %v %v", m, err)
	}
	if _, err := os.Stat(filepath.Join(d.Upper(), "kept")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("file visible with the disk unmounted: %v", err)
	}
	waitNoLoops(t, tmp)

	d2 := mustMount(t, img, dir)
	if b, err := os.ReadFile(filepath.Join(d2.Upper(), "kept")); err != nil || string(b) != "data" {
		t.Fatalf("after remount: %q %v", b, err)
	}
	// A second mount on the same dir is refused.
	if d3, err := mountDisk(img, dir); err == nil {
		_ = d3.Unmount()
		t.Fatal("mountDisk over a mounted disk succeeded")
	}
	if err := d2.Unmount(); err != nil {
		t.Fatal(err)
	}
	waitNoLoops(t, tmp)
}
