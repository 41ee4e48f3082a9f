package restart

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/bench"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// After a crash of `space up` (SIGKILL) in which every sandbox's
// processes died too (here: their inits are killed after it; sandboxes
// outlive their worker, so it takes a second failure) and a restart on the
// same data, nothing can be re-adopted: the running sandboxes come back by
// themselves as new executions and the paused ones resume, each with its
// id, files, metadata and timeout; all run commands again.
func TestCrashAndRestartLosesNoSandbox(t *testing.T) {
	testenv.RequirePlatform(t)
	const perKind = 3
	dir := t.TempDir()
	opts := testenv.PlatformOptions{Dir: dir, Workers: 2}
	p1, err := testenv.LaunchPlatform(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c1 := client(t, p1)
	var running, paused []*sdk.Sandbox
	before := map[string]spacev1.Execution{}
	infos := map[string]*sdk.SandboxInfo{}
	for i := range perKind {
		r, p := create(ctx, t, c1, fmt.Sprintf("running%d", i)), create(ctx, t, c1, fmt.Sprintf("paused%d", i))
		running, paused = append(running, r), append(paused, p)
	}
	for _, s := range append(append([]*sdk.Sandbox{}, running...), paused...) {
		before[s.ID] = currentRoute(ctx, t, p1, s.ID)
		info, err := c1.GetSandbox(ctx, s.ID)
		if err != nil {
			t.Fatal(err)
		}
		infos[s.ID] = info
	}
	for _, s := range paused {
		if code := rest(ctx, t, p1, http.MethodPost, "/sandboxes/"+s.ID+"/pause", nil); code != http.StatusNoContent {
			t.Fatalf("pause: %d", code)
		}
	}
	var inits []int
	for _, b := range before {
		pid, err := bench.AgentPID(b.Route)
		if err != nil {
			t.Fatal(err)
		}
		inits = append(inits, pid)
	}
	if err := p1.Kill(); err != nil {
		t.Fatal(err)
	}
	for _, pid := range inits {
		// A paused sandbox's frozen init dies once its reclaim thaws it.
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && err != syscall.ESRCH {
			t.Fatalf("kill sandbox init %d: %v", pid, err)
		}
	}

	opts.LogLevel = "info"
	p2, err := testenv.LaunchPlatform(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("space up log after the restart:\n%s", p2.Log())
		}
		if err := p2.Stop(); err != nil {
			t.Error(err)
		}
	})
	restarted := time.Now()
	c2 := client(t, p2)

	// The running ones recover without a client call.
	for i, s := range running {
		sr := c2.Attach(s.ID, s.AccessToken)
		var got []byte
		deadline := time.Now().Add(90 * time.Second)
		for {
			got, err = sr.ReadFile(ctx, fmt.Sprintf("/home/user/running%d.txt", i))
			if err == nil || time.Now().After(deadline) {
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
		if err != nil || string(got) != fmt.Sprintf("kept running%d", i) {
			t.Fatalf("running sandbox %s after the restart: %q, %v", s.ID, got, err)
		}
		assertRuns(ctx, t, sr)
	}
	servedAfter := time.Since(restarted)

	// The paused ones resume with their files.
	for i, s := range paused {
		if code := rest(ctx, t, p2, http.MethodPost, "/sandboxes/"+s.ID+"/connect", map[string]int{"timeout": 600}); code != http.StatusCreated {
			t.Fatalf("connect of paused sandbox %s after the restart: %d", s.ID, code)
		}
		sp := c2.Attach(s.ID, s.AccessToken)
		if got, err := sp.ReadFile(ctx, fmt.Sprintf("/home/user/paused%d.txt", i)); err != nil || string(got) != fmt.Sprintf("kept paused%d", i) {
			t.Fatalf("paused sandbox %s after the restart: %q, %v", s.ID, got, err)
		}
		assertRuns(ctx, t, sp)
	}

	// Each is a new execution of the same sandbox, with its metadata; the
	// running ones keep their timeout.
	recovered := 0
	for _, s := range running {
		after := currentRoute(ctx, t, p2, s.ID)
		if b := before[s.ID]; after.Route.Generation <= b.Route.Generation || after.Route.ExecutionID == b.Route.ExecutionID {
			t.Errorf("sandbox %s runs %+v, want a new execution after %+v", s.ID, after.Route, b.Route)
		} else {
			recovered++
		}
		info, err := c2.GetSandbox(ctx, s.ID)
		if err != nil {
			t.Fatal(err)
		}
		if old := infos[s.ID]; info.Metadata["name"] != old.Metadata["name"] || !info.EndAt.Equal(old.EndAt) {
			t.Errorf("sandbox %s: metadata %v end %v, want %v %v", s.ID, info.Metadata, info.EndAt, old.Metadata, old.EndAt)
		}
	}
	resumed := 0
	for _, s := range paused {
		if after := currentRoute(ctx, t, p2, s.ID); after.Route.Generation > before[s.ID].Route.Generation {
			resumed++
		}
		if info, err := c2.GetSandbox(ctx, s.ID); err != nil || info.Metadata["name"] != infos[s.ID].Metadata["name"] {
			t.Errorf("paused sandbox %s: metadata %v, %v", s.ID, info, err)
		}
	}
	t.Logf("after SIGKILL and restart: %d running sandboxes recovered as new executions (all served %.1fs after the restart), %d paused ones resumed as new executions, 0 lost",
		recovered, servedAfter.Seconds(), resumed)
	if resumed != perKind {
		t.Errorf("%d of %d paused sandboxes came back as new executions", resumed, perKind)
	}
	if log := p2.Log(); !strings.Contains(log, "recovering a sandbox whose execution was lost") || !strings.Contains(log, "paused execution lost") {
		t.Errorf("the control plane did not log its recovery decisions")
	}
	if n := auditCount(t, p2, `"decision":"not-adopted"`); n != 2*perKind {
		t.Errorf("the workers audited %d executions that failed adoption, want %d", n, 2*perKind)
	}
	if n := auditCount(t, p2, `"decision":"reclaimed"`); n != 2*perKind {
		t.Errorf("the workers audited %d reclaimed executions, want %d", n, 2*perKind)
	}
}

// auditCount counts the lines of p's workers' audit logs that contain s.
func auditCount(t *testing.T, p *testenv.Platform, s string) int {
	t.Helper()
	logs, _ := filepath.Glob(filepath.Join(p.DataDir, "workers", "*", "audit.log"))
	n := 0
	for _, l := range logs {
		b, err := os.ReadFile(l)
		if err != nil {
			t.Fatal(err)
		}
		n += strings.Count(string(b), s)
	}
	return n
}

func client(t *testing.T, p *testenv.Platform) *sdk.Client {
	c, err := sdk.New(sdk.Config{APIURL: p.APIURL, SandboxURL: p.SandboxURL, APIKey: p.APIKey})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// create makes a sandbox with /home/user/<name>.txt holding "kept <name>".
func create(ctx context.Context, t *testing.T, c *sdk.Client, name string) *sdk.Sandbox {
	t.Helper()
	s, err := c.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 10 * time.Minute, Metadata: map[string]string{"name": name}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.WriteFile(ctx, "/home/user/"+name+".txt", []byte("kept "+name)); err != nil {
		t.Fatal(err)
	}
	return s
}

func assertRuns(ctx context.Context, t *testing.T, s *sdk.Sandbox) {
	t.Helper()
	var out bytes.Buffer
	if code, err := s.Run(ctx, "echo alive", sdk.RunOptions{Stdout: &out}); err != nil || code != 0 || strings.TrimSpace(out.String()) != "alive" {
		t.Fatalf("run in %s: exit %d, %v, %q", s.ID, code, err, out.String())
	}
}

func currentRoute(ctx context.Context, t *testing.T, p *testenv.Platform, id string) spacev1.Execution {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, p.APIURL+"/space/v1/sandboxes/"+id+"/executions", nil)
	req.Header.Set(spacev1.HeaderAPIKey, p.APIKey)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var execs []spacev1.Execution
	if err := json.NewDecoder(res.Body).Decode(&execs); err != nil {
		t.Fatal(err)
	}
	for _, e := range execs {
		if e.State == "running" || e.State == "paused" {
			return e
		}
	}
	t.Fatalf("sandbox %s has no current execution: %+v", id, execs)
	return spacev1.Execution{}
}

func rest(ctx context.Context, t *testing.T, p *testenv.Platform, method, path string, body any) int {
	t.Helper()
	var rd *bytes.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	} else {
		rd = bytes.NewReader(nil)
	}
	req, _ := http.NewRequestWithContext(ctx, method, p.APIURL+path, rd)
	req.Header.Set(spacev1.HeaderAPIKey, p.APIKey)
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if res.StatusCode >= 300 {
		var e bytes.Buffer
		e.ReadFrom(res.Body)
		t.Logf("%s %s: %d %s", method, path, res.StatusCode, e.String())
	}
	return res.StatusCode
}

// A sandbox whose init dies while it is served (an agent crash, an OOM
// kill: the whole sandbox's processes go with it) comes back by itself as
// a new execution with its files, on a worker that keeps running.
func TestSandboxInitDeathIsRecovered(t *testing.T) {
	p := testenv.StartPlatform(t, testenv.PlatformOptions{LogLevel: "info"})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := client(t, p)
	s := create(ctx, t, c, "crash")
	before := currentRoute(ctx, t, p, s.ID)
	pid, err := bench.AgentPID(before.Route)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill the sandbox init %d: %v", pid, err)
	}
	killed := time.Now()
	var got []byte
	for deadline := time.Now().Add(60 * time.Second); ; {
		got, err = s.ReadFile(ctx, "/home/user/crash.txt")
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil || string(got) != "kept crash" {
		t.Fatalf("after its init died: %q, %v", got, err)
	}
	after := currentRoute(ctx, t, p, s.ID)
	if after.Route.Generation <= before.Route.Generation {
		t.Errorf("runs %+v, want a new execution after %+v", after.Route, before.Route)
	}
	assertRuns(ctx, t, s)
	if n := auditCount(t, p, `"decision":"lost"`); n != 1 {
		t.Errorf("the worker audited %d lost executions, want 1", n)
	}
	t.Logf("sandbox served again %.2fs after its init was killed, as generation %d", time.Since(killed).Seconds(), after.Route.Generation)
}

func jsonDecode(res *http.Response, v any) error { return json.NewDecoder(res.Body).Decode(v) }
