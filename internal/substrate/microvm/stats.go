//go:build linux

package microvm

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/substrate"
)

// Stats sampling: a CPU percentage needs two readings; Stats reuses the
// previous call's reading when it is between cpuSampleMin and cpuSampleMax
// old and otherwise takes two readings cpuSampleMin apart.
const (
	cpuSampleMin = 100 * time.Millisecond
	cpuSampleMax = 10 * time.Second
)

type cpuReading struct {
	at    time.Time
	usage time.Duration
}

// clkTck is USER_HZ, 100 on every Linux architecture SPACE runs on.
const clkTck = 100

// Stats samples the VM from the host's side:
//
//   - CPU: QEMU's user+system time (/proc/<pid>/stat) over the interval,
//     in percent of one core; CPUCount is the vCPU count;
//   - memory: MemTotal is the guest's memory; MemUsed is the resident part
//     of QEMU's mapping of guest RAM (the anonymous mapping of exactly
//     MemTotal bytes in /proc/<pid>/smaps; QEMU's whole resident set,
//     capped at MemTotal, if it cannot be found): the guest pages ever
//     touched, an upper bound of what the guest uses, since a guest gives
//     no page back without a balloon; MemCache is 0 (not visible from the
//     host);
//   - disk: an image VM's layer disk: DiskTotal its size, DiskUsed the
//     host blocks its file holds (what the guest wrote, file system
//     metadata included; blocks the guest freed count until it discards
//     them); 0 and 0 for a busybox VM (files live in guest memory).
func (i *instance) Stats(ctx context.Context) (substrate.Stats, error) {
	i.mu.Lock()
	err := i.live()
	i.mu.Unlock()
	if err != nil {
		return substrate.Stats{}, err
	}
	i.statsMu.Lock()
	defer i.statsMu.Unlock()
	cur, err := readProcCPU(i.pid)
	if err != nil {
		return substrate.Stats{}, err
	}
	prev := i.lastCPU
	if age := cur.at.Sub(prev.at); prev.at.IsZero() || age < cpuSampleMin || age > cpuSampleMax {
		prev = cur
		t := time.NewTimer(cpuSampleMin)
		select {
		case <-ctx.Done():
			t.Stop()
			return substrate.Stats{}, ctx.Err()
		case <-t.C:
		}
		if cur, err = readProcCPU(i.pid); err != nil {
			return substrate.Stats{}, err
		}
	}
	i.lastCPU = cur
	st := substrate.Stats{
		Timestamp: cur.at,
		CPUCount:  i.shape.VCPUs,
		MemTotal:  i.shape.MemoryMiB << 20,
	}
	if d := cur.at.Sub(prev.at); d > 0 {
		st.CPUUsedPct = 100 * float64(cur.usage-prev.usage) / float64(d)
	}
	if rss, err := guestRAMResident(i.pid, st.MemTotal); err == nil {
		st.MemUsed = rss
	} else if rss, err := readRSS(i.pid); err == nil {
		st.MemUsed = min(rss, st.MemTotal)
	}
	if i.layerPath != "" {
		var fst unix.Stat_t
		if err := unix.Stat(i.layerPath, &fst); err == nil {
			st.DiskTotal, st.DiskUsed = fst.Size, min(fst.Blocks*512, fst.Size)
		}
	}
	return st, nil
}

func readProcCPU(pid int) (cpuReading, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return cpuReading{}, fmt.Errorf("microvm: stats: %w", err)
	}
	at := time.Now()
	// Fields after the parenthesized command: state is field 3, utime 14,
	// stime 15.
	s := string(b)
	end := strings.LastIndexByte(s, ')')
	if end < 0 {
		return cpuReading{}, fmt.Errorf("microvm: stats: malformed /proc/%d/stat", pid)
	}
	f := strings.Fields(s[end+1:])
	if len(f) < 13 {
		return cpuReading{}, fmt.Errorf("microvm: stats: malformed /proc/%d/stat", pid)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	stt, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return cpuReading{}, fmt.Errorf("microvm: stats: malformed /proc/%d/stat", pid)
	}
	return cpuReading{at: at, usage: time.Duration(ut+stt) * time.Second / clkTck}, nil
}

func readRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/statm", pid))
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return 0, fmt.Errorf("malformed statm")
	}
	pages, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil {
		return 0, err
	}
	return pages * int64(os.Getpagesize()), nil
}

// guestRAMResident returns the resident bytes of pid's mapping of exactly
// size bytes (QEMU's guest RAM block).
func guestRAMResident(pid int, size int64) (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	var inRAM bool
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		kb := func() int64 {
			n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return n << 10
		}
		switch k {
		case "Size":
			inRAM = kb() == size
		case "Rss":
			if inRAM {
				return kb(), nil
			}
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("microvm: no guest RAM mapping of %d bytes in qemu %d", size, pid)
}
