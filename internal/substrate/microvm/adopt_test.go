//go:build linux

package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

// starterEnv makes the test binary start one VM as a worker would, write
// its adoption state to a file and wait to be killed (vmStarter).
const starterEnv = "SPACE_TEST_VM_STARTER"

// starterArgs is what vmStarter is told, as JSON in starterEnv.
type starterArgs struct {
	StateDir, KernelPath, ModulesDir, UIDLockDir, Accel string
	Dir, Out                                            string
}

// vmStarter starts the VM starterArgs describe and blocks; the test
// kills it with SIGKILL, holding its QMP connection, its uid lock and its
// console pipe, as a worker crash would.
func vmStarter() int {
	var a starterArgs
	if err := json.Unmarshal([]byte(os.Getenv(starterEnv)), &a); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	s, err := New(Config{StateDir: a.StateDir, KernelPath: a.KernelPath, ModulesDir: a.ModulesDir,
		UIDLockDir: a.UIDLockDir, Accel: a.Accel, testMode: "counter", NoTemplates: true})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	inst, err := s.Start(ctx, substrate.Spec{Route: testRoute("ad1"), Template: "base", Dir: a.Dir, AgentPath: DefaultBusyboxPath})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := os.WriteFile(a.Out+".tmp", inst.(substrate.Adoptable).AdoptState(), 0o600); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := os.Rename(a.Out+".tmp", a.Out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	select {} // until SIGKILL
}

// One VM, started by a process that is then killed with SIGKILL, keeps
// running and is adopted: each forged or stale state is refused with
// ErrNotAdoptable and leaves it running; the genuine state adopts it (same
// QEMU), and Pause, Paused, Resume, SaveState and Stats work; Detach and a
// new substrate's Adopt keep it paused; Stop ends it and a later Adopt of
// the same state is refused.
func TestAdoptAfterStarterDies(t *testing.T) {
	cfg := testConfig(t)
	s0, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s0.Close()
	if _, _, err := s0.ensureImage(DefaultBusyboxPath); err != nil { // built once, for the starter too
		t.Fatal(err)
	}
	cfg.Accel = s0.Accel() // the probe's answer: no new substrate probes again
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	base := t.TempDir()
	dir := filepath.Join(base, "ad1")
	out := filepath.Join(base, "state.json")
	args, _ := json.Marshal(starterArgs{StateDir: cfg.StateDir, KernelPath: cfg.KernelPath, ModulesDir: cfg.ModulesDir,
		UIDLockDir: cfg.UIDLockDir, Accel: cfg.Accel, Dir: dir, Out: out})
	starter := exec.Command(os.Args[0], "-test.run=^$")
	starter.Env = append(os.Environ(), starterEnv+"="+string(args))
	var starterOut bytes.Buffer
	starter.Stdout, starter.Stderr = &starterOut, &starterOut
	if err := starter.Start(); err != nil {
		t.Fatal(err)
	}
	var state []byte
	for state == nil {
		if b, err := os.ReadFile(out); err == nil {
			state = b
			break
		}
		select {
		case <-ctx.Done():
			starter.Process.Kill()
			starter.Wait()
			t.Fatalf("no state from the starter: %s", starterOut.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
	var st adoptState
	if err := json.Unmarshal(state, &st); err != nil {
		t.Fatal(err)
	}
	// Whatever happens below, the VM does not outlive the test.
	defer func() {
		if f, err := openPidfd(st.PID); err == nil {
			if st.verify(f) == nil {
				_ = signalPidfd(f, syscall.SIGKILL)
			}
			f.Close()
		}
	}()
	// This test plays spaced-host too, which outlives the worker and
	// holds the channel throughout: the counter loop the test guest runs
	// instead of the agent reads EOF from its port, and ends (and the
	// guest with it), while no host side is connected.
	ch := dialChannel(t, &instance{socket: st.GuestSocket})
	if err := starter.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = starter.Wait()
	qemu, err := openPidfd(st.PID)
	if err != nil {
		t.Fatalf("QEMU died with its starter: %v", err)
	}
	defer qemu.Close()
	alive := func(when string) {
		t.Helper()
		if err := st.verify(qemu); err != nil {
			b, _ := os.ReadFile(filepath.Join(dir, ConsoleLog))
			t.Fatalf("%s: QEMU no longer runs: %v; console %q", when, err, b[max(0, len(b)-1500):])
		}
	}
	alive("after the starter's SIGKILL")
	if st.Leased {
		// The starter's lock died with it; the uid stays QEMU's.
		if l, err := leaseUID(cfg.UIDLockDir, st.UID, 1, 0); err == nil {
			l.release()
			t.Fatalf("uid %d of the running QEMU was leased again", st.UID)
		}
	}
	spec := substrate.Spec{Route: testRoute("ad1"), Template: "base", Dir: dir, AgentPath: DefaultBusyboxPath}

	s1, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s1.Close()
	forged := func(mut func(*adoptState)) []byte {
		c := st
		mut(&c)
		b, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	other := exec.Command("sleep", "300")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { other.Process.Kill(); other.Wait() }()
	otherFD, err := openPidfd(other.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	otherID, err := identify(otherFD, other.Process.Pid)
	otherFD.Close()
	if err != nil {
		t.Fatal(err)
	}
	// A directory like the VM's whose QMP socket some other process
	// serves (this one).
	fake := filepath.Join(base, "fake")
	if err := os.Mkdir(fake, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{SocketName, QMPSocketName} {
		l, err := net.Listen("unix", filepath.Join(fake, n))
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
	}
	fakeSpec := spec
	fakeSpec.Dir = fake
	for _, tc := range []struct {
		name  string
		spec  substrate.Spec
		state []byte
		want  string // in the error: the check that refused
	}{
		{"malformed", spec, []byte(`{"version":1,`), "malformed state"},
		{"no qemu", spec, []byte(`{"version":1}`), "no qemu process"},
		{"other version", spec, forged(func(a *adoptState) { a.Version = 2 }), "format version 2"},
		{"other pid", spec, forged(func(a *adoptState) { a.PID = otherID.PID }), "another process"},
		{"other binary", spec, forged(func(a *adoptState) {
			a.procID, a.ExeDev, a.ExeIno, a.Leased = otherID, st.ExeDev, st.ExeIno, st.Leased
		}), "recorded qemu binary"},
		{"wrong start time", spec, forged(func(a *adoptState) { a.Start++ }), "another process"},
		{"other boot", spec, forged(func(a *adoptState) { a.Boot = "00000000-0000-0000-0000-000000000000" }), "another boot"},
		{"wrong uid", spec, forged(func(a *adoptState) { a.UID++ }), "runs as uids"},
		{"other dir", fakeSpec, state, "activation directory is"},
		{"other route", spec, forged(func(a *adoptState) { a.Route.ActivationID = "ad2" }), "is of activation"},
		{"qmp not qemu's", fakeSpec, forged(func(a *adoptState) {
			a.QMPSocket, a.GuestSocket = filepath.Join(fake, QMPSocketName), filepath.Join(fake, SocketName)
		}), "not qemu"},
	} {
		_, err := s1.Adopt(ctx, tc.spec, tc.state)
		if !errors.Is(err, substrate.ErrNotAdoptable) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Adopt = %v, want ErrNotAdoptable for %q", tc.name, err, tc.want)
		}
		alive(tc.name)
	}
	if err := other.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("a refused adoption touched the other process: %v", err)
	}

	// The genuine state: the same QEMU, running, answering over the
	// channel; its console output, whose pipe broke with the starter, is
	// dropped without harm.
	inst, err := s1.Adopt(ctx, spec, state)
	if err != nil {
		t.Fatalf("Adopt: %v (starter: %s)", err, starterOut.String())
	}
	vi := inst.(*instance)
	if inst.InitPID() != st.PID || vi.Paused() {
		t.Fatalf("adopted pid %d paused %v, want %d running", inst.InitPID(), vi.Paused(), st.PID)
	}
	if !bytes.Equal(vi.AdoptState(), state) {
		t.Errorf("AdoptState changed by adoption: %s", vi.AdoptState())
	}
	if r, err := ch.ask("sh echo to-the-console > /dev/console; echo ok", 60*time.Second); err != nil || r != "1 ok" {
		t.Fatalf("adopted guest answered %q, %v", r, err)
	}
	if err := inst.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	if !vi.Paused() {
		t.Error("Paused false after Pause")
	}
	if r, err := ch.ask("b", 700*time.Millisecond); err == nil {
		t.Fatalf("paused guest answered %q", r)
	}
	var saved bytes.Buffer
	if n, err := inst.(substrate.StateSaver).SaveState(ctx, &saved); err != nil || n < 1<<20 {
		t.Fatalf("SaveState of the adopted VM: %d bytes, %v", n, err)
	}
	if h, err := readHeader(&saved); err != nil || h.Shape != st.Shape || h.Accel != st.Accel || h.ImageID != st.ImageID {
		t.Errorf("saved header %+v, %v", h, err)
	}
	if err := inst.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if r, err := ch.reply(10 * time.Second); err != nil || r != "2 b" {
		t.Fatalf("after Resume %q, %v", r, err)
	}
	if stats, err := inst.(substrate.StatsReporter).Stats(ctx); err != nil || stats.MemTotal != st.Shape.MemoryMiB<<20 || stats.MemUsed <= 0 {
		t.Errorf("Stats %+v, %v", stats, err)
	}

	// Paused, detached, adopted by another substrate: still paused, then
	// resumed.
	if err := inst.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	vi.Detach()
	if err := inst.Resume(ctx); err == nil {
		t.Error("Resume after Detach succeeded")
	}
	select {
	case <-inst.Done():
		t.Fatal("Done closed by Detach")
	default:
	}
	alive("after Detach")
	s2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	inst2, err := s2.Adopt(ctx, spec, state)
	if err != nil {
		t.Fatalf("second Adopt: %v", err)
	}
	defer inst2.Stop(context.Background())
	if inst2.InitPID() != st.PID || !inst2.(substrate.Adoptable).Paused() {
		t.Fatalf("second adoption: pid %d paused %v", inst2.InitPID(), inst2.(substrate.Adoptable).Paused())
	}
	if err := inst2.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if r, err := ch.ask("c", 10*time.Second); err != nil || r != "3 c" {
		t.Fatalf("after the second adoption %q, %v", r, err)
	}

	// Stop ends the adopted QEMU through its pidfd and frees its uid.
	if err := inst2.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-inst2.Done():
	default:
		t.Fatal("Done open after Stop")
	}
	if err := st.verify(qemu); err == nil {
		t.Fatal("QEMU runs after Stop")
	}
	for _, n := range []string{SocketName, QMPSocketName, RecordName} {
		if _, err := os.Stat(filepath.Join(dir, n)); !os.IsNotExist(err) {
			t.Errorf("%s left behind: %v", n, err)
		}
	}
	if st.Leased {
		l, err := leaseUID(cfg.UIDLockDir, st.UID, 1, 0)
		if err != nil {
			t.Errorf("uid %d not free after Stop: %v", st.UID, err)
		} else {
			l.release()
		}
	}
	if _, err := s2.Adopt(ctx, spec, state); !errors.Is(err, substrate.ErrNotAdoptable) ||
		!(strings.Contains(err.Error(), "is gone") || strings.Contains(err.Error(), "exited")) {
		t.Errorf("Adopt of a stopped VM: %v", err)
	}
}

// A VM this process started, detached and adopted by another substrate
// of the same process: the same QEMU, still this process's child, is
// served, stopped through the adopter's pidfd and reaped.
func TestDetachStartedThenAdopt(t *testing.T) {
	cfg := testConfig(t)
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	cfg.Accel = s.Accel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	spec := substrate.Spec{Route: testRoute("dt1"), Template: "base", Dir: filepath.Join(t.TempDir(), "dt1"), AgentPath: DefaultBusyboxPath}
	inst, err := s.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	ch := dialChannel(t, inst)
	if r, err := ch.ask("a", 60*time.Second); err != nil || r != "1 a" {
		inst.Stop(ctx)
		t.Fatalf("first reply %q, %v", r, err)
	}
	state := inst.(substrate.Adoptable).AdoptState()
	inst.(substrate.Adoptable).Detach()
	s2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	inst2, err := s2.Adopt(ctx, spec, state)
	if err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	defer inst2.Stop(context.Background())
	if inst2.InitPID() != inst.InitPID() || inst2.(substrate.Adoptable).Paused() {
		t.Fatalf("adopted pid %d (started %d), paused %v", inst2.InitPID(), inst.InitPID(), inst2.(substrate.Adoptable).Paused())
	}
	if r, err := ch.ask("b", 10*time.Second); err != nil || r != "2 b" {
		t.Fatalf("after adoption %q, %v", r, err)
	}
	if err := inst2.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	// The detached instance's watch reaps its child: no zombie stays.
	for deadline := time.Now().Add(10 * time.Second); ; {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", inst.InitPID())); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("qemu %d not reaped after Stop", inst.InitPID())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Reclaim kills the process its record names only when it is that
// process (here a sleep standing in for QEMU), removes the sockets and
// the record, and finds nothing the second time.
func TestReclaim(t *testing.T) {
	s := &Substrate{cfg: Config{}.withDefaults()}
	dir := t.TempDir()
	route := testRoute("rc1")
	start := func() (*exec.Cmd, procID) {
		c := exec.Command("sleep", "300")
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Process.Kill(); c.Wait() })
		f, err := openPidfd(c.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		id, err := identify(f, c.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		return c, id
	}
	write := func(id procID) {
		b, err := json.Marshal(adoptState{Version: adoptVersion, procID: id, Accel: "tcg", ImageID: "x",
			Shape: machineShape{MemoryMiB: 256, VCPUs: 1}, Route: route,
			QMPSocket: filepath.Join(dir, QMPSocketName), GuestSocket: filepath.Join(dir, SocketName)})
		if err != nil {
			t.Fatal(err)
		}
		for n, data := range map[string][]byte{RecordName: b, SocketName: nil, QMPSocketName: nil} {
			if err := os.WriteFile(filepath.Join(dir, n), data, 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	runs := func(c *exec.Cmd) bool { return c.Process.Signal(syscall.Signal(0)) == nil && c.ProcessState == nil }

	// A record whose process is not the one at its pid now (start time).
	c1, id1 := start()
	id1.Start++
	write(id1)
	if err := s.Reclaim(ctx, testRoute("other"), dir); err == nil {
		t.Error("Reclaim of another activation's record succeeded")
	}
	if err := s.Reclaim(ctx, route, dir); err != nil {
		t.Fatal(err)
	}
	if !runs(c1) {
		t.Fatal("Reclaim killed a process its record does not name")
	}
	for _, n := range []string{RecordName, SocketName, QMPSocketName} {
		if _, err := os.Stat(filepath.Join(dir, n)); !os.IsNotExist(err) {
			t.Errorf("%s left behind: %v", n, err)
		}
	}

	// The recorded process itself.
	c2, id2 := start()
	write(id2)
	if err := s.Reclaim(ctx, route, dir); err != nil {
		t.Fatal(err)
	}
	if err := c2.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("the recorded process: %v, want killed", err)
	}
	if err := s.Reclaim(ctx, route, dir); err != nil {
		t.Fatalf("second Reclaim: %v", err)
	}

	// A pid that cannot be checked (here a thread that leads no thread
	// group: pidfd_open refuses it) is not known to be gone: the record
	// stays, so the activation's layer disk is not saved as ended.
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	tid := 0
	for _, e := range tasks {
		if n, err := strconv.Atoi(e.Name()); err == nil && n != os.Getpid() {
			tid = n // a runtime thread: they do not exit
		}
	}
	if tid == 0 {
		testenv.Skipf(t, "the test process has one thread")
	}
	_, id3 := start()
	id3.PID = tid
	write(id3)
	if err := s.Reclaim(ctx, route, dir); err == nil {
		t.Error("Reclaim of a record whose pid could not be checked succeeded")
	}
	if _, err := os.Stat(filepath.Join(dir, RecordName)); err != nil {
		t.Errorf("record of an unchecked pid removed: %v", err)
	}
}
