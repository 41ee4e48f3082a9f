//go:build linux

package ns

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestDiskConcurrentAttach(t *testing.T) {
	tmp := needDisk(t)
	state := filepath.Join(tmp, "state")
	const n = 8
	disks := make([]*layerDisk, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			img := filepath.Join(tmp, fmt.Sprintf("%d.img", i))
			if errs[i] = createDisk(state, img, 64<<20); errs[i] != nil {
				return
			}
			if disks[i], errs[i] = mountDisk(img, filepath.Join(tmp, fmt.Sprintf("m%d", i))); errs[i] != nil {
				return
			}
			errs[i] = os.WriteFile(filepath.Join(disks[i].Upper(), "id"), []byte{byte(i)}, 0o600)
		})
	}
	wg.Wait()
	defer func() {
		for _, d := range disks {
			if d != nil {
				_ = d.Unmount()
			}
		}
	}()
	devs := map[uint64]bool{}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("disk %d: %v", i, err)
		}
		devs[disks[i].dev] = true
	}
	if len(devs) != n || len(loopsFor(t, tmp)) != n {
		t.Fatalf("%d devices, %d loops bound (%v) for %d disks", len(devs), len(loopsFor(t, tmp)), loopsFor(t, tmp), n)
	}
	for i, d := range disks {
		if b, err := os.ReadFile(filepath.Join(d.Upper(), "id")); err != nil || len(b) != 1 || b[0] != byte(i) {
			t.Errorf("disk %d holds %v %v", i, b, err)
		}
	}
	for i := range n {
		wg.Go(func() { errs[i] = disks[i].Unmount() })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("unmount %d: %v", i, err)
		}
	}
	waitNoLoops(t, tmp)
}

func TestDiskUnmountBusyOrGone(t *testing.T) {
	tmp := needDisk(t)
	state, img, dir := filepath.Join(tmp, "state"), filepath.Join(tmp, DiskImageName), filepath.Join(tmp, DiskMountName)
	if err := createDisk(state, img, 64<<20); err != nil {
		t.Fatal(err)
	}

	// Busy: an open file keeps the file system (and the loop) alive after
	// a lazy unmount; closing it releases the loop device.
	d := mustMount(t, img, dir)
	f, err := os.Create(filepath.Join(d.Upper(), "open"))
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Unmount(); err != nil {
		f.Close()
		t.Fatalf("Unmount of a busy disk: %v", err)
	}
	if m, _ := isMountPoint(dir); m {
		f.Close()
		t.Fatal("busy disk still mounted at dir")
	}
	if l := loopsFor(t, tmp); len(l) != 1 {
		t.Errorf("loops while a file is open: %v, want the disk's", l)
	}
	if _, err := f.WriteString("still writable"); err != nil {
		t.Errorf("write to the open file: %v", err)
	}
	f.Close()
	waitNoLoops(t, tmp)

	// Gone: unmounted behind its back, then its mount point removed.
	d = mustMount(t, img, dir)
	if b, err := os.ReadFile(filepath.Join(d.Upper(), "open")); err != nil || string(b) != "still writable" {
		t.Errorf("write through the lazily unmounted disk lost: %q %v", b, err)
	}
	if err := unix.Unmount(dir, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Unmount(); err != nil {
		t.Fatalf("Unmount of an unmounted disk: %v", err)
	}
	waitNoLoops(t, tmp)
	d = mustMount(t, img, dir)
	if err := unix.Unmount(dir, 0); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(dir); err != nil {
		t.Fatal(err)
	}
	if err := d.Unmount(); err != nil {
		t.Fatalf("Unmount with the mount point gone: %v", err)
	}

	// Recovery by mount point only.
	d = mustMount(t, img, dir)
	if err := unmountDisk(dir); err != nil {
		t.Fatal(err)
	}
	if err := unmountDisk(dir); err != nil {
		t.Fatalf("unmountDisk of a plain dir: %v", err)
	}
	if err := d.Unmount(); err != nil {
		t.Fatal(err)
	}
	waitNoLoops(t, tmp)
}

func TestDiskGrow(t *testing.T) {
	tmp := needDisk(t)
	state, img, dir := filepath.Join(tmp, "state"), filepath.Join(tmp, DiskImageName), filepath.Join(tmp, DiskMountName)
	if err := createDisk(state, img, 64<<20); err != nil {
		t.Fatal(err)
	}
	d := mustMount(t, img, dir)
	capacity := func() int64 {
		var s unix.Statfs_t
		if err := unix.Statfs(d.Dir(), &s); err != nil {
			t.Fatal(err)
		}
		return int64(s.Blocks) * s.Bsize
	}
	before := capacity()
	if err := os.WriteFile(filepath.Join(d.Upper(), "kept"), []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := growDisk(img, 256<<20); err == nil {
		t.Error("growDisk of a mounted disk accepted")
	}
	if err := d.Unmount(); err != nil {
		t.Fatal(err)
	}
	waitNoLoops(t, tmp)
	if err := growDisk(img, 32<<20); err == nil {
		t.Fatal("shrink accepted")
	}
	if err := growDisk(img, 64<<20); err != nil {
		t.Fatalf("same size: %v", err)
	}
	// 64 MiB -> 9 GiB: past what the first group descriptor block covers
	// (8 GiB), so resize2fs has to make room without a resize inode.
	a := time.Now()
	if err := growDisk(img, 9<<30); err != nil {
		t.Fatal(err)
	}
	took := time.Since(a)
	d = mustMount(t, img, dir)
	after := capacity()
	t.Logf("growDisk 64 MiB -> 9 GiB: %v; capacity %d -> %d MiB; image allocates %.1f MiB", took.Round(time.Millisecond), before>>20, after>>20, float64(allocated(t, img))/(1<<20))
	if after < 9<<30*97/100 {
		t.Fatalf("capacity after growing to 9 GiB: %d", after)
	}
	if b, err := os.ReadFile(filepath.Join(d.Upper(), "kept")); err != nil || string(b) != "data" {
		t.Fatalf("after grow: %q %v", b, err)
	}
	// The new space is usable: more than the old size fits now.
	f, err := os.Create(filepath.Join(d.Upper(), "big"))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	for range 100 {
		if _, err := f.Write(buf); err != nil {
			f.Close()
			t.Fatal(err)
		}
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Unmount(); err != nil {
		t.Fatal(err)
	}
	waitNoLoops(t, tmp)
}

func TestDiskErrors(t *testing.T) {
	for _, size := range []int64{0, -1, 16 << 20, 64<<20 + 1} {
		if err := checkDiskSize(size); err == nil {
			t.Errorf("size %d accepted", size)
		}
	}
	oldDirs := e2fsDirs
	e2fsDirs = nil
	t.Setenv("PATH", t.TempDir())
	err := createDisk(t.TempDir(), filepath.Join(t.TempDir(), "x.img"), 64<<20)
	e2fsDirs = oldDirs
	if err == nil || !strings.Contains(err.Error(), "e2fsprogs") {
		t.Fatalf("without mkfs.ext4: %v, want an error naming e2fsprogs", err)
	}

	tmp := needDisk(t)
	// Not an image we formatted: a zero-filled file of a valid size fails
	// to mount and leaves no loop device behind.
	junk := filepath.Join(tmp, "junk.img")
	if err := os.WriteFile(junk, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(junk, 64<<20); err != nil {
		t.Fatal(err)
	}
	if d, err := mountDisk(junk, filepath.Join(tmp, "m")); err == nil {
		_ = d.Unmount()
		t.Fatal("a zero-filled image mounted")
	}
	odd := filepath.Join(tmp, "odd.img")
	if err := os.WriteFile(odd, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := mountDisk(odd, filepath.Join(tmp, "m")); err == nil {
		t.Fatal("a 1-byte image accepted")
	}
	if _, err := mountDisk(filepath.Join(tmp, "missing.img"), filepath.Join(tmp, "m")); err == nil {
		t.Fatal("a missing image accepted")
	}
	waitNoLoops(t, tmp)
}

// TestDiskTiming measures what the disk adds to the sandbox create path
// (createDisk with the golden image cached + mountDisk) and to Stop
// (Unmount), 20 runs, on 4 GiB disks (DefaultDiskSizeMB).
func TestDiskTiming(t *testing.T) {
	tmp := needDisk(t)
	state := filepath.Join(tmp, "state")
	const size = DefaultDiskSizeMB << 20
	unix.Sync() // no writeback of earlier tests' data in the numbers
	t0 := time.Now()
	if _, err := goldenImage(state, size); err != nil {
		t.Fatal(err)
	}
	format := time.Since(t0)
	const runs = 20
	var create, mount, unmount, total []time.Duration
	for i := range runs {
		img, dir := filepath.Join(tmp, fmt.Sprintf("%d.img", i)), filepath.Join(tmp, fmt.Sprintf("m%d", i))
		a := time.Now()
		if err := createDisk(state, img, size); err != nil {
			t.Fatal(err)
		}
		b := time.Now()
		d, err := mountDisk(img, dir)
		if err != nil {
			t.Fatal(err)
		}
		c := time.Now()
		if err := d.Unmount(); err != nil {
			t.Fatal(err)
		}
		e := time.Now()
		create, mount, unmount, total = append(create, b.Sub(a)), append(mount, c.Sub(b)), append(unmount, e.Sub(c)), append(total, e.Sub(a))
	}
	// Remounting a used disk (the next activation on the same Dir).
	var remount []time.Duration
	for i := range runs {
		a := time.Now()
		d, err := mountDisk(filepath.Join(tmp, fmt.Sprintf("%d.img", i)), filepath.Join(tmp, fmt.Sprintf("m%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		remount = append(remount, time.Since(a))
		if err := d.Unmount(); err != nil {
			t.Fatal(err)
		}
	}
	pct := func(ds []time.Duration, p int) time.Duration {
		s := slices.Clone(ds)
		slices.Sort(s)
		return s[(len(s)-1)*p/100].Round(10 * time.Microsecond)
	}
	t.Logf("layer disk %d MiB, %d runs: golden format (once) %v", size>>20, runs, format.Round(time.Millisecond))
	for _, r := range []struct {
		name string
		ds   []time.Duration
	}{{"createDisk (golden cached)", create}, {"mountDisk", mount}, {"Unmount", unmount}, {"create+mount+unmount", total}, {"mountDisk (used disk)", remount}} {
		t.Logf("  %-28s p50 %-9v p90 %-9v max %v", r.name, pct(r.ds, 50), pct(r.ds, 90), pct(r.ds, 100))
	}
	waitNoLoops(t, tmp)
}
