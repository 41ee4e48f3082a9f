//go:build linux

package ns

import (
	"context"
	"testing"
	"time"

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
	if s0.CPUCount != 2 || s0.MemTotal != 256<<20 || s0.MemUsed <= 0 || s0.DiskTotal != 0 {
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
