package crash

import (
	"context"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// TestWorkerLossRecoveredOnAnotherWorker: space up with two space-node
// workers; the one running a sandbox is killed (SIGKILL) and stays away
// past the grace: the sandbox comes back on the other worker as
// generation+1 (fresh from its template: it had no snapshot) and the SDK
// reaches it there. The killed worker, started again on its data dir,
// retires the replaced execution before it serves anything, and the
// sandbox stays served by the new execution.
func TestWorkerLossRecoveredOnAnotherWorker(t *testing.T) {
	testenv.RequirePlatform(t)
	dir, err := os.MkdirTemp("", "wloss-") // short: socket paths
	if err != nil {
		t.Fatal(err)
	}
	p, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir, ExternalWorkers: true, LogLevel: "info",
		Args: []string{"--worker-loss-grace", "6s"}})
	if err != nil {
		t.Fatal(err)
	}
	nodeArgs := []string{"--lease-ttl", "3s"}
	var nodes []*testenv.Node
	launch := func(id string) *testenv.Node {
		n, err := testenv.LaunchNode(p, testenv.NodeOptions{ID: id, Args: nodeArgs})
		if err != nil {
			t.Fatal(err)
		}
		nodes = append(nodes, n)
		return n
	}
	defer func() {
		for _, n := range nodes {
			if n.Cmd.ProcessState == nil {
				if err := n.Stop(); err != nil {
					t.Error(err)
				}
			}
		}
		if t.Failed() {
			t.Logf("space up log:\n%s", p.Log())
			for _, n := range nodes {
				t.Logf("--- %s\n%s", n.ID, n.Log())
			}
		}
		if err := p.Stop(); err != nil {
			t.Error(err)
		}
		if !t.Failed() {
			os.RemoveAll(dir)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	n1 := launch("n1")
	c := client(t, p)
	s, err := c.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 10 * time.Minute, Secure: true})
	if err != nil {
		t.Fatal(err)
	}
	sb := &sandbox{id: s.ID, token: s.AccessToken}
	if _, err := s.WriteFile(ctx, "/home/user/before.txt", []byte("written on n1")); err != nil {
		t.Fatal(err)
	}
	current := func() spacev1.Execution {
		var execs []spacev1.Execution
		get(ctx, p, "/space/v1/sandboxes/"+s.ID+"/executions", &execs)
		var cur spacev1.Execution
		for _, e := range execs {
			if e.State == "running" {
				cur = e
			}
		}
		return cur
	}
	old := current().Route
	if old.WorkerID != "n1" {
		t.Fatalf("created on %q, want n1 (the only worker)", old.WorkerID)
	}
	launch("n2")

	killedAt := time.Now()
	n1.Kill()
	var now spacev1.Execution
	for deadline := time.Now().Add(120 * time.Second); ; {
		now = current()
		if now.Route.Generation > old.Generation {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not recovered 120 s after the worker died (execution %+v)", now)
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("recovered %s after the kill: %s -> %s", time.Since(killedAt).Round(100*time.Millisecond), old, now.Route)
	if now.Route.Generation != old.Generation+1 || now.Route.WorkerID != "n2" {
		t.Fatalf("recovered as %s, want generation %d on n2", now.Route, old.Generation+1)
	}
	// The SDK reaches the new execution; the edge answers from it. The
	// edge's cached route may still name the dead worker: the first
	// request then fails (not replayed: a write) and drops it.
	var werr error
	for attempt := 0; attempt < 3; attempt++ {
		if _, werr = s.WriteFile(ctx, "/home/user/after.txt", []byte("written on n2")); werr == nil {
			break
		}
		t.Logf("write after the recovery, attempt %d: %v", attempt+1, werr)
		time.Sleep(500 * time.Millisecond)
	}
	if werr != nil {
		t.Fatalf("write after the recovery: %v", werr)
	}
	if b, err := s.ReadFile(ctx, "/home/user/after.txt"); err != nil || string(b) != "written on n2" {
		t.Fatalf("read after the recovery: %q %v", b, err)
	}
	if _, served, err := readFile(ctx, p, sb, "/etc/hostname"); err != nil || served != now.Route.ExecutionLabel() {
		t.Fatalf("served by %q (%v), want the new execution %q", served, err, now.Route.ExecutionLabel())
	}
	// No snapshot: a fresh start from the template (documented).
	if _, err := s.ReadFile(ctx, "/home/user/before.txt"); err == nil {
		t.Fatal("a file of the lost execution is there without a snapshot to restore it from")
	}

	// n1 comes back on its data dir: it retires the replaced execution
	// before serving, and the sandbox stays on n2.
	n1b := launch("n1")
	// This start's lines (the log is appended to): from its start report,
	// logged before it registers.
	thisRun := func() string { lg := n1b.Log(); return lg[strings.LastIndex(lg, "executions on record at start"):] }
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(thisRun(), "control plane's view applied") {
		if time.Now().After(deadline) {
			t.Fatalf("restarted n1 never applied the control plane's view:\n%s", thisRun())
		}
		time.Sleep(200 * time.Millisecond)
	}
	run2 := thisRun()
	retiredAt, appliedAt := -1, strings.Index(run2, "control plane's view applied")
	for _, line := range strings.SplitAfter(run2, "\n") {
		if strings.Contains(line, s.ID) && strings.Contains(line, "retired") {
			retiredAt = strings.Index(run2, line)
			break
		}
	}
	if retiredAt < 0 || retiredAt > appliedAt {
		t.Fatalf("restarted n1 did not retire the replaced execution before serving (retired at %d, view applied at %d):\n%s", retiredAt, appliedAt, run2)
	}
	for range 5 {
		if _, served, err := readFile(ctx, p, sb, "/etc/hostname"); err != nil || served != now.Route.ExecutionLabel() {
			t.Fatalf("after n1's return: served by %q (%v), want %q", served, err, now.Route.ExecutionLabel())
		}
	}
	if code := rest(ctx, p, http.MethodGet, "/sandboxes/"+s.ID, nil, nil); code != http.StatusOK {
		t.Fatalf("sandbox after n1's return: %d", code)
	}
}
