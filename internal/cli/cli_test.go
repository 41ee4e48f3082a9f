package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/sdk"
	"github.com/spacesbx/space/sdk/sdktest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type result struct {
	code           int
	stdout, stderr string
}

type tester struct {
	t    *testing.T
	fake *sdktest.Server
	env  map[string]string
}

func newTester(t *testing.T) *tester {
	f := sdktest.New()
	t.Cleanup(f.Close)
	return &tester{t: t, fake: f, env: map[string]string{
		"SPACE_API_URL": f.API.URL, "E2B_SANDBOX_URL": f.Edge.URL, "E2B_API_KEY": sdktest.APIKey,
	}}
}

func (ts *tester) runIn(stdin io.Reader, term terminal, args ...string) result {
	ts.t.Helper()
	ctx, cancel := context.WithTimeout(ts.t.Context(), 10*time.Second)
	defer cancel()
	var out, errb bytes.Buffer
	if stdin == nil {
		stdin = strings.NewReader("")
	}
	code := run(ctx, args, &env{stdin: stdin, stdout: &out, stderr: &errb,
		getenv: func(k string) string { return ts.env[k] }, term: term})
	if strings.Count(errb.String(), "space: ") > 1 && code != 0 && !strings.Contains(errb.String(), "interrupted") {
		ts.t.Errorf("%q: error said more than once: %q", args, errb.String())
	}
	return result{code, out.String(), errb.String()}
}

func (ts *tester) run(args ...string) result { return ts.runIn(nil, nil, args...) }

func (ts *tester) create(args ...string) string {
	ts.t.Helper()
	r := ts.run(append([]string{"sandbox", "create"}, args...)...)
	if r.code != 0 {
		ts.t.Fatalf("create: %+v", r)
	}
	return strings.TrimSpace(r.stdout)
}

func TestUsageErrors(t *testing.T) {
	ts := newTester(t)
	for _, args := range [][]string{
		{"bogus"},
		{"sandbox", "nope"},
		{"sandbox", "get"},
		{"sandbox", "get", "a", "b"},
		{"sandbox", "create", "--timeout", "x"},
		{"sandbox", "create", "--timeout", "-1"},
		{"sandbox", "create", "--metadata", "novalue"},
		{"sandbox", "timeout", "sbx1", "0"},
		{"exec"},
		{"exec", "sbx1"},
		{"exec", "sbx1", "--"},
		{"exec", "sbx1", "extra", "--", "echo"},
		{"fs", "mv", "a", "b"},
		{"fs", "put", "sbx1", "only-one"},
		{"term"},
		{"--nosuchflag", "sandbox", "list"},
	} {
		r := ts.run(args...)
		if r.code != ExitUsage || !strings.Contains(r.stderr, "space:") {
			t.Errorf("%q: code %d stderr %q", args, r.code, r.stderr)
		}
	}
	r := ts.run("help")
	if r.code != 0 || !strings.Contains(r.stdout, "Usage:") {
		t.Fatalf("help: %+v", r)
	}
	// A command without its subcommand prints its help.
	for _, args := range [][]string{{}, {"sandbox"}, {"fs"}} {
		if r := ts.run(args...); r.code != 0 || !strings.Contains(r.stdout, "Usage:") {
			t.Errorf("%q: %+v", args, r)
		}
	}
	if r := ts.run("sandbox", "list", "-h"); r.code != 0 {
		t.Fatalf("-h: %+v", r)
	}
}

func TestSandboxCommands(t *testing.T) {
	ts := newTester(t)
	id := ts.create("--template", "base", "--timeout", "120", "--metadata", "owner=me", "--metadata", "team=x", "--env", "FOO=bar")
	st, ok := ts.fake.Get(id)
	if !ok || st.Timeout != 120 || st.Metadata["owner"] != "me" || st.Metadata["team"] != "x" || st.EnvVars["FOO"] != "bar" || st.Token == "" {
		t.Fatalf("state %+v", st)
	}
	ts.create("--secure=false")
	ts.create()
	r := ts.run("sandbox", "list")
	if r.code != 0 || strings.Count(r.stdout, "\n") != 4 || !strings.Contains(r.stdout, "owner=me,team=x") {
		t.Fatalf("list: %+v", r)
	}
	r = ts.run("sandbox", "list", "--json")
	var list []sdk.SandboxInfo
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &list) != nil || len(list) != 3 {
		t.Fatalf("list json: %+v", r)
	}
	r = ts.run("sandbox", "get", "--json", id)
	var info sdk.SandboxInfo
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &info) != nil || info.SandboxID != id {
		t.Fatalf("get: %+v", r)
	}
	if strings.Contains(r.stdout, st.Token) {
		t.Fatal("get printed the access token")
	}
	if r := ts.run("sandbox", "timeout", id, "600"); r.code != 0 {
		t.Fatalf("timeout: %+v", r)
	}
	if st, _ := ts.fake.Get(id); st.Timeout != 600 {
		t.Fatalf("timeout not set: %d", st.Timeout)
	}
	// Filters (the e2b CLI's --state and --metadata).
	if r := ts.run("sandbox", "list", "--json", "--metadata", "owner=me", "--state", "running,paused"); r.code != 0 ||
		json.Unmarshal([]byte(r.stdout), &list) != nil || len(list) != 1 || list[0].SandboxID != id {
		t.Fatalf("list --metadata: %+v", r)
	}
	if r := ts.run("sandbox", "list", "--json", "--state", "paused"); r.code != 0 || strings.TrimSpace(r.stdout) != "[]" {
		t.Fatalf("list --state paused: %+v", r)
	}
	// TEMPLATE as an argument, as the e2b CLI takes it.
	if r := ts.run("sandbox", "create", "--template", "base", "other"); r.code != ExitUsage {
		t.Fatalf("create TEMPLATE --template: %+v", r)
	}
	other := ts.create("base")
	for _, args := range [][]string{{"sandbox", "kill"}, {"sandbox", "kill", "--all", other}, {"sandbox", "kill", other, "--state", "running"}} {
		if r := ts.run(args...); r.code != ExitUsage {
			t.Errorf("%q: %+v", args, r)
		}
	}
	if r := ts.run("sandbox", "kill", "--all", "--metadata", "owner=me"); r.code != 0 {
		t.Fatalf("kill --all --metadata: %+v", r)
	}
	if _, ok := ts.fake.Get(other); !ok {
		t.Fatal("kill --all --metadata killed an unselected sandbox")
	}
	if r := ts.run("sandbox", "kill", "--all"); r.code != 0 {
		t.Fatalf("kill --all: %+v", r)
	}
	if r := ts.run("sandbox", "list", "--json"); strings.TrimSpace(r.stdout) != "[]" {
		t.Fatalf("after kill --all: %+v", r)
	}
	r = ts.run("sandbox", "get", id)
	if r.code != ExitError || r.stderr != "space: sandbox "+id+" not found (list sandboxes with: space sandbox list)\n" {
		t.Fatalf("get killed: %+v", r)
	}
	// Flags before the command and a wrong key: typed error, exit 1.
	r = ts.run("--api-key", "wrong", "sandbox", "list")
	if r.code != ExitError || !strings.Contains(r.stderr, "API key was refused") || !strings.Contains(r.stderr, "SPACE_API_KEY") {
		t.Fatalf("bad key: %+v", r)
	}
	// Unreachable control plane.
	r = ts.run("--api-url", "http://127.0.0.1:1", "sandbox", "list")
	if r.code != ExitError || !strings.Contains(r.stderr, "cannot reach http://127.0.0.1:1") || !strings.Contains(r.stderr, "space up") {
		t.Fatalf("unreachable: %+v", r)
	}
	r = ts.run("--api-url", "not a url", "sandbox", "list")
	if r.code != ExitUsage {
		t.Fatalf("bad url: %+v", r)
	}
}

func TestExec(t *testing.T) {
	ts := newTester(t)
	id := ts.create()
	r := ts.run("exec", id, "--", "echo", "hi", "there")
	if r.code != 0 || r.stdout != "hi there\n" {
		t.Fatalf("exec: %+v", r)
	}
	r = ts.run("exec", id, "--user", "root", "--", "whoami")
	if r.code != 0 || r.stdout != "root\n" {
		t.Fatalf("user: %+v", r)
	}
	r = ts.run("exec", "--cwd", "/srv", id, "--", "pwd")
	if r.code != 0 || r.stdout != "/srv\n" {
		t.Fatalf("cwd: %+v", r)
	}
	r = ts.run("exec", id, "--env", "X=1", "--", "env", "X")
	if r.code != 0 || r.stdout != "1\n" {
		t.Fatalf("env: %+v", r)
	}
	r = ts.run("exec", id, "--", "fail", "42", "boom")
	if r.code != 42 || r.stderr != "boom\n" {
		t.Fatalf("exit code: %+v", r)
	}
	r = ts.run("exec", id, "echo", "without", "dashes")
	if r.code != 0 || r.stdout != "without dashes\n" {
		t.Fatalf("no dashdash: %+v", r)
	}
	r = ts.run("exec", id, "--", "signal")
	if r.code != ExitAbnormal || !strings.Contains(r.stderr, "signal: killed") {
		t.Fatalf("signal: %+v", r)
	}
	r = ts.run("exec", "nosuch", "--", "echo")
	if r.code != ExitError || r.stderr != "space: sandbox nosuch not found (list sandboxes with: space sandbox list)\n" {
		t.Fatalf("unknown sandbox: %+v", r)
	}
}

func TestFS(t *testing.T) {
	ts := newTester(t)
	id := ts.create()
	dir := t.TempDir()
	local := filepath.Join(dir, "in.txt")
	if err := os.WriteFile(local, []byte("hello file"), 0o644); err != nil {
		t.Fatal(err)
	}
	if r := ts.run("fs", "put", id, local, "/home/user/in.txt"); r.code != 0 {
		t.Fatalf("put: %+v", r)
	}
	r := ts.run("fs", "cat", id, "/home/user/in.txt")
	if r.code != 0 || r.stdout != "hello file" {
		t.Fatalf("cat: %+v", r)
	}
	r = ts.run("fs", "ls", id, "/home/user")
	if r.code != 0 || !strings.Contains(r.stdout, "in.txt") || !strings.Contains(r.stdout, "10") {
		t.Fatalf("ls: %+v", r)
	}
	out := filepath.Join(dir, "out.txt")
	if r := ts.run("fs", "get", id, "/home/user/in.txt", out); r.code != 0 {
		t.Fatalf("get: %+v", r)
	}
	if b, _ := os.ReadFile(out); string(b) != "hello file" {
		t.Fatalf("downloaded %q", b)
	}
	r = ts.run("fs", "get", id, "/missing", filepath.Join(dir, "missing"))
	if r.code != ExitError || !strings.Contains(r.stderr, "/missing: no such file or directory in sandbox "+id) {
		t.Fatalf("get missing: %+v", r)
	}
	if _, err := os.Stat(filepath.Join(dir, "missing")); !os.IsNotExist(err) {
		t.Fatal("failed download left a file")
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 2 {
		t.Fatalf("temporary files left: %v", ents)
	}
	r = ts.run("fs", "put", id, filepath.Join(dir, "nope"), "/x")
	if r.code != ExitError {
		t.Fatalf("put missing local: %+v", r)
	}
}

type fakeTerm struct {
	mu       sync.Mutex
	rows     uint32
	raw      bool
	restored bool
	resize   chan struct{}
}

func (f *fakeTerm) Size() (uint32, uint32, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.rows, 100, nil
}

func (f *fakeTerm) MakeRaw() (func(), error) {
	f.mu.Lock()
	f.raw = true
	f.mu.Unlock()
	return func() { f.mu.Lock(); f.restored = true; f.mu.Unlock() }, nil
}

func (f *fakeTerm) Resized() (<-chan struct{}, func()) { return f.resize, func() {} }

func TestTerm(t *testing.T) {
	ts := newTester(t)
	id := ts.create()
	ft := &fakeTerm{rows: 30, resize: make(chan struct{}, 1)}
	pr, pw := io.Pipe()
	done := make(chan result, 1)
	go func() { done <- ts.runIn(pr, ft, "term", id) }()
	// Wait for the terminal to open (raw mode set), then resize.
	deadline := time.Now().Add(5 * time.Second)
	for {
		ft.mu.Lock()
		raw := ft.raw
		ft.mu.Unlock()
		if raw || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	ft.mu.Lock()
	ft.rows = 50
	ft.mu.Unlock()
	ft.resize <- struct{}{}
	_, _ = io.WriteString(pw, "echo hi\n")
	time.Sleep(100 * time.Millisecond)
	_, _ = io.WriteString(pw, "exit\n")
	var r result
	select {
	case r = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("term did not end")
	}
	pw.Close()
	if r.code != 0 || !strings.Contains(r.stdout, "echo hi\n") || !strings.Contains(r.stdout, "exit\n") {
		t.Fatalf("term: %+v", r)
	}
	ft.mu.Lock()
	defer ft.mu.Unlock()
	if !ft.restored {
		t.Fatal("terminal mode not restored")
	}
	if st, _ := ts.fake.Get(id); len(st.Resizes) != 1 || st.Resizes[0] != "50x100" {
		t.Fatalf("resizes %v", st.Resizes)
	}
}

func TestTermNonInteractiveEOF(t *testing.T) {
	ts := newTester(t)
	id := ts.create()
	// Without a terminal, end of input sends EOT; the fake shell echoes it
	// and keeps running, so "exit" in the input ends the session.
	r := ts.runIn(strings.NewReader("exit\n"), nil, "term", id)
	if r.code != 0 || !strings.Contains(r.stdout, "exit") {
		t.Fatalf("term: %+v", r)
	}
}
