//go:build linux

package ns

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

// bgSleep leaves a process running in the sandbox (in a session of its
// own, so the agent's end of the command does not take it) whose pid is
// in /tmp/bg.
const bgSleep = `setsid sh -c 'echo $$ > /tmp/bg.new; mv /tmp/bg.new /tmp/bg; exec sleep 1000' </dev/null >/dev/null 2>&1 & while [ ! -s /tmp/bg ]; do sleep 0.01; done`

// adoptConfig is cfg on the shared test state with a cgroup parent of its
// own (nested, as a worker's), swept and removed when the test ends.
func adoptConfig(t *testing.T, cfg Config) Config {
	t.Helper()
	needRoot(t)
	cfg.StateDir = testState
	top := "space-adopttest-" + randID(3)
	cfg.CgroupParent = top + "/w1"
	t.Cleanup(func() {
		// Sandboxes outlive a test that failed before stopping them.
		s, err := New(cfg)
		if err != nil {
			t.Error(err)
			return
		}
		if n, err := s.Sweep(context.Background(), func(string) bool { return false }); n != 0 || err != nil {
			t.Errorf("swept %d sandboxes left by the test (%v)", n, err)
		}
		s.Close()
		removeEmptyCgroupParents(s)
		s.cfg.CgroupParent = top
		removeEmptyCgroupParents(s)
	})
	return cfg
}

func newSub(t *testing.T, cfg Config) *Substrate {
	t.Helper()
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func startOn(t *testing.T, s *Substrate) (*instance, substrate.Spec) {
	t.Helper()
	spec := newSpec(t, substrate.Limits{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	in, err := s.Start(ctx, spec)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	return in.(*instance), spec
}

func adopt(t *testing.T, s *Substrate, spec substrate.Spec, state []byte) *instance {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	in, err := s.Adopt(ctx, spec, state)
	if err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	return in.(*instance)
}

// waitLoopGone waits until no loop device backs img (a layer disk's file
// system ends asynchronously after its last mount).
func waitLoopGone(t *testing.T, img string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		dev, _, err := findLoop(img, "")
		if err != nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s still backs %s", dev, img)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A sandbox detached by one substrate (which then closes, as a worker
// that exits) keeps running, and a new substrate adopts it: the same
// init, its processes, its files, and every operation works on it.
func TestAdopt(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"disk", Config{}},
		{"dir", Config{NoDiskQuota: true}},
		{"disk-no-userns", Config{NoUserNamespaces: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := adoptConfig(t, tc.cfg)
			s1 := newSub(t, cfg)
			inst, spec := startOn(t, s1)
			mustOK(t, inst, 1000, "echo kept > /home/user/file; "+bgSleep)
			state := inst.AdoptState()
			var st adoptState
			if err := json.Unmarshal(state, &st); err != nil {
				t.Fatal(err)
			}
			if st.PID != inst.pid || st.Disk != s1.quota || (st.UIDFirst != 0) != s1.userns || st.Cgroup != inst.cgName {
				t.Fatalf("state %+v", st)
			}
			if inst.Paused() {
				t.Fatal("a running sandbox reports paused")
			}
			pid := inst.InitPID()
			inst.Detach()
			inst.Detach()
			if err := inst.Stop(context.Background()); err != nil {
				t.Fatalf("Stop after Detach: %v", err)
			}
			s1.Close()
			select {
			case <-inst.Done():
				t.Fatal("Done closed by Detach")
			default:
			}

			s2 := newSub(t, cfg)
			a := adopt(t, s2, spec, state)
			t.Cleanup(func() {
				stopAndCheck(t, a)
				if s2.quota {
					waitLoopGone(t, filepath.Join(spec.Dir, DiskImageName))
				}
			})
			if a.InitPID() != pid || a.GuestSocket() != inst.GuestSocket() || a.Route() != spec.Route {
				t.Fatalf("adopted pid %d socket %s, want %d %s", a.InitPID(), a.GuestSocket(), pid, inst.GuestSocket())
			}
			if string(a.AdoptState()) != string(state) {
				t.Fatalf("adopted state %s, want %s", a.AdoptState(), state)
			}
			if _, err := s2.Adopt(context.Background(), spec, state); !errors.Is(err, substrate.ErrNotAdoptable) {
				t.Fatalf("a second Adopt of one sandbox: %v, want ErrNotAdoptable", err)
			}
			mustOK(t, a, 0, "kill -0 $(cat /tmp/bg)")
			// The init's output reaches the log again.
			if a.logR == nil {
				t.Fatal("the init's output pipe was not opened again")
			}
			// Written on the host into the init's stderr (the pipe is not
			// the sandbox's to open in a user namespace).
			if err := os.WriteFile("/proc/"+strconv.Itoa(pid)+"/fd/2", []byte("adopted-output\n"), 0); err != nil {
				t.Fatal(err)
			}
			waitFor(t, func() bool {
				b, _ := os.ReadFile(filepath.Join(spec.Dir, LogName))
				return strings.Contains(string(b), "adopted-output")
			}, "the adopted init's output in agent.log")

			ctx := context.Background()
			if err := a.Pause(ctx); err != nil {
				t.Fatal(err)
			}
			if !a.Paused() {
				t.Fatal("Paused() false after Pause")
			}
			// What a snapshot of the paused sandbox reads.
			upper, release, err := s2.PrepareLayer(ctx, spec.Dir, substrate.Limits{})
			if err != nil {
				t.Fatal(err)
			}
			if b, err := os.ReadFile(filepath.Join(upper, "home/user/file")); err != nil || string(b) != "kept\n" {
				t.Fatalf("layer of the adopted sandbox: %q %v", b, err)
			}
			if err := release(); err != nil {
				t.Fatal(err)
			}
			if b, err := os.ReadFile(filepath.Join(s2.LayerDir(spec.Dir), "home/user/file")); err != nil || string(b) != "kept\n" {
				t.Fatalf("LayerDir of the adopted sandbox: %q %v", b, err)
			}
			if err := a.Resume(ctx); err != nil {
				t.Fatal(err)
			}
			if a.Paused() {
				t.Fatal("Paused() true after Resume")
			}
			mustOK(t, a, 0, "echo more >> /home/user/file && kill -0 $(cat /tmp/bg)")
			sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			stats, err := a.Stats(sctx)
			if err != nil {
				t.Fatal(err)
			}
			if stats.MemUsed <= 0 || stats.DiskUsed <= 0 || stats.MemTotal != DefaultMemoryBytes || (s2.quota && stats.DiskTotal == 0) {
				t.Fatalf("stats %+v", stats)
			}
		})
	}
}

// A sandbox paused when its worker let go of it is adopted paused, and
// resumes.
func TestAdoptPaused(t *testing.T) {
	cfg := adoptConfig(t, Config{})
	s1 := newSub(t, cfg)
	inst, spec := startOn(t, s1)
	ctx := context.Background()
	if err := inst.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	state := inst.AdoptState()
	inst.Detach()
	s2 := newSub(t, cfg)
	a := adopt(t, s2, spec, state)
	t.Cleanup(func() { stopAndCheck(t, a) })
	if !a.Paused() {
		t.Fatal("a sandbox adopted while frozen reports not paused")
	}
	if err := a.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	mustOK(t, a, 0, "true")
	if a.Paused() {
		t.Fatal("Paused() after Resume")
	}
}

func mustStart(t *testing.T, pid int) uint64 {
	t.Helper()
	st, err := procStart(pid)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func waitFor(t *testing.T, ok func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("no %s after 10s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Adopt refuses, changing nothing, whatever is not the recorded
// activation: each case below passes every check but its own (without a
// user namespace; with one, the uid range's owner tag refuses another
// pid too).
func TestAdoptRejects(t *testing.T) {
	t.Run("userns", func(t *testing.T) { testAdoptRejects(t, Config{}) })
	t.Run("no-userns", func(t *testing.T) { testAdoptRejects(t, Config{NoUserNamespaces: true}) })
}

func testAdoptRejects(t *testing.T, cfg Config) {
	cfg = adoptConfig(t, cfg)
	s1 := newSub(t, cfg)
	inst, spec := startOn(t, s1)
	mustOK(t, inst, 1000, bgSleep)
	state := inst.AdoptState()
	pid := inst.pid
	userDir := inst.cg.userDir
	inst.Detach()
	s2 := newSub(t, cfg)

	var st adoptState
	if err := json.Unmarshal(state, &st); err != nil {
		t.Fatal(err)
	}
	edit := func(f func(*adoptState)) []byte {
		c := st
		f(&c)
		b, _ := json.Marshal(c)
		return b
	}
	// A process of the sandbox that is not its init, with its own start
	// time, moved into the init's groups: only its executable differs.
	b, _ := os.ReadFile(filepath.Join(userDir, "cgroup.procs"))
	other, _ := strconv.Atoi(strings.Fields(string(b))[0])
	otherStart, err := procStart(other)
	if err != nil {
		t.Fatal(err)
	}
	if err := inst.cg.add(other); err != nil {
		t.Fatal(err)
	}
	// Another sandbox's init: the same executable, other groups.
	o, _ := startOn(t, s1)
	t.Cleanup(func() { stopAndCheck(t, o) })
	socket := filepath.Join(spec.Dir, SocketName)
	cases := []struct {
		name  string
		state []byte
		spec  substrate.Spec
		setup func() func()
	}{
		{name: "empty", state: nil},
		{name: "malformed", state: []byte("{")},
		{name: "unknown field", state: []byte(`{"v":1,"x":1}`)},
		{name: "version", state: edit(func(c *adoptState) { c.V = 2 })},
		{name: "another executable", state: edit(func(c *adoptState) { c.PID, c.Start = other, otherStart })},
		{name: "another sandbox's init", state: edit(func(c *adoptState) { c.PID, c.Start = o.pid, mustStart(t, o.pid) })},
		{name: "wrong start time", state: edit(func(c *adoptState) { c.Start++ })},
		{name: "another activation", state: state, spec: func() substrate.Spec {
			sp := spec
			sp.Route.ActivationID = randID(4)
			return sp
		}()},
		{name: "missing socket", state: state, setup: func() func() {
			if err := os.Rename(socket, socket+".moved"); err != nil {
				t.Fatal(err)
			}
			return func() { os.Rename(socket+".moved", socket) }
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.setup != nil {
				defer c.setup()()
			}
			sp := spec
			if c.spec.Dir != "" {
				sp = c.spec
			}
			in, err := s2.Adopt(context.Background(), sp, c.state)
			if !errors.Is(err, substrate.ErrNotAdoptable) {
				if in != nil {
					in.(*instance).Detach()
				}
				t.Fatalf("Adopt: %v, want ErrNotAdoptable", err)
			}
			t.Logf("refused: %v", err)
			if len(s2.layers) != 0 || len(s2.live) != 0 {
				t.Fatalf("a refused adoption kept the layer or the groups: %v %v", s2.layers, s2.live)
			}
		})
	}
	// Untouched: it still runs and is adopted (its uid range and layer
	// taken back) now.
	a := adopt(t, s2, spec, state)
	t.Cleanup(func() { stopAndCheck(t, a) })
	mustOK(t, a, 0, "kill -0 $(cat /tmp/bg)")
	if a.pid != pid {
		t.Fatalf("adopted pid %d, want %d", a.pid, pid)
	}

	// An init that has died is refused (once reaped, and before: this
	// process is its parent, and Adopt reaps it); Done of an adopted
	// instance closes when its init exits.
	for _, reaped := range []bool{true, false} {
		b2, spec2 := startOn(t, s1)
		state2, pid2 := b2.AdoptState(), b2.pid
		b2.Detach()
		pfd, err := unix.PidfdOpen(pid2, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(pid2, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		waitFor(t, func() bool { return pidfdExited(pfd) }, "death of a detached init")
		unix.Close(pfd)
		if reaped {
			var ws syscall.WaitStatus
			if _, err := syscall.Wait4(pid2, &ws, 0, nil); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := s2.Adopt(context.Background(), spec2, state2); !errors.Is(err, substrate.ErrNotAdoptable) {
			t.Fatalf("Adopt of a dead init (reaped %v): %v, want ErrNotAdoptable", reaped, err)
		} else {
			t.Logf("refused: %v", err)
		}
		if err := syscall.Kill(pid2, 0); err != syscall.ESRCH {
			t.Fatalf("dead init %d not reaped: %v", pid2, err)
		}
		if err := s2.Reclaim(context.Background(), spec2.Route, spec2.Dir); err != nil {
			t.Fatal(err)
		}
	}

	c3, spec3 := startOn(t, s1)
	state3 := c3.AdoptState()
	c3.Detach()
	a3 := adopt(t, s2, spec3, state3)
	if err := syscall.Kill(a3.pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-a3.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("Done of an adopted instance not closed when its init died")
	}
	stopAndCheck(t, a3)
}

// A sandbox that runs, whether detached or adopted, keeps its uid range:
// no new sandbox gets it.
func TestAdoptedKeepsUIDRange(t *testing.T) {
	cfg := adoptConfig(t, Config{NoDiskQuota: true, NoWarmInit: true, UIDLockDir: t.TempDir(),
		UIDRangeFirst: DefaultUIDRangeFirst + (DefaultUIDRangeCount-1)*usernsSize, UIDRangeCount: 1})
	s1 := newSub(t, cfg)
	if !s1.userns {
		testenv.Skipf(t, "no user namespaces here: %s", userNamespacesUnsupported())
	}
	a, spec := startOn(t, s1)
	state := a.AdoptState()
	a.Detach()
	ctx := context.Background()
	if in, err := s1.Start(ctx, newSpec(t, substrate.Limits{})); err == nil {
		in.Stop(ctx)
		t.Fatal("a new sandbox got the range of a detached one")
	}
	s1.Close()
	s2 := newSub(t, cfg)
	ad := adopt(t, s2, spec, state)
	if in, err := s2.Start(ctx, newSpec(t, substrate.Limits{})); err == nil {
		in.Stop(ctx)
		t.Fatal("a new sandbox got the range of an adopted one")
	}
	stopAndCheck(t, ad)
	b, _ := startOn(t, s2)
	if b.uids.First() != cfg.UIDRangeFirst {
		t.Fatalf("range %d, want %d", b.uids.First(), cfg.UIDRangeFirst)
	}
	stopAndCheck(t, b)
}

// Environment of the helper process of TestWorkerDeath.
const helperEnv = "SPACE_NS_TEST_HELPER"

// helperJob is what TestWorkerDeath asks the helper to start.
type helperJob struct {
	Cfg   Config           `json:"cfg"`
	Specs []substrate.Spec `json:"specs"`
}

// helperReport is what the helper prints once its sandboxes run.
type helperReport struct {
	States [][]byte `json:"states"`
	Warm   int      `json:"warm"`
	Err    string   `json:"err,omitempty"`
}

// runHelper is the helper process of TestWorkerDeath: a worker that
// starts sandboxes, waits for its warm init, reports, and waits to be
// killed.
func runHelper() int {
	var job helperJob
	rep := helperReport{}
	out := json.NewEncoder(os.Stdout)
	err := func() error {
		if err := json.Unmarshal([]byte(os.Getenv(helperEnv)), &job); err != nil {
			return err
		}
		s, err := New(job.Cfg)
		if err != nil {
			return err
		}
		for _, spec := range job.Specs {
			in, err := s.Start(context.Background(), spec)
			if err != nil {
				return err
			}
			rep.States = append(rep.States, in.(*instance).AdoptState())
		}
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			s.warmMu.Lock()
			if s.warm != nil {
				rep.Warm = s.warm.inst.pid
			}
			s.warmMu.Unlock()
			if rep.Warm != 0 {
				return nil
			}
		}
		return errors.New("no warm init")
	}()
	if err != nil {
		rep.Err = err.Error()
	}
	_ = out.Encode(rep)
	_, _ = os.Stdin.Read(make([]byte, 1)) // until killed
	return 0
}
