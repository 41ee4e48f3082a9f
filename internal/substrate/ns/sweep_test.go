//go:build linux

package ns

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/substrate"
)

// A worker killed with SIGKILL (a helper process running a substrate):
// its warm init, never claimed, dies with it; its claimed sandboxes run
// on. The next worker's Sweep ends the one it has no record of (and the
// warm init's groups) and keeps the recorded one, which it then adopts.
func TestWorkerDeath(t *testing.T) {
	cfg := adoptConfig(t, Config{})
	// Orphans (the helper's inits) become this process's children, so the
	// test reaps them whatever the host's pid 1 does.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	defer unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
	kept, lost := newSpec(t, substrate.Limits{}), newSpec(t, substrate.Limits{})
	job, err := json.Marshal(helperJob{Cfg: cfg, Specs: []substrate.Spec{kept, lost}})
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+string(job))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var rep helperReport
	if err := json.NewDecoder(stdout).Decode(&rep); err != nil || rep.Err != "" || len(rep.States) != 2 {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("helper: %v %+v", err, rep)
	}
	pids := map[string]int{}
	fds := map[string]int{}
	for i, name := range []string{"kept", "lost"} {
		var st adoptState
		if err := json.Unmarshal(rep.States[i], &st); err != nil {
			t.Fatal(err)
		}
		pids[name] = st.PID
	}
	pids["warm"] = rep.Warm
	for name, pid := range pids {
		fd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			t.Fatalf("%s init %d: %v", name, pid, err)
		}
		defer unix.Close(fd)
		fds[name] = fd
	}
	defer func() { // reap what ended (this process is their subreaper)
		for _, pid := range []int{pids["warm"], pids["lost"]} {
			var ws syscall.WaitStatus
			syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		}
	}()

	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	waitFor(t, func() bool { return pidfdExited(fds["warm"]) }, "death of the unclaimed warm init with its worker")
	time.Sleep(500 * time.Millisecond)
	for _, name := range []string{"kept", "lost"} {
		if pidfdExited(fds[name]) {
			t.Fatalf("the %s sandbox died with its worker", name)
		}
	}

	s := newSub(t, cfg)
	keptName := kept.Route.SandboxID + "-" + kept.Route.ActivationID
	lostName := lost.Route.SandboxID + "-" + lost.Route.ActivationID
	var offered []string
	swept, err := s.Sweep(context.Background(), func(name string) bool {
		offered = append(offered, name)
		return name == keptName
	})
	if err != nil {
		t.Fatal(err)
	}
	if swept != 2 || len(offered) != 3 || !slices.Contains(offered, keptName) || !slices.Contains(offered, lostName) {
		t.Fatalf("swept %d, offered %v", swept, offered)
	}
	waitFor(t, func() bool { return pidfdExited(fds["lost"]) }, "death of the unrecorded sandbox swept")
	if pidfdExited(fds["kept"]) {
		t.Fatal("Sweep ended the recorded sandbox")
	}
	if cg := existingCgroup(s.cgroups, cfg.CgroupParent, lostName); len(cg.dirs) != 0 {
		t.Fatalf("groups of the swept sandbox left: %v", cg.dirs)
	}
	waitLoopGone(t, filepath.Join(lost.Dir, DiskImageName))

	a := adopt(t, s, kept, rep.States[0])
	mustOK(t, a, 0, "true")
	// An adopted sandbox is never offered to keep.
	if n, err := s.Sweep(context.Background(), func(name string) bool {
		t.Errorf("offered %s", name)
		return false
	}); n != 0 || err != nil {
		t.Fatalf("second sweep: %d %v", n, err)
	}
	mustOK(t, a, 0, "true")
	stopAndCheck(t, a)
	waitLoopGone(t, filepath.Join(kept.Dir, DiskImageName))
}
