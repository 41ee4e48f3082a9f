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

// fsUsed is the used bytes of the file system holding dir, as df counts
// them (blocks minus free blocks).
func fsUsed(dir string) (int64, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return 0, fmt.Errorf("ns: disk usage: %w", err)
	}
	return int64(fs.Blocks-fs.Bfree) * fs.Bsize, nil
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
