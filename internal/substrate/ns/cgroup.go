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
	"slices"
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

// v1Optional are v1 controllers a sandbox uses when the host mounts them:
// cpuacct gives Stats the sandbox's CPU time where it is not co-mounted
// with cpu.
var v1Optional = []string{"cpuacct"}

// v1Used lists the v1 controllers of l a sandbox gets groups in.
func (l *cgroupLayout) v1Used() []string {
	out := slices.Clone(v1Controllers)
	for _, c := range v1Optional {
		if l.v1[c] != "" {
			out = append(out, c)
		}
	}
	return out
}

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
			for _, c := range slices.Concat(v1Controllers, v1Optional) {
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

// Pids reserve of the agent. A sandbox's processes live in two groups
// under <parent>:
//
//	<sandbox>-<activation>        the user's processes, with the sandbox's
//	                              limits (pids.max is Limits.Pids)
//	agent.<sandbox>-<activation>  the agent (pid 1): pids.max agentPids
//
// so that a fork bomb that fills the sandbox's pids.max never keeps the
// agent from creating a thread (the Go runtime dies when it cannot) or the
// short-lived wrapper of a new command. Sandbox ids are DNS labels, so no
// sandbox group ever starts with "agent.". On v1 only the pids hierarchy is
// split (the agent shares memory, cpu and freezer with the user); on v2
// the agent's group repeats the sandbox's memory and cpu limits, and Pause
// freezes both groups. The agent moves every user process into the user
// group before it runs any user code (see internal/guest/cgexec), through
// the user group's cgroup.procs file, which Start opens on the host and
// hands to the agent as fd agentCgroupFD.
const (
	agentPids        = 64
	agentGroupPrefix = "agent."
)

// cgroup is one sandbox's groups in every hierarchy it uses.
type cgroup struct {
	v2 bool
	// dirs holds every group directory created (remove deletes them).
	dirs []string
	// initDirs are the groups the init (the agent) joins.
	initDirs []string
	// userDir is the user processes' group in the pids hierarchy (v2: in
	// the unified one).
	userDir string
	// freezerDirs are the groups Pause freezes.
	freezerDirs []string
}

// createCgroup creates <parent>/<name> and <parent>/agent.<name> in every
// needed hierarchy and applies lim. On error it removes what it created.
func createCgroup(l *cgroupLayout, parent, name string, lim substrate.Limits) (_ *cgroup, err error) {
	gs := l.groups(parent, name)
	made := &cgroup{v2: l.v2}
	defer func() {
		if err != nil {
			_ = made.remove(context.Background())
		}
	}()
	if l.v2 {
		if err := enableV2Controllers(l.unified, parent); err != nil {
			return nil, err
		}
	}
	for _, g := range gs {
		if !l.v2 {
			// Nested parents need nothing copied: cpuset, the one v1
			// controller whose new groups start empty, is not used.
			if err := os.MkdirAll(filepath.Dir(g.dir), 0o755); err != nil {
				return nil, fmt.Errorf("ns: create cgroup parent: %w", err)
			}
		}
		if err := os.Mkdir(g.dir, 0o755); err != nil {
			return nil, fmt.Errorf("ns: create cgroup: %w", err)
		}
		made.dirs = append(made.dirs, g.dir)
		glim := lim
		if g.agent {
			glim.Pids = agentPids
		}
		if l.v2 {
			err = applyV2(g.dir, glim)
		} else {
			err = applyV1(g.dir, g.ctrls, glim)
		}
		if err != nil {
			return nil, err
		}
	}
	return cgroupOf(l.v2, gs), nil
}

// applyV2 writes lim to the v2 group dir (on v2 the agent's group repeats
// the sandbox's memory and cpu limits).
func applyV2(dir string, lim substrate.Limits) error {
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
			return err
		}
	}
	return nil
}

// applyV1 writes lim for the v1 controllers ctrls of the group dir.
func applyV1(dir string, ctrls []string, lim substrate.Limits) error {
	for _, c := range ctrls {
		switch c {
		case "memory":
			if err := writeCgroupFile(dir, "memory.limit_in_bytes", strconv.FormatInt(lim.MemoryBytes, 10)); err != nil {
				return err
			}
			// memsw = memory+swap; equal to the memory limit means no swap.
			if err := writeCgroupFile(dir, "memory.memsw.limit_in_bytes", strconv.FormatInt(lim.MemoryBytes, 10)); err != nil && !errors.Is(err, os.ErrNotExist) {
				return err
			}
		case "pids":
			if err := writeCgroupFile(dir, "pids.max", strconv.FormatInt(lim.Pids, 10)); err != nil {
				return err
			}
		case "cpu":
			if err := writeCgroupFile(dir, "cpu.cfs_period_us", "100000"); err != nil {
				return err
			}
			if err := writeCgroupFile(dir, "cpu.cfs_quota_us", strconv.FormatInt(lim.CPUMillis*100, 10)); err != nil {
				return err
			}
		}
	}
	return nil
}

// openUserProcs opens the user group's cgroup.procs for writing (close on
// exec; Start hands it to the init as an extra file).
func (cg *cgroup) openUserProcs() (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(cg.userDir, "cgroup.procs"), os.O_WRONLY, 0)
	if err != nil {
		return nil, fmt.Errorf("ns: open user cgroup: %w", err)
	}
	return f, nil
}

// enableV2Controllers makes memory, pids and cpu available to children of
// root/parent: a controller reaches a group only when every group above
// it enables it for its children, so it is enabled (where missing) on the
// root and on each group down to parent.
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
	if err := os.MkdirAll(filepath.Join(root, parent), 0o755); err != nil {
		return fmt.Errorf("ns: create cgroup parent: %w", err)
	}
	dirs := []string{root}
	for _, c := range strings.Split(parent, "/") {
		dirs = append(dirs, filepath.Join(dirs[len(dirs)-1], c))
	}
	for _, dir := range dirs {
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

// add moves the process pid (all its threads) into the agent's groups.
func (cg *cgroup) add(pid int) error {
	for _, d := range cg.initDirs {
		if err := writeCgroupFile(d, "cgroup.procs", strconv.Itoa(pid)); err != nil {
			return err
		}
	}
	return nil
}

// freeze freezes (or thaws) the groups and waits for the state to settle.
func (cg *cgroup) freeze(ctx context.Context, frozen bool) error {
	for _, d := range cg.freezerDirs {
		if err := cg.freezeOne(ctx, d, frozen); err != nil {
			return err
		}
	}
	return nil
}

func (cg *cgroup) freezeOne(ctx context.Context, dir string, frozen bool) error {
	if cg.v2 {
		v := "0"
		if frozen {
			v = "1"
		}
		if err := writeCgroupFile(dir, "cgroup.freeze", v); err != nil {
			return err
		}
		want := "frozen " + v
		return pollUntil(ctx, func() (bool, error) {
			b, err := os.ReadFile(filepath.Join(dir, "cgroup.events"))
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
	if err := writeCgroupFile(dir, "freezer.state", want); err != nil {
		return err
	}
	return pollUntil(ctx, func() (bool, error) {
		b, err := os.ReadFile(filepath.Join(dir, "freezer.state"))
		if err != nil {
			return false, err
		}
		if s := string(bytes.TrimSpace(b)); s == want {
			return true, nil
		}
		// A v1 freezer can stay FREEZING when a task is stuck; asking again
		// retries the freeze of the stragglers.
		return false, writeCgroupFile(dir, "freezer.state", want)
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
			for _, d := range cg.dirs {
				_ = writeCgroupFile(d, "cgroup.kill", "1")
			}
		}
		for _, p := range cg.pids() {
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		if !thawed {
			// Frozen tasks do not die; thaw once (killed tasks exit).
			for _, d := range cg.freezerDirs {
				if _, err := os.Stat(d); err != nil {
					continue
				}
				if cg.v2 {
					_ = writeCgroupFile(d, "cgroup.freeze", "0")
				} else {
					_ = writeCgroupFile(d, "freezer.state", "THAWED")
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

// unfrozenTasks describes (pid, state, wait channel) the tasks of the group
// that are not frozen, for the error of a pause that did not complete.
// Best effort: at most eight tasks, "" when none could be read.
func (cg *cgroup) unfrozenTasks() string {
	var out []string
	for _, d := range cg.dirs {
		b, err := os.ReadFile(filepath.Join(d, "tasks"))
		if err != nil {
			b, err = os.ReadFile(filepath.Join(d, "cgroup.threads"))
			if err != nil {
				continue
			}
		}
		for _, f := range strings.Fields(string(b)) {
			if len(out) == 8 {
				return strings.Join(out, ", ")
			}
			stat, err := os.ReadFile("/proc/" + f + "/stat")
			if err != nil {
				continue
			}
			// The state follows the parenthesised command name.
			i := bytes.LastIndexByte(stat, ')')
			if i < 0 || i+2 >= len(stat) {
				continue
			}
			state := stat[i+2]
			wchan, _ := os.ReadFile("/proc/" + f + "/wchan")
			if string(wchan) == "do_freezer_trap" || string(wchan) == "__refrigerator" {
				continue // frozen
			}
			out = append(out, fmt.Sprintf("%s %c %s", f, state, wchan))
		}
	}
	return strings.Join(out, ", ")
}
