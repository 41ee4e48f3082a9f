//go:build linux

package ns

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/substrate"
)

func TestMemoryLimit(t *testing.T) {
	inst, _ := start(t, substrate.Limits{MemoryBytes: 64 << 20})
	r := sh(t, inst, 0, "head -c 1000m /dev/zero | tail")
	if r.Code != 128+int(syscall.SIGKILL) {
		t.Fatalf("memory hog: exit %d: %s", r.Code, r.Out)
	}
	mustOK(t, inst, 0, "echo still alive")
	if !inst.cg.v2 {
		b, err := os.ReadFile(filepath.Join(inst.cg.dirs[0], "memory.oom_control"))
		if err != nil || !strings.Contains(string(b), "oom_kill ") || strings.Contains(string(b), "oom_kill 0") {
			t.Errorf("memory.oom_control %q %v", b, err)
		}
	} else {
		b, err := os.ReadFile(filepath.Join(inst.cg.dirs[0], "memory.events"))
		if err != nil || strings.Contains(string(b), "oom_kill 0") {
			t.Errorf("memory.events %q %v", b, err)
		}
	}
}

// pidsDir is the user group in the pids hierarchy.
func pidsDir(inst *instance) string { return inst.cg.userDir }

func TestPidsLimit(t *testing.T) {
	inst, _ := start(t, substrate.Limits{Pids: 64})
	dir := pidsDir(inst)
	stop := make(chan struct{})
	var maxSeen int
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			b, err := os.ReadFile(filepath.Join(dir, "pids.current"))
			if err != nil {
				continue
			}
			if n, _ := strconv.Atoi(strings.TrimSpace(string(b))); n > maxSeen {
				maxSeen = n
			}
		}
	}()
	_, err := shTimeout(inst, 1000, "f() { f | f & }; f; sleep 3", 3*time.Second)
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatalf("fork bomb: %v", err)
	}
	if maxSeen > 64 {
		t.Fatalf("pids.current reached %d > 64", maxSeen)
	}
	ev, _ := os.ReadFile(filepath.Join(dir, "pids.events"))
	t.Logf("max pids seen %d; pids.events %q", maxSeen, strings.TrimSpace(string(ev)))
	if !strings.Contains(string(ev), "max") || strings.Contains(string(ev), "max 0") {
		t.Errorf("pids limit never hit: %q", ev)
	}
	// The bomb's group was killed by the agent; the sandbox recovers.
	deadline := time.Now().Add(10 * time.Second)
	for {
		r, err := shTimeout(inst, 0, "echo ok", 5*time.Second)
		if err == nil && r.Code == 0 && r.Out == "ok\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox did not recover: %v %+v", err, r)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestAgentCgroupLayout checks the split: the user group carries the
// sandbox's pids limit and holds the user's processes, the agent (the init)
// lives in agent.<name> with its own reserve; Stop removes both (the
// cleanup check in start).
func TestAgentCgroupLayout(t *testing.T) {
	inst, spec := start(t, substrate.Limits{Pids: 64})
	name := spec.Route.SandboxID + "-" + spec.Route.ActivationID
	user := inst.cg.userDir
	agent := filepath.Join(filepath.Dir(user), agentGroupPrefix+name)
	if filepath.Base(user) != name {
		t.Fatalf("user group %s, want .../%s", user, name)
	}
	if got := strings.TrimSpace(readFile(t, filepath.Join(user, "pids.max"))); got != "64" {
		t.Fatalf("user pids.max %q, want 64", got)
	}
	if got := strings.TrimSpace(readFile(t, filepath.Join(agent, "pids.max"))); got != strconv.Itoa(agentPids) {
		t.Fatalf("agent pids.max %q, want %d", got, agentPids)
	}
	if !slices.Contains(inst.cg.dirs, agent) {
		t.Fatalf("agent group %s not among %v", agent, inst.cg.dirs)
	}
	initPid := strconv.Itoa(inst.InitPID())
	if procs := strings.Fields(readFile(t, filepath.Join(agent, "cgroup.procs"))); !slices.Equal(procs, []string{initPid}) {
		t.Fatalf("agent group procs %v, want [%s]", procs, initPid)
	}
	// A user command runs in the user group (seen from the sandbox's cgroup
	// namespace, rooted at the agent's groups, it is a sibling), the init
	// never leaves the agent's.
	out := mustOK(t, inst, 1000, "cat /proc/self/cgroup")
	want := "/../" + name
	ok := false
	for _, line := range strings.Split(out, "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) == 3 && (f[1] == "pids" || (inst.cg.v2 && f[0] == "0")) {
			ok = f[2] == want
		}
	}
	if !ok {
		t.Fatalf("user command's cgroups:\n%s\nwant pids at %s", out, want)
	}
	if procs := strings.Fields(readFile(t, filepath.Join(agent, "cgroup.procs"))); !slices.Equal(procs, []string{initPid}) {
		t.Fatalf("agent group procs after a command %v, want [%s]", procs, initPid)
	}
}

// TestForkBombKeepsAgentReserve: while a user fork bomb holds the user
// group at its pids.max, the agent still creates threads and processes and
// starts new commands (moved into the full group: migration is not limited),
// several at once.
func TestForkBombKeepsAgentReserve(t *testing.T) {
	inst, _ := start(t, substrate.Limits{Pids: 64})
	user := inst.cg.userDir
	bomb := make(chan error, 1)
	var bombOut result
	go func() {
		// Forks until the group is full and holds it there: a classic bomb's
		// population swings as its processes exit (on a loaded machine it
		// may never sit at the limit while it is sampled), and a shell that
		// cannot fork exits, taking its group with it.
		const hold = `python3 -c "
import os, time
while True:
    try:
        if os.fork() == 0:
            time.sleep(8)
            os._exit(0)
    except OSError:
        break
time.sleep(6)
"`
		r, err := shTimeout(inst, 1000, hold, 7*time.Second)
		bombOut = r
		bomb <- err
	}()
	// Generous: on a loaded 2-core machine the bomb grows slowly.
	deadline := time.Now().Add(8 * time.Second)
	for readCounter(t, filepath.Join(user, "pids.current")) < 64 {
		select {
		case err := <-bomb:
			t.Fatalf("the bomb ended before filling the user group (pids.current %d, err %v, exit %d, output %.300q)", readCounter(t, filepath.Join(user, "pids.current")), err, bombOut.Code, bombOut.Out)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the bomb did not fill the user group: pids.current %d", readCounter(t, filepath.Join(user, "pids.current")))
		}
		time.Sleep(20 * time.Millisecond)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range cap(errs) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := shTimeout(inst, i%2*1000, "echo alive", 5*time.Second)
			if err == nil && (r.Code != 0 || r.Out != "alive\n") {
				err = fmt.Errorf("echo alive: %+v", r)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("agent while the user group is full: %v", err)
		}
	}
	if err := <-bomb; err != nil {
		t.Fatalf("bomb: %v", err)
	}
	if ev := readFile(t, filepath.Join(user, "pids.events")); !strings.Contains(ev, "max") || strings.Contains(ev, "max 0") {
		t.Errorf("pids limit never hit: %q", ev)
	}
	mustOK(t, inst, 0, "echo ok")
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
