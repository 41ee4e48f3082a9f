//go:build linux

package ns

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/substrate"
)

// Stats sampling. A CPU percentage needs two readings of the groups' CPU
// time: Stats uses the previous call's reading when it is between
// cpuSampleMin and cpuSampleMax old, and otherwise takes two readings
// cpuSampleMin apart.
const (
	cpuSampleMin = 100 * time.Millisecond
	cpuSampleMax = 10 * time.Second
)

var _ substrate.StatsReporter = (*instance)(nil)

// cpuReading is the sandbox's total CPU time at a moment.
type cpuReading struct {
	at    time.Time
	usage time.Duration
}

// Stats samples the sandbox's usage:
//
//   - memory: the sum over the sandbox's groups (user and agent, where
//     they are separate in the memory hierarchy) of v1 memory.usage_in_bytes
//     / v2 memory.current; MemCache from memory.stat (v1 "cache", v2
//     "file"); MemTotal is the sandbox's memory limit;
//   - CPU: the groups' CPU time (v1 cpuacct.usage where cpuacct is mounted
//     with cpu, v2 cpu.stat usage_usec) over the sampling interval, in
//     percent of one core; CPUCount is the CPU limit rounded up to cores;
//   - disk: the bytes of the regular files and symlinks of the writable
//     layer (Spec.Dir/upper); DiskTotal is 0 (the ns substrate has no disk
//     quota).
//
// It works on a paused sandbox too (CPU then reads 0).
func (i *instance) Stats(ctx context.Context) (substrate.Stats, error) {
	i.mu.Lock()
	stopped := i.stopped
	i.mu.Unlock()
	if stopped {
		return substrate.Stats{}, errors.New("ns: sandbox stopped")
	}
	i.statsMu.Lock()
	defer i.statsMu.Unlock()

	st := substrate.Stats{
		CPUCount: int((i.lim.CPUMillis + 999) / 1000),
		MemTotal: i.lim.MemoryBytes,
	}
	if st.CPUCount < 1 {
		st.CPUCount = 1
	}
	cur, ok := i.cg.cpuUsage()
	if ok {
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
			if cur, ok = i.cg.cpuUsage(); !ok {
				return substrate.Stats{}, errors.New("ns: cpu usage vanished (sandbox stopped?)")
			}
		}
		if dt := cur.at.Sub(prev.at); dt > 0 && cur.usage >= prev.usage {
			st.CPUUsedPct = 100 * float64(cur.usage-prev.usage) / float64(dt)
			if max := float64(100 * st.CPUCount); st.CPUUsedPct > max {
				st.CPUUsedPct = max
			}
		}
		i.lastCPU = cur
	}
	used, cache, err := i.cg.memoryUsage()
	if err != nil {
		return substrate.Stats{}, err
	}
	st.MemUsed, st.MemCache = used, cache
	if st.DiskUsed, err = dirBytes(ctx, i.LayerDir()); err != nil {
		return substrate.Stats{}, err
	}
	if i.s.quota {
		st.DiskTotal = diskSize(i.lim.DiskBytes)
	}
	st.Timestamp = time.Now()
	return st, nil
}

// cpuUsage sums the CPU time of the groups; ok is false when no group
// accounts CPU time (v1 with cpuacct mounted apart from cpu).
func (cg *cgroup) cpuUsage() (cpuReading, bool) {
	r := cpuReading{at: time.Now()}
	found := false
	for _, d := range cg.dirs {
		if cg.v2 {
			v, err := statField(filepath.Join(d, "cpu.stat"), "usage_usec")
			if err != nil {
				continue
			}
			r.usage += time.Duration(v) * time.Microsecond
			found = true
			continue
		}
		v, err := readInt(filepath.Join(d, "cpuacct.usage"))
		if err != nil {
			continue
		}
		r.usage += time.Duration(v) // nanoseconds
		found = true
	}
	return r, found
}

// memoryUsage sums the memory charged to the groups and its page cache.
func (cg *cgroup) memoryUsage() (used, cache int64, err error) {
	cur, cacheKey := "memory.usage_in_bytes", "cache"
	if cg.v2 {
		cur, cacheKey = "memory.current", "file"
	}
	found := false
	for _, d := range cg.dirs {
		v, err := readInt(filepath.Join(d, cur))
		if err != nil {
			continue
		}
		used += v
		found = true
		if c, err := statField(filepath.Join(d, "memory.stat"), cacheKey); err == nil {
			cache += c
		}
	}
	if !found {
		return 0, 0, errors.New("ns: no memory accounting found for the sandbox (stopped?)")
	}
	return used, cache, nil
}

func readInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(string(bytes.TrimSpace(b)), 10, 64)
}

// statField reads "key value" from a flat-keyed cgroup file.
func statField(path, key string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if ok && k == key {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("%s: no %q", path, key)
}

// dirBytes sums the bytes allocated (st_blocks) to the files,
// directories and symlinks under dir. dir is a live writable layer that
// the sandbox changes while this runs, so the walk never resolves a path:
// each directory is opened relative to its parent's descriptor with
// O_NOFOLLOW, and a directory swapped for a symlink (renameat2
// RENAME_EXCHANGE) between listing and opening is not entered. Allocated
// rather than apparent sizes: a sparse file costs what it uses. Entries
// that vanish during the walk are skipped.
func dirBytes(ctx context.Context, dir string) (int64, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return 0, nil
		}
		return 0, fmt.Errorf("ns: disk usage: %w", err)
	}
	var n int64
	if err := walkFD(ctx, fd, &n, 0); err != nil {
		return 0, fmt.Errorf("ns: disk usage: %w", err)
	}
	return n, nil
}

// maxWalkDepth bounds the recursion (and so the descriptors held) of a
// hostile, deeply nested layer; deeper entries are not counted.
const maxWalkDepth = 256

// walkFD adds the usage under the directory fd (which it closes) to n.
func walkFD(ctx context.Context, fd int, n *int64, depth int) error {
	d := os.NewFile(uintptr(fd), "layer")
	defer d.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	*n += st.Blocks * 512
	for {
		names, err := d.Readdirnames(512)
		for _, name := range names {
			if err := ctx.Err(); err != nil {
				return err
			}
			var st unix.Stat_t
			if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				if errors.Is(err, unix.ENOENT) {
					continue
				}
				return err
			}
			if st.Mode&unix.S_IFMT != unix.S_IFDIR {
				*n += st.Blocks * 512
				continue
			}
			if depth >= maxWalkDepth {
				continue
			}
			cfd, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				// Gone, or no longer a directory (now a symlink: ELOOP or
				// ENOTDIR): not ours to follow.
				if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
					continue
				}
				return err
			}
			if err := walkFD(ctx, cfd, n, depth+1); err != nil {
				return err
			}
		}
		if err == io.EOF || (err == nil && len(names) == 0) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}
