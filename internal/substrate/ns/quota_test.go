//go:build linux

package ns

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

// TestDiskQuotaInSandbox: a sandbox writing past its disk quota gets
// ENOSPC inside, the host's free space drops by at most the quota, and
// what it wrote survives a stop and the next activation on the same Dir.
func TestDiskQuotaInSandbox(t *testing.T) {
	s := needRoot(t)
	if !s.quota {
		testenv.Skipf(t, "no disk quota here: %s", diskQuotaUnsupported())
	}
	const quota = 96 << 20
	inst, spec := start(t, substrate.Limits{DiskBytes: quota})
	var before syscall.Statfs_t
	if err := syscall.Statfs(spec.Dir, &before); err != nil {
		t.Fatal(err)
	}
	r := sh(t, inst, 1000, "dd if=/dev/zero of=/home/user/fill bs=1M count=400 2>&1; echo rc=$?; sync")
	if !strings.Contains(r.Out, "No space left on device") || strings.Contains(r.Out, "rc=0") {
		t.Fatalf("writing 400 MiB into a 96 MiB quota: %s", r.Out)
	}
	var after syscall.Statfs_t
	if err := syscall.Statfs(spec.Dir, &after); err != nil {
		t.Fatal(err)
	}
	used := (int64(before.Bavail) - int64(after.Bavail)) * before.Bsize
	t.Logf("host free space dropped by %.1f MiB for a %d MiB quota", float64(used)/(1<<20), quota>>20)
	if used > quota+(8<<20) {
		t.Fatalf("host free space dropped by %d bytes, more than the %d byte quota", used, quota)
	}
	// The sandbox still works (a full disk is the sandbox's problem only),
	// and frees space by deleting.
	mustOK(t, inst, 1000, "rm /home/user/fill && echo ok > /home/user/after")
	st, err := inst.Stats(context.Background())
	if err != nil || st.DiskTotal != quota {
		t.Fatalf("stats: %+v %v", st, err)
	}
	// Kept across a stop; the next activation on the same Dir sees it.
	inst2 := restartOnSameDir(t, s, inst, spec)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if out := mustOK(t, inst2, 1000, "cat /home/user/after"); out != "ok\n" {
		t.Fatalf("layer not kept: %q", out)
	}
	// A paused instance's layer is shared with PrepareLayer, not mounted
	// twice.
	upper, release, err := s.PrepareLayer(ctx, spec.Dir, spec.Limits)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(upper, "home/user/after")); err != nil || string(b) != "ok\n" {
		t.Fatalf("PrepareLayer of a running instance: %q %v", b, err)
	}
	if err := release(); err != nil {
		t.Fatal(err)
	}
	mustOK(t, inst2, 1000, "echo still > /home/user/still")
}

func TestWithoutDiskQuota(t *testing.T) {
	_, inst, spec := startWith(t, Config{StateDir: testState, NoDiskQuota: true, NoWarmInit: true})
	mustOK(t, inst, 0, "echo x > /root/x")
	if b, err := os.ReadFile(filepath.Join(spec.Dir, DiskMountName, diskUpperDir, "root/x")); err != nil || string(b) != "x\n" {
		t.Fatalf("plain layer: %q %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(spec.Dir, DiskImageName)); !os.IsNotExist(err) {
		t.Fatalf("a disk image was made with the quota off: %v", err)
	}
}

// restartOnSameDir stops inst and starts the next activation of spec on
// the same directory (stopped and checked when the test ends).
func restartOnSameDir(t *testing.T, s *Substrate, inst *instance, spec substrate.Spec) *instance {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	spec.Route.ActivationID = randID(4)
	in, err := s.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	next := in.(*instance)
	t.Cleanup(func() { stopAndCheck(t, next) })
	return next
}

// loopsBacking counts the loop devices attached to img.
func loopsBacking(t *testing.T, img string) int {
	t.Helper()
	ents, err := os.ReadDir("/sys/block")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if loopBacks("/dev/"+e.Name(), img) {
			n++
		}
	}
	return n
}

// TestLayerDiskNeverMountedTwice: with the disk attached at a directory
// (the fallback of kernels that cannot clone a detached mount), a warm
// init started while a sandbox's disk was mounted holds a copy of that
// mount in its namespace, so the disk's file system outlives the
// sandbox's Stop. The next activation on the same directory must not
// mount the image a second time meanwhile (two file systems on one image
// overwrite each other): it waits for the first to end, and sees every
// file the first wrote.
func TestLayerDiskNeverMountedTwice(t *testing.T) {
	s := needRoot(t)
	if !s.quota {
		testenv.Skipf(t, "no disk quota here: %s", diskQuotaUnsupported())
	}
	attachLayerDisks = true
	defer func() { attachLayerDisks = false }()
	inst, spec := start(t, substrate.Limits{})
	img := filepath.Join(spec.Dir, DiskImageName)
	mustOK(t, inst, 1000, "head -c 3000000 /dev/urandom > /home/user/data && sha256sum < /home/user/data > /home/user/sum")
	want := mustOK(t, inst, 1000, "cat /home/user/sum")
	deadline := time.Now().Add(10 * time.Second)
	for {
		s.warmMu.Lock()
		warm := s.warm != nil
		s.warmMu.Unlock()
		if warm || s.cgroups.v2 || s.cfg.NoWarmInit {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no warm init after a start")
		}
		time.Sleep(10 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("loop devices on the image after Stop: %d (a warm init's namespace holds a copy)", loopsBacking(t, img))
	spec.Route.ActivationID = randID(4)
	in2, err := s.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	inst2 := in2.(*instance)
	defer stopAndCheck(t, inst2)
	if n := loopsBacking(t, img); n != 1 {
		t.Fatalf("%d loop devices on %s: the image is mounted twice", n, img)
	}
	if got := mustOK(t, inst2, 1000, "sha256sum < /home/user/data"); got != want {
		t.Fatalf("data written before the stop: %q, want %q", got, want)
	}
}

// TestLayerDiskAttachedFallback: on a kernel that cannot clone a detached
// mount, the disk is attached at the activation dir's layer/ and cloned
// from there; a sandbox works the same and its files survive a restart.
func TestLayerDiskAttachedFallback(t *testing.T) {
	s := needRoot(t)
	if !s.quota {
		testenv.Skipf(t, "no disk quota here: %s", diskQuotaUnsupported())
	}
	attachLayerDisks = true
	defer func() { attachLayerDisks = false }()
	inst, spec := start(t, substrate.Limits{})
	mnt := filepath.Join(spec.Dir, DiskMountName)
	if ok, _ := isMountPoint(mnt); !ok {
		t.Fatal("the fallback did not attach the disk at layer/")
	}
	mustOK(t, inst, 1000, "echo kept > /home/user/kept")
	if b, err := os.ReadFile(filepath.Join(inst.LayerDir(), "home/user/kept")); err != nil || string(b) != "kept\n" {
		t.Fatalf("layer through the attached disk: %q %v", b, err)
	}
	// A mount namespace cloned now, by a process this substrate does not
	// know (another worker's warm init), holds a copy of the attached
	// disk: the restart must not wait for it to end (it never does here).
	holder := exec.Command("unshare", "--mount", "--propagation", "unchanged", "sleep", "600")
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { holder.Process.Kill(); holder.Wait() }()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		own, _ := os.Readlink("/proc/self/ns/mnt")
		if ns, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", holder.Process.Pid)); ns != "" && ns != own {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("unshare did not enter a mount namespace of its own")
		}
	}
	inst2 := restartOnSameDir(t, s, inst, spec)
	if out := mustOK(t, inst2, 1000, "cat /home/user/kept"); out != "kept\n" {
		t.Fatalf("after a restart: %q", out)
	}
}
