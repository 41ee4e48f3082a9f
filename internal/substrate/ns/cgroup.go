//go:build linux

package ns

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spacesbx/space/internal/substrate"
)

const cgroupRoot = "/sys/fs/cgroup"

// cgroupLayout says where the hierarchies are.
type cgroupLayout struct {
	v2 bool
	// v2: the unified mount; v1: controller name -> mount point.
	unified string
	v1      map[string]string
}

// v1Controllers are the v1 controllers a sandbox needs.
var v1Controllers = []string{"memory", "pids", "cpu", "freezer"}

// detectCgroups finds the cgroup layout of the host: pure v2 when
// /sys/fs/cgroup/cgroup.controllers exists, v1 (possibly hybrid, in which
// case the unified hierarchy is ignored) otherwise.
func detectCgroups() (*cgroupLayout, error) {
	if _, err := os.Stat(filepath.Join(cgroupRoot, "cgroup.controllers")); err == nil {
		return &cgroupLayout{v2: true, unified: cgroupRoot}, nil
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	l := &cgroupLayout{v1: map[string]string{}}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// id parent maj:min root mountpoint opts [optional...] - fstype source superopts
		line := sc.Text()
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		pf, sf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(sf) < 3 || sf[0] != "cgroup" {
			continue
		}
		for _, o := range strings.Split(sf[2], ",") {
			for _, c := range v1Controllers {
				if o == c {
					if _, dup := l.v1[c]; !dup {
						l.v1[c] = unescapeMount(pf[4])
					}
				}
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	for _, c := range v1Controllers {
		if l.v1[c] == "" {
			return nil, fmt.Errorf("ns: cgroup v1 controller %q is not mounted", c)
		}
	}
	return l, nil
}

// unescapeMount undoes the octal escapes of /proc/self/mountinfo.
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// cgroup is one sandbox's group in every hierarchy it uses.
type cgroup struct {
	v2 bool
	// dirs holds the group directories; for v1 one per distinct mount,
	// in v1Controllers order (the freezer's is freezerDir).
	dirs       []string
	freezerDir string
}

// createCgroup creates <parent>/<name> in every needed hierarchy and
// applies lim. On error it removes what it created.
func createCgroup(l *cgroupLayout, parent, name string, lim substrate.Limits) (_ *cgroup, err error) {
	cg := &cgroup{v2: l.v2}
	defer func() {
		if err != nil {
			_ = cg.remove(context.Background())
		}
	}()
	if l.v2 {
		if err := enableV2Controllers(l.unified, parent); err != nil {
			return nil, err
		}
		dir := filepath.Join(l.unified, parent, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			return nil, fmt.Errorf("ns: create cgroup: %w", err)
		}
		cg.dirs, cg.freezerDir = []string{dir}, dir
		writes := [][2]string{
			{"memory.max", strconv.FormatInt(lim.MemoryBytes, 10)},
			{"memory.swap.max", "0"},
			{"pids.max", strconv.FormatInt(lim.Pids, 10)},
			{"cpu.max", fmt.Sprintf("%d 100000", lim.CPUMillis*100)},
		}
		for _, w := range writes {
			if err := writeCgroupFile(dir, w[0], w[1]); err != nil {
				if w[0] == "memory.swap.max" && errors.Is(err, os.ErrNotExist) {
					continue // kernel without swap accounting: no swap to limit
				}
				return nil, err
			}
		}
		return cg, nil
	}
	seen := map[string]string{}
	for _, c := range v1Controllers {
		mnt := l.v1[c]
		dir, ok := seen[mnt]
		if !ok {
			if err := os.MkdirAll(filepath.Join(mnt, parent), 0o755); err != nil {
				return nil, fmt.Errorf("ns: create cgroup parent: %w", err)
			}
			dir = filepath.Join(mnt, parent, name)
			if err := os.Mkdir(dir, 0o755); err != nil {
				return nil, fmt.Errorf("ns: create cgroup: %w", err)
			}
			seen[mnt] = dir
			cg.dirs = append(cg.dirs, dir)
		}
		switch c {
		case "memory":
			if err := writeCgroupFile(dir, "memory.limit_in_bytes", strconv.FormatInt(lim.MemoryBytes, 10)); err != nil {
				return nil, err
			}
			// memsw = memory+swap; equal to the memory limit means no swap.
			if err := writeCgroupFile(dir, "memory.memsw.limit_in_bytes", strconv.FormatInt(lim.MemoryBytes, 10)); err != nil && !errors.Is(err, os.ErrNotExist) {
				return nil, err
			}
		case "pids":
			if err := writeCgroupFile(dir, "pids.max", strconv.FormatInt(lim.Pids, 10)); err != nil {
				return nil, err
			}
		case "cpu":
			if err := writeCgroupFile(dir, "cpu.cfs_period_us", "100000"); err != nil {
				return nil, err
			}
			if err := writeCgroupFile(dir, "cpu.cfs_quota_us", strconv.FormatInt(lim.CPUMillis*100, 10)); err != nil {
				return nil, err
			}
		case "freezer":
			cg.freezerDir = dir
		}
	}
	return cg, nil
}

// enableV2Controllers makes memory, pids and cpu available to children of
// root/parent, enabling them on the root only where missing.
func enableV2Controllers(root, parent string) error {
	want := []string{"memory", "pids", "cpu"}
	avail, err := os.ReadFile(filepath.Join(root, "cgroup.controllers"))
	if err != nil {
		return err
	}
	for _, c := range want {
		if !containsWord(string(avail), c) {
			return fmt.Errorf("ns: cgroup v2 controller %q is not available", c)
		}
	}
	pdir := filepath.Join(root, parent)
	if err := os.MkdirAll(pdir, 0o755); err != nil {
		return fmt.Errorf("ns: create cgroup parent: %w", err)
	}
	for _, dir := range []string{root, pdir} {
		cur, err := os.ReadFile(filepath.Join(dir, "cgroup.subtree_control"))
		if err != nil {
			return err
		}
		var add []string
		for _, c := range want {
			if !containsWord(string(cur), c) {
				add = append(add, "+"+c)
			}
		}
		if len(add) > 0 {
			if err := writeCgroupFile(dir, "cgroup.subtree_control", strings.Join(add, " ")); err != nil {
				return err
			}
		}
	}
	return nil
}

func containsWord(s, w string) bool {
	for _, f := range strings.Fields(s) {
		if f == w {
			return true
		}
	}
	return false
}

// writeCgroupFile writes val to an existing control file (never creating
// one: a missing file is reported as os.ErrNotExist).
func writeCgroupFile(dir, file, val string) error {
	f, err := os.OpenFile(filepath.Join(dir, file), os.O_WRONLY|os.O_TRUNC, 0)
	if err == nil {
		_, err = f.WriteString(val)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		return fmt.Errorf("ns: cgroup %s/%s=%s: %w", dir, file, val, err)
	}
	return nil
}

// add moves the process pid (all its threads) into every group.
func (cg *cgroup) add(pid int) error {
	for _, d := range cg.dirs {
		if err := writeCgroupFile(d, "cgroup.procs", strconv.Itoa(pid)); err != nil {
			return err
		}
	}
	return nil
}

// freeze freezes (or thaws) the group and waits for the state to settle.
func (cg *cgroup) freeze(ctx context.Context, frozen bool) error {
	if cg.v2 {
		v := "0"
		if frozen {
			v = "1"
		}
		if err := writeCgroupFile(cg.freezerDir, "cgroup.freeze", v); err != nil {
			return err
		}
		want := "frozen " + v
		return pollUntil(ctx, func() (bool, error) {
			b, err := os.ReadFile(filepath.Join(cg.freezerDir, "cgroup.events"))
			if err != nil {
				return false, err
			}
			for _, line := range strings.Split(string(b), "\n") {
				if line == want {
					return true, nil
				}
			}
			return false, nil
		})
	}
	want := "THAWED"
	if frozen {
		want = "FROZEN"
	}
	if err := writeCgroupFile(cg.freezerDir, "freezer.state", want); err != nil {
		return err
	}
	return pollUntil(ctx, func() (bool, error) {
		b, err := os.ReadFile(filepath.Join(cg.freezerDir, "freezer.state"))
		if err != nil {
			return false, err
		}
		if s := string(bytes.TrimSpace(b)); s == want {
			return true, nil
		}
		// A v1 freezer can stay FREEZING when a task is stuck; asking again
		// retries the freeze of the stragglers.
		return false, writeCgroupFile(cg.freezerDir, "freezer.state", want)
	})
}

func pollUntil(ctx context.Context, f func() (bool, error)) error {
	d := time.Millisecond
	for {
		ok, err := f()
		if err != nil || ok {
			return err
		}
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		if d < 50*time.Millisecond {
			d *= 2
		}
	}
}

// pids lists the host pids still in the group.
func (cg *cgroup) pids() []int {
	var out []int
	seen := map[int]bool{}
	for _, d := range cg.dirs {
		b, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if p, err := strconv.Atoi(f); err == nil && !seen[p] {
				seen[p] = true
				out = append(out, p)
			}
		}
	}
	return out
}

// remove kills whatever is left in the group, thaws it so the kills are
// delivered, and removes the directories, retrying while the kernel
// finishes tearing tasks down. Missing directories are not an error.
func (cg *cgroup) remove(ctx context.Context) error {
	if len(cg.dirs) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	thawed := false
	var lastErr error
	err := pollUntil(ctx, func() (bool, error) {
		if cg.v2 {
			_ = writeCgroupFile(cg.dirs[0], "cgroup.kill", "1")
		}
		for _, p := range cg.pids() {
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		if !thawed && cg.freezerDir != "" {
			// Frozen tasks do not die; thaw once (killed tasks exit).
			if _, err := os.Stat(cg.freezerDir); err == nil {
				if cg.v2 {
					_ = writeCgroupFile(cg.freezerDir, "cgroup.freeze", "0")
				} else {
					_ = writeCgroupFile(cg.freezerDir, "freezer.state", "THAWED")
				}
			}
			thawed = true
		}
		lastErr = nil
		var left []string
		for _, d := range cg.dirs {
			if err := syscall.Rmdir(d); err != nil && !errors.Is(err, syscall.ENOENT) {
				lastErr = fmt.Errorf("ns: remove cgroup %s: %w", d, err)
				left = append(left, d)
			}
		}
		cg.dirs = left
		return len(left) == 0, nil
	})
	if err != nil && lastErr != nil {
		return lastErr
	}
	return err
}
