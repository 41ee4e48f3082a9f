//go:build linux

package ns

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/internal/volume"
)

func volumeManager(t *testing.T, size int64) *volume.Manager {
	t.Helper()
	needRoot(t)
	if why := volume.Unsupported(); why != "" {
		testenv.Skipf(t, "volumes unsupported here: %s", why)
	}
	m, err := volume.New(volume.Config{Root: filepath.Join(t.TempDir(), "volumes"), SizeBytes: size})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// startWithVolumes starts a sandbox with volume ids mounted at paths, the
// way sbx-manager does: acquired for the start, released once it runs.
func startWithVolumes(t *testing.T, m *volume.Manager, ids, paths []string) (*instance, error) {
	t.Helper()
	s := needRoot(t)
	spec := newSpec(t, substrate.Limits{})
	for i, id := range ids {
		dir, release, err := m.Acquire(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		spec.Volumes = append(spec.Volumes, substrate.VolumeMount{Name: "v" + id[4:8], Source: dir, Path: paths[i]})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	in, err := s.Start(ctx, spec)
	if err != nil {
		return nil, err
	}
	inst := in.(*instance)
	t.Cleanup(func() { stopAndCheck(t, inst) })
	return inst, nil
}

// Two sandboxes mount one volume at once: what one writes the other reads
// (one file system), owned by `user` inside both whatever their uid
// ranges, nosuid and nodev; the quota gives ENOSPC inside; the files
// survive both sandboxes and are read by a third.
func TestVolumeSharedBetweenSandboxes(t *testing.T) {
	m := volumeManager(t, 48<<20)
	id := volume.NewID()
	a, err := startWithVolumes(t, m, []string{id}, []string{"/mnt/data"})
	if err != nil {
		t.Fatal(err)
	}
	b, err := startWithVolumes(t, m, []string{id}, []string{"/home/user/shared"})
	if err != nil {
		t.Fatal(err)
	}
	mustOK(t, a, 1000, "echo from-a > /mnt/data/note && mkdir /mnt/data/dir")
	if out := mustOK(t, b, 1000, "cat /home/user/shared/note; stat -c '%u:%g %a' /home/user/shared /home/user/shared/note"); out != "from-a\n1000:1000 755\n1000:1000 644\n" {
		t.Fatalf("second sandbox sees %q", out)
	}
	// POSIX between them: an append from each lands in one file.
	mustOK(t, b, 1000, "echo from-b >> /home/user/shared/note")
	if out := mustOK(t, a, 1000, "cat /mnt/data/note"); out != "from-a\nfrom-b\n" {
		t.Fatalf("first sandbox sees %q", out)
	}
	opts := mustOK(t, a, 0, "awk '$5==\"/mnt/data\"{print $6}' /proc/self/mountinfo")
	if !strings.Contains(opts, "nosuid") || !strings.Contains(opts, "nodev") {
		t.Fatalf("volume mount options %q", opts)
	}
	// Root inside is the namespace's root: it may chown on the volume, and
	// what it makes is stored as 0 on disk, not as a host uid.
	mustOK(t, a, 0, "touch /mnt/data/rootfile")
	// The quota.
	r := sh(t, a, 1000, "dd if=/dev/zero of=/mnt/data/fill bs=1M count=100 2>&1; echo rc=$?; sync")
	if !strings.Contains(r.Out, "No space left on device") || strings.Contains(r.Out, "rc=0") {
		t.Fatalf("writing 100 MiB into a 48 MiB volume: %s", r.Out)
	}
	mustOK(t, b, 1000, "rm /home/user/shared/fill")
	// Both gone: the files stay.
	stopAndCheck(t, a)
	stopAndCheck(t, b)
	c, err := startWithVolumes(t, m, []string{id}, []string{"/data"})
	if err != nil {
		t.Fatal(err)
	}
	if out := mustOK(t, c, 1000, "cat /data/note; stat -c %u /data/rootfile"); out != "from-a\nfrom-b\n0\n" {
		t.Fatalf("after both sandboxes ended: %q", out)
	}
	// On disk the owners are the inside ids (host view through the
	// manager's own mount).
	dir, release, err := m.Acquire(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(dir, "note"), &st); err != nil || st.Uid != 1000 {
		t.Fatalf("on disk: uid %d %v", st.Uid, err)
	}
}

// Mount paths that would escape or shadow what the platform owns are
// refused before anything starts, and paths through a symlink or another
// mount of the image are refused by the init; a failed start leaves
// nothing behind.
func TestVolumePathRejected(t *testing.T) {
	m := volumeManager(t, 16<<20)
	id := volume.NewID()
	for _, p := range []string{"relative", "/", "/proc/x", "/sys", "/dev/v", "/.space", "/a/../b", "/mnt/"} {
		if _, err := startWithVolumes(t, m, []string{id}, []string{p}); err == nil {
			t.Errorf("path %q accepted", p)
		}
	}
	if _, err := startWithVolumes(t, m, []string{id, id}, []string{"/mnt/a", "/mnt/a/b"}); err == nil {
		t.Error("nested paths accepted")
	}
	// Found only inside the image: a symlink on the way (/bin -> usr/bin
	// in a merged-/usr Debian, or one made for the test) and a mount
	// (/usr, bound read-only).
	probe, err := startWithVolumes(t, m, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	link := strings.TrimSpace(mustOK(t, probe, 0, "for d in /bin /lib /sbin; do [ -L $d ] && { echo $d; break; }; done; true"))
	if _, err := startWithVolumes(t, m, []string{id}, []string{"/usr/local/vol"}); err == nil || !strings.Contains(err.Error(), "another mount") {
		t.Errorf("path through the /usr mount: %v", err)
	}
	if link != "" {
		_, err := startWithVolumes(t, m, []string{id}, []string{link + "/vol"})
		if err == nil || !strings.Contains(err.Error(), "not a directory") {
			t.Errorf("path through the symlink %s: %v", link, err)
		}
	} else {
		t.Log("the template has no top-level symlink; the symlink case is covered by TestVolumeMountPointRefusesSymlinks")
	}
}

// volumeMountPoint refuses a symlink anywhere on the way and a file, and
// makes missing directories.
func TestVolumeMountPointRefusesSymlinks(t *testing.T) {
	testenv.RequireRoot(t, "openat2 beneath a directory")
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "real"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc", filepath.Join(root, "esc")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("real", filepath.Join(root, "rel")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "file"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(rfd)
	for _, p := range []string{"/esc", "/esc/x", "/rel/x", "/file", "/file/x"} {
		if fd, err := volumeMountPoint(rfd, p); err == nil {
			unix.Close(fd)
			t.Errorf("%s accepted", p)
		}
	}
	fd, err := volumeMountPoint(rfd, "/real/new/deeper")
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	if fi, err := os.Lstat(filepath.Join(root, "real/new/deeper")); err != nil || !fi.IsDir() {
		t.Fatalf("mount point not made: %v", err)
	}
	if _, err := os.Lstat("/etc/x"); err == nil {
		t.Fatal("escaped")
	}
}

// Without user namespaces the volume is bound as it is (host ids are the
// sandbox's), still nosuid and nodev.
func TestVolumeWithoutUserNamespace(t *testing.T) {
	m := volumeManager(t, 16<<20)
	needRoot(t)
	s, err := New(Config{StateDir: testState, NoUserNamespaces: true, NoWarmInit: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	id := volume.NewID()
	dir, release, err := m.Acquire(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	spec := newSpec(t, substrate.Limits{})
	spec.Volumes = []substrate.VolumeMount{{Name: "v", Source: dir, Path: "/mnt/v"}, {Name: "ro", Source: dir, Path: "/mnt/ro", ReadOnly: true}}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	in, err := s.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	inst := in.(*instance)
	t.Cleanup(func() { stopAndCheck(t, inst) })
	mustOK(t, inst, 1000, "echo x > /mnt/v/f")
	if out := mustFail(t, inst, 1000, "echo y > /mnt/ro/g"); !strings.Contains(out, "Read-only") {
		t.Fatalf("read-only mount: %s", out)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(dir, "f"), &st); err != nil || st.Uid != 1000 {
		t.Fatalf("on disk: %+v %v", st, err)
	}
}
