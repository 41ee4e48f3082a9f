package crash

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/testenv"
)

// workerScenario crashes one space-node at a worker-side point while
// space up (etcd, control plane, edge) runs on: a worker-only crash, as
// an OOM kill or an upgrade of the worker binary is. Setup runs on n1
// alone; a move's target is n2, started after setup.
type workerScenario struct {
	point string
	nth   int64 // hits in the armed node's own process
	op    string
	// target: the armed node is n2, the move's target; n1 otherwise.
	target bool
}

var workerScenarios = []workerScenario{
	{point: crashpoint.InstallActivated, nth: 4, op: opCreate},
	{point: crashpoint.InstallPersisted, nth: 4, op: opCreate},
	{point: crashpoint.WorkerPaused, nth: 2, op: opPause},
	{point: crashpoint.WorkerResumed, nth: 1, op: opResume},
	{point: crashpoint.InstallPersisted, nth: 1, op: opMigrate, target: true},
	{point: crashpoint.RestoreEntry, nth: 2, op: opMigrate, target: true},
	{point: crashpoint.ArchiveEntry, nth: 3, op: opMigrate},
	{point: crashpoint.ArchiveEntry, nth: 3, op: opSnapshot},
	{point: crashpoint.PutWritten, nth: 1, op: opSnapshot},
	{point: crashpoint.TeardownStopped, nth: 2, op: opKill},
}

// TestWorkerCrashPoints runs every worker-only scenario (each takes a few
// seconds: make test runs them all): the armed space-node dies at its
// point, is started again on the same data dir, and the invariants of
// TestCrashPoints must hold, the control plane having run all along.
func TestWorkerCrashPoints(t *testing.T) {
	testenv.RequirePlatform(t)
	var tab strings.Builder
	total, n := 0, 0
	fmt.Fprintf(&tab, "%-58s %6s %s\n", "worker crash point@hit/operation", "time", "violations")
	for _, sc := range workerScenarios {
		name := fmt.Sprintf("%s@%d/%s", sc.point, sc.nth, sc.op)
		start := time.Now()
		var v []string
		t.Run(name, func(t *testing.T) { v = runWorkerScenario(t, sc) })
		n++
		total += len(v)
		fmt.Fprintf(&tab, "%-58s %5.0fs %d\n", name, time.Since(start).Seconds(), len(v))
		for _, s := range v {
			fmt.Fprintf(&tab, "    %s\n", s)
		}
	}
	fmt.Fprintf(&tab, "%d scenarios, %d violations\n", n, total)
	t.Logf("worker crash points:\n%s", tab.String())
	if total > 0 {
		t.Errorf("%d invariant violations (table above)", total)
	}
}

func runWorkerScenario(t *testing.T, sc workerScenario) []string {
	dir, err := os.MkdirTemp("", "wcrash-") // short: socket paths
	if err != nil {
		t.Fatal(err)
	}
	p, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir, ExternalWorkers: true, LogLevel: "info", KeepSandboxes: true})
	if err != nil {
		t.Fatal(err)
	}
	armed := append(os.Environ(), crashpoint.EnvVar+"="+fmt.Sprintf("%s@%d", sc.point, sc.nth))
	h := host{dataDirs: []string{p.DataDir}}
	var nodes []*testenv.Node
	launch := func(id string, env []string) *testenv.Node {
		n, err := testenv.LaunchNode(p, testenv.NodeOptions{ID: id, Env: env})
		if err != nil {
			t.Fatal(err)
		}
		nodes = append(nodes, n)
		return n
	}
	logs := func() string {
		var b strings.Builder
		b.WriteString(p.Log())
		for _, id := range []string{"n1", "n2"} {
			if bs, err := os.ReadFile(fmt.Sprintf("%s/nodes/%s/space-node.log", dir, id)); err == nil {
				fmt.Fprintf(&b, "--- %s\n%s", id, bs)
			}
		}
		return b.String()
	}
	defer func() {
		// The nodes stop their sandboxes (--keep-sandboxes=false is
		// their default here), then space up; nothing may stay mounted.
		for _, n := range nodes {
			if err := n.Stop(); err != nil {
				t.Error(err)
			}
		}
		if err := p.Stop(); err != nil {
			t.Error(err)
		}
		for _, l := range h.afterStop() {
			t.Errorf("left after the platform stopped: %s", l)
		}
		if t.Failed() {
			t.Logf("logs:\n%s", logs())
		} else {
			os.RemoveAll(dir)
		}
	}()
	env1 := os.Environ()
	if !sc.target {
		env1 = armed
	}
	n1 := launch("n1", env1)
	h.dataDirs = append(h.dataDirs, n1.DataDir)
	h.states = append(h.states, n1.DataDir+"/worker")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c := client(t, p)
	a, b, cs := setup(ctx, t, c, p)
	for _, s := range []*sandbox{a, b, cs} {
		h.ids = append(h.ids, s.id)
	}
	victim := n1
	if sc.op == opMigrate {
		env2 := os.Environ()
		if sc.target {
			env2 = armed
		}
		n2 := launch("n2", env2)
		h.dataDirs = append(h.dataDirs, n2.DataDir)
		h.states = append(h.states, n2.DataDir+"/worker")
		if sc.target {
			victim = n2
		}
	}

	d := &sandbox{role: "d", files: map[string]string{}}
	opDone := make(chan error, 1)
	go func() { opDone <- operate(ctx, p, c, sc.op, a, b, d) }()
	state, werr := victim.WaitExit(90 * time.Second)
	opErr := <-opDone
	log1 := victim.Log()
	if werr != nil {
		t.Fatalf("crash point %s@%d was not hit in %s by %s (operation: %v): %v", sc.point, sc.nth, victim.ID, sc.op, opErr, werr)
	}
	ws, _ := state.Sys().(syscall.WaitStatus)
	hit := fmt.Sprintf("%s%s (hit %d)", crashpoint.HitMessage, sc.point, sc.nth)
	if !ws.Signaled() || ws.Signal() != syscall.SIGKILL || !strings.Contains(log1, hit) {
		t.Fatalf("space-node %s ended with %v, without %q in its log: not the crash point", victim.ID, state, hit)
	}
	if opErr == nil && sc.op != opKill {
		t.Errorf("the %s was acknowledged though its worker died inside it", sc.op)
	}
	if d.id != "" {
		h.ids = append(h.ids, d.id)
	}
	if bytes.Contains([]byte(p.Log()), []byte(crashpoint.HitMessage)) {
		t.Fatalf("space up hit a crash point: it was not armed")
	}

	// The same worker again, on its data dir, without the point.
	restarted := launch(victim.ID, os.Environ())
	for i, n := range nodes {
		if n == victim {
			nodes = append(nodes[:i], nodes[i+1:]...) // it is gone; the new one stops
			break
		}
	}
	defer func() {
		if t.Failed() {
			t.Logf("restarted %s: pid %d", restarted.ID, restarted.Cmd.Process.Pid)
		}
	}()
	return afterRestart(ctx, t, p, sc.op, []*sandbox{a, b, cs}, d, &h, logs)
}
