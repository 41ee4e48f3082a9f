//go:build linux

package ns

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/substrate"
)

func TestStats(t *testing.T) {
	inst, _ := start(t, substrate.Limits{MemoryBytes: 256 << 20, CPUMillis: 1500})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var sr substrate.StatsReporter = inst
	s0, err := sr.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantDisk := int64(0) // no quota: no capacity to report
	if inst.s.quota {
		wantDisk = DefaultDiskSizeMB << 20
	}
	if s0.CPUCount != 2 || s0.MemTotal != 256<<20 || s0.MemUsed <= 0 || s0.DiskTotal != wantDisk {
		t.Fatalf("baseline %+v", s0)
	}
	if time.Since(s0.Timestamp) > 5*time.Second {
		t.Fatalf("timestamp %v", s0.Timestamp)
	}
	// 32 MiB of shared memory (charged to the sandbox, kept), a 1 MiB file
	// in the writable layer, and a CPU spin for a moment.
	mustOK(t, inst, 0, "head -c 33554432 /dev/zero > /dev/shm/fill && head -c 1048576 /dev/urandom > /tmp/disk-fill && sync")
	mustOK(t, inst, 0, "setsid sh -c 'end=$(($(date +%s)+3)); while [ $(date +%s) -lt $end ]; do :; done' </dev/null >/dev/null 2>&1 &")
	time.Sleep(300 * time.Millisecond)
	s1, err := sr.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s1.MemUsed < s0.MemUsed+(24<<20) {
		t.Errorf("memUsed did not grow by the 32 MiB in /dev/shm: %d -> %d", s0.MemUsed, s1.MemUsed)
	}
	if s1.DiskUsed < s0.DiskUsed+(1<<20) {
		t.Errorf("diskUsed did not grow by the 1 MiB file: %d -> %d", s0.DiskUsed, s1.DiskUsed)
	}
	if s1.CPUUsedPct <= 0 || s1.CPUUsedPct > 100*float64(s1.CPUCount) {
		t.Errorf("cpuUsedPct while spinning: %v", s1.CPUUsedPct)
	}
	// A paused sandbox still reports (its CPU reads ~0).
	if err := inst.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(150 * time.Millisecond)
	s2, err := sr.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s2.MemUsed <= 0 || s2.CPUUsedPct > 5 {
		t.Errorf("paused stats %+v", s2)
	}
	if err := inst.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if err := inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := sr.Stats(ctx); err == nil {
		t.Error("Stats after Stop succeeded")
	}
}

// TestDirBytesDoesNotFollowSwappedSymlinks swaps a directory of the layer
// with a symlink to a host directory (renameat2 RENAME_EXCHANGE) as fast
// as it can while the usage is read: no reading may count the host
// directory's file.
func TestDirBytesDoesNotFollowSwappedSymlinks(t *testing.T) {
	layer, host := t.TempDir(), t.TempDir()
	if err := os.WriteFile(filepath.Join(host, "big"), make([]byte, 8<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(layer, "a", "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(layer, "a", "sub", "small"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(host, filepath.Join(layer, "b")); err != nil {
		t.Fatal(err)
	}
	// A sparse file counts what it uses, not its length.
	f, err := os.Create(filepath.Join(layer, "sparse"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(2 << 30); err != nil {
		t.Fatal(err)
	}
	f.Close()
	stop := make(chan struct{})
	done := make(chan int)
	go func() {
		swaps := 0
		for {
			select {
			case <-stop:
				done <- swaps
				return
			default:
			}
			if err := unix.Renameat2(unix.AT_FDCWD, filepath.Join(layer, "a"), unix.AT_FDCWD, filepath.Join(layer, "b"), unix.RENAME_EXCHANGE); err == nil {
				swaps++
			}
		}
	}()
	var max int64
	for i := 0; i < 2000; i++ {
		n, err := dirBytes(context.Background(), layer)
		if err != nil {
			close(stop)
			<-done
			t.Fatal(err)
		}
		if n > max {
			max = n
		}
	}
	close(stop)
	if swaps := <-done; swaps < 100 {
		t.Fatalf("only %d swaps happened: the race was not exercised", swaps)
	}
	if max >= 1<<20 {
		t.Fatalf("usage read %d bytes: the walk followed a symlink out of the layer (or counted the sparse file's length)", max)
	}
}

// The worker's sampler calls Stats on its own schedule, so a Stop can come
// in the middle of one (run with -race: Stop's cgroup removal and Stats'
// reads of the groups once raced).
func TestStatsDuringStop(t *testing.T) {
	inst, _ := start(t, substrate.Limits{MemoryBytes: 256 << 20, CPUMillis: 1000})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			if _, err := inst.Stats(ctx); err != nil {
				return // stopped
			}
		}
	}()
	time.Sleep(150 * time.Millisecond)
	if err := inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	<-done
	if _, err := inst.Stats(ctx); err == nil {
		t.Fatal("Stats of a stopped sandbox answered")
	}
}
