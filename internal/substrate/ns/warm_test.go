//go:build linux

package ns

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

// waitWarm waits until s has a warm init and returns its pid.
func waitWarm(t *testing.T, s *Substrate) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		s.warmMu.Lock()
		sp := s.warm
		s.warmMu.Unlock()
		if sp != nil {
			return sp.inst.pid
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("no warm init after a start")
	return 0
}

// groupsUnder lists the group directories under s's cgroup parent.
func groupsUnder(t *testing.T, s *Substrate) []string {
	t.Helper()
	var out []string
	for _, mnt := range s.cgroups.v1 {
		ents, _ := os.ReadDir(filepath.Join(mnt, s.cfg.CgroupParent))
		for _, e := range ents {
			if e.IsDir() {
				out = append(out, filepath.Join(mnt, s.cfg.CgroupParent, e.Name()))
			}
		}
	}
	return out
}

// After a start the next init waits in its cgroups; the next Start with the
// same limits claims it (same process, cgroups renamed to the sandbox's),
// one with other limits starts its own. Close leaves no init and no group.
func TestWarmInit(t *testing.T) {
	needRoot(t)
	if testSub.cgroups.v2 {
		testenv.Skipf(t, "warm inits need cgroup v1 (rename)")
	}
	s, err := New(Config{StateDir: testState, CgroupParent: "space-warmtest"})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			s.Close()
		}
		removeEmptyCgroupParents(s)
	}()
	startOne := func(lim substrate.Limits) (*instance, substrate.Spec) {
		t.Helper()
		spec := newSpec(t, lim)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		in, err := s.Start(ctx, spec)
		if err != nil {
			t.Fatalf("Start: %v", err)
		}
		t.Cleanup(func() { in.Stop(context.Background()) })
		return in.(*instance), spec
	}
	a, _ := startOne(substrate.Limits{})
	warmPID := waitWarm(t, s)

	b, spec := startOne(substrate.Limits{})
	if b.pid != warmPID {
		t.Fatalf("second start did not claim the warm init (pid %d, warm %d)", b.pid, warmPID)
	}
	name := spec.Route.SandboxID + "-" + spec.Route.ActivationID
	for _, d := range b.cg.dirs {
		if base := filepath.Base(d); base != name && base != agentGroupPrefix+name {
			t.Errorf("claimed cgroup %s not renamed to %s", d, name)
		}
		if _, err := os.Stat(d); err != nil {
			t.Errorf("claimed cgroup: %v", err)
		}
	}
	cgs, _ := os.ReadFile("/proc/" + strconv.Itoa(b.pid) + "/cgroup")
	if !strings.Contains(string(cgs), agentGroupPrefix+name) || strings.Contains(string(cgs), warmPrefix) {
		t.Errorf("claimed init's cgroups:\n%s", cgs)
	}
	if out := mustOK(t, b, 0, "cat /proc/sys/kernel/hostname"); strings.TrimSpace(out) != spec.Route.SandboxID {
		t.Errorf("hostname %q", out)
	}
	stopAndCheck(t, b)

	// Other limits: the warm init (for the defaults) is not used.
	warmPID = waitWarm(t, s)
	c, _ := startOne(substrate.Limits{Pids: 100})
	if c.pid == warmPID {
		t.Fatal("a start with other limits claimed the warm init")
	}
	stopAndCheck(t, c)
	waitWarm(t, s) // one for the new limits

	stopAndCheck(t, a)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	closed = true
	if g := groupsUnder(t, s); len(g) != 0 {
		t.Fatalf("groups left after Close: %v", g)
	}
}
