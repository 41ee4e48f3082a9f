//go:build linux

package ns

// Where a sandbox's groups live (the one layout createCgroup, Reclaim,
// Sweep and Adopt share) and what reads them back.

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// groupDir is one directory of a sandbox's groups.
type groupDir struct {
	dir string
	// root is the hierarchy's root (its v1 mount, or the unified one).
	root string
	// ctrls are the v1 controllers of the hierarchy (nil on v2).
	ctrls []string
	// agent: the agent's group (pids reserve agentPids); user: the user
	// processes' group in the pids hierarchy (v2: the unified one);
	// init: the init joins it; freezer: Pause freezes it.
	agent, user, init, freezer bool
}

// groups is the one statement of where a sandbox's groups live:
// <parent>/<name> and <parent>/agent.<name> in every hierarchy it uses.
// createCgroup makes them, existingCgroup (Reclaim, Sweep) and Adopt
// find them.
func (l *cgroupLayout) groups(parent, name string) []groupDir {
	if l.v2 {
		return []groupDir{
			{dir: filepath.Join(l.unified, parent, name), root: l.unified, user: true, freezer: true},
			{dir: filepath.Join(l.unified, parent, agentGroupPrefix+name), root: l.unified, agent: true, init: true, freezer: true},
		}
	}
	// v1: one group per distinct mount; the mount of pids gets the agent's
	// group too (with whatever else is co-mounted with pids).
	mounts := map[string][]string{} // mount -> controllers
	var order []string
	for _, c := range l.v1Used() {
		mnt := l.v1[c]
		if _, ok := mounts[mnt]; !ok {
			order = append(order, mnt)
		}
		mounts[mnt] = append(mounts[mnt], c)
	}
	var out []groupDir
	for _, mnt := range order {
		ctrls := mounts[mnt]
		freezer := slices.Contains(ctrls, "freezer")
		if !slices.Contains(ctrls, "pids") {
			out = append(out, groupDir{dir: filepath.Join(mnt, parent, name), root: mnt, ctrls: ctrls, init: true, freezer: freezer})
			continue
		}
		out = append(out,
			groupDir{dir: filepath.Join(mnt, parent, name), root: mnt, ctrls: ctrls, user: true, freezer: freezer},
			groupDir{dir: filepath.Join(mnt, parent, agentGroupPrefix+name), root: mnt, ctrls: ctrls, agent: true, init: true, freezer: freezer})
	}
	return out
}

// cgroupOf is the cgroup of the directories gs.
func cgroupOf(v2 bool, gs []groupDir) *cgroup {
	cg := &cgroup{v2: v2}
	for _, g := range gs {
		cg.dirs = append(cg.dirs, g.dir)
		if g.init {
			cg.initDirs = append(cg.initDirs, g.dir)
		}
		if g.user {
			cg.userDir = g.dir
		}
		if g.freezer {
			cg.freezerDirs = append(cg.freezerDirs, g.dir)
		}
	}
	return cg
}

// existingCgroup is the cgroup createCgroup made for name, as far as its
// directories exist (remove kills their tasks and deletes them).
func existingCgroup(l *cgroupLayout, parent, name string) *cgroup {
	var gs []groupDir
	for _, g := range l.groups(parent, name) {
		if _, err := os.Stat(g.dir); err == nil {
			gs = append(gs, g)
		}
	}
	return cgroupOf(l.v2, gs)
}

// checkCgroups verifies that the groups gs exist and that pid is in the
// ones an init joins, as /proc/<pid>/cgroup shows them (paths relative to
// each hierarchy's root: this process's cgroup namespace, not the
// sandbox's).
func checkCgroups(pid int, gs []groupDir) error {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return fmt.Errorf("cgroups of %d: %w", pid, err)
	}
	var lines [][]string // hierarchy-id, controllers, path
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if f := strings.SplitN(l, ":", 3); len(f) == 3 {
			lines = append(lines, f)
		}
	}
	for _, g := range gs {
		if fi, err := os.Stat(g.dir); err != nil || !fi.IsDir() {
			return fmt.Errorf("cgroup %s missing (%v)", g.dir, err)
		}
		if !g.init {
			continue
		}
		want := "/" + strings.TrimPrefix(g.dir, strings.TrimSuffix(g.root, "/")+"/")
		found := false
		for _, f := range lines {
			ctrls := strings.Split(f[1], ",")
			if (g.ctrls == nil && f[0] == "0" && f[1] == "") || (g.ctrls != nil && slicesOverlap(ctrls, g.ctrls)) {
				if f[2] != want {
					return fmt.Errorf("init %d is in cgroup %s, not %s", pid, f[2], want)
				}
				found = true
			}
		}
		if !found {
			return fmt.Errorf("init %d: no hierarchy of %s in its cgroups", pid, g.dir)
		}
	}
	return nil
}

func slicesOverlap(a, b []string) bool {
	for _, x := range a {
		for _, y := range b {
			if x == y {
				return true
			}
		}
	}
	return false
}

// frozen reports whether any of the groups is frozen or freezing.
func (cg *cgroup) frozen() bool {
	for _, d := range cg.freezerDirs {
		file, thawed := "freezer.state", "THAWED"
		if cg.v2 {
			file, thawed = "cgroup.freeze", "0"
		}
		b, err := os.ReadFile(filepath.Join(d, file))
		if err == nil && strings.TrimSpace(string(b)) != thawed {
			return true
		}
	}
	return false
}
