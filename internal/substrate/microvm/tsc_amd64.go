package microvm

import (
	"runtime"
	"slices"
	"time"
)

func rdtsc() uint64

// hostTSCKHz measures the host's time stamp counter frequency in kHz
// (median of three 30 ms samples, each bracketed by the monotonic clock on
// one locked thread). Under TCG the guest's rdtsc reads the host's counter,
// so the guest kernel is told this frequency (tsc_early_khz) instead of
// calibrating it against the emulated PIT: on a loaded host that
// calibration fails now and then and the boot then hangs in the delay-loop
// calibration. Requires an invariant TSC on the host (constant_tsc,
// nonstop_tsc), which every x86 host of the last decade has.
func hostTSCKHz() uint64 {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var samples []uint64
	for range 3 {
		t0, c0 := time.Now(), rdtsc()
		time.Sleep(30 * time.Millisecond)
		t1, c1 := time.Now(), rdtsc()
		if ns := t1.Sub(t0).Nanoseconds(); ns > 0 && c1 > c0 {
			samples = append(samples, (c1-c0)*1_000_000/uint64(ns))
		}
	}
	if len(samples) == 0 {
		return 0
	}
	slices.Sort(samples)
	return samples[len(samples)/2]
}
