package restart

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// After a crash of `space up` (SIGKILL: every sandbox's processes die
// with it) and a restart on the same data, a running sandbox comes back by
// itself as a new execution with its files, and a paused one resumes with
// its files; both then run commands again.
func TestCrashAndRestartLosesNoSandbox(t *testing.T) {
	testenv.RequirePlatform(t)
	dir := t.TempDir()
	p1, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c1 := client(t, p1)
	running, paused := create(ctx, t, c1, "running"), create(ctx, t, c1, "paused")
	before := currentRoute(ctx, t, p1, running.ID)
	if code := rest(ctx, t, p1, http.MethodPost, "/sandboxes/"+paused.ID+"/pause", nil); code != http.StatusNoContent {
		t.Fatalf("pause: %d", code)
	}
	if err := p1.Kill(); err != nil {
		t.Fatal(err)
	}

	p2, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir, LogLevel: "info"})
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
	c2 := client(t, p2)

	// The running one recovers without a client call.
	sr := c2.Attach(running.ID, running.AccessToken)
	var got []byte
	deadline := time.Now().Add(90 * time.Second)
	for {
		got, err = sr.ReadFile(ctx, "/home/user/running.txt")
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(300 * time.Millisecond)
	}
	if err != nil || string(got) != "kept running" {
		t.Fatalf("running sandbox after the restart: %q, %v", got, err)
	}
	after := currentRoute(ctx, t, p2, running.ID)
	if after.Route.Generation <= before.Route.Generation || after.Route.ExecutionID == before.Route.ExecutionID {
		t.Errorf("the recovered sandbox runs %+v, want a new execution after %+v", after, before)
	}
	assertRuns(ctx, t, sr)

	// The paused one resumes with its files.
	if code := rest(ctx, t, p2, http.MethodPost, "/sandboxes/"+paused.ID+"/connect", map[string]int{"timeout": 300}); code != http.StatusCreated {
		t.Fatalf("connect of the paused sandbox after the restart: %d", code)
	}
	sp := c2.Attach(paused.ID, paused.AccessToken)
	if got, err := sp.ReadFile(ctx, "/home/user/paused.txt"); err != nil || string(got) != "kept paused" {
		t.Fatalf("paused sandbox after the restart: %q, %v", got, err)
	}
	assertRuns(ctx, t, sp)
	if log := p2.Log(); !strings.Contains(log, "recovering a sandbox whose execution was lost") || !strings.Contains(log, "paused execution lost") {
		t.Errorf("the control plane did not log its recovery decisions")
	}
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
	s, err := c.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 10 * time.Minute})
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
