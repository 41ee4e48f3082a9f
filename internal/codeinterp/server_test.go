package codeinterp_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/testenv"
)

// The server is driven over HTTP exactly as @e2b/code-interpreter does
// (the same bodies, the same NDJSON reading); one server serves the
// subtests, each leaving its contexts usable for the next.
func TestServer(t *testing.T) {
	s := startServer(t)
	for _, tc := range []struct {
		name string
		fn   func(*testing.T, *server)
	}{
		{"Health", testHealth},
		{"ConnectionFiles", testConnectionFiles},
		{"StateAndCounts", testStateAndCounts},
		{"StreamOrder", testStreamOrder},
		{"Error", testError},
		{"DisplayMimeTypes", testDisplayMimeTypes},
		{"DataFrame", testDataFrame},
		{"Charts", testCharts},
		{"EnvVars", testEnvVars},
		{"Cwd", testCwd},
		{"Contexts", testContexts},
		{"Languages", testLanguages},
		{"Bash", testBash},
		{"InterruptOnDisconnect", testInterruptOnDisconnect},
		{"Serialized", testSerialized},
		{"KernelDeath", testKernelDeath},
		{"RestartOrDeleteDuringExecution", testTakeOver},
		{"BadRequests", testBadRequests},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s.t = t
			defer func() { s.t = t }()
			tc.fn(t, s)
		})
	}
	s.t = t
}

// The kernels' connection files (their HMAC keys) are in the server's
// private runtime dir (0700), nowhere else in the temp dir.
func testConnectionFiles(t *testing.T, s *server) {
	got, _ := s.code("import json, os; from ipykernel.connect import get_connection_file as f; p = f(); d = os.path.dirname(p); json.dumps([os.path.basename(d).startswith('space-code-interpreter-'), oct(os.stat(d).st_mode & 0o777), oct(os.stat(p).st_mode & 0o777)])").mainText()
	if got != `[true, "0o700", "0o600"]` {
		t.Fatalf("connection file: %s", got)
	}
}

func testHealth(t *testing.T, s *server) {
	code, body := s.status("GET", "/health", nil)
	if code != 200 {
		t.Fatalf("health: %d %s", code, body)
	}
	// The default python context is warm before /health answers.
	ctxs := s.listContexts()
	if len(ctxs) != 1 || ctxs[0].Language != "python" || ctxs[0].Cwd != s.cwd {
		t.Fatalf("contexts at start: %+v, want one python context in %s", ctxs, s.cwd)
	}
}

func testStateAndCounts(t *testing.T, s *server) {
	a := s.code("x = 1")
	b := s.code("x + 1")
	if got, ok := b.mainText(); !ok || got != "2" {
		t.Fatalf("x + 1 = %q (main result %v), want 2: %v", got, ok, b.lines)
	}
	if a.count() < 1 || b.count() != a.count()+1 {
		t.Fatalf("execution counts %d then %d, want consecutive", a.count(), b.count())
	}
	if _, ok := a.mainText(); ok {
		t.Fatalf("an assignment has a main result: %v", a.lines)
	}
	// A str's repr loses its quotes, as E2B's server gives it.
	if got, _ := s.code("'hello'").mainText(); got != "hello" {
		t.Fatalf("'hello' -> %q", got)
	}
}

func testStreamOrder(t *testing.T, s *server) {
	exe := s.code(`import sys, time
print("one", flush=True)
time.sleep(0.3)
print("two", file=sys.stderr, flush=True)
time.sleep(0.3)
print("three", flush=True)
42`)
	var seq []string
	for _, l := range exe.lines {
		switch l.typ() {
		case "stdout", "stderr":
			seq = append(seq, l.typ()+":"+strings.TrimSpace(l.str("text")))
			if l.str("timestamp") == "" {
				t.Errorf("no timestamp: %v", l)
			}
		case "result":
			seq = append(seq, "result:"+l.str("text"))
		}
	}
	want := []string{"stdout:one", "stderr:two", "stdout:three", "result:42"}
	if !slices.Equal(seq, want) {
		t.Fatalf("order %v, want %v", seq, want)
	}
	if exe.lines[0].typ() != "number_of_executions" {
		t.Fatalf("first line %v, want number_of_executions", exe.lines[0])
	}
}

func testError(t *testing.T, s *server) {
	exe := s.code("def f():\n    raise ValueError('boom')\nprint('before')\nf()")
	e := exe.err()
	if e == nil || e.str("name") != "ValueError" || e.str("value") != "boom" {
		t.Fatalf("error %v, want ValueError boom: %v", e, exe.lines)
	}
	tb := ansi.ReplaceAllString(e.str("traceback"), "")
	if !strings.Contains(tb, "ValueError") || !strings.Contains(tb, "raise ValueError") {
		t.Fatalf("traceback does not show the raise: %q", tb)
	}
	if exe.stdout() != "before\n" {
		t.Fatalf("stdout %q", exe.stdout())
	}
	// A syntax error too, and the context goes on.
	if e := s.code("def (").err(); e == nil || e.str("name") != "SyntaxError" {
		t.Fatalf("syntax error: %v", e)
	}
	if got, _ := s.code("1 + 1").mainText(); got != "2" {
		t.Fatalf("after errors: %q", got)
	}
}

func testDisplayMimeTypes(t *testing.T, s *server) {
	exe := s.code(`from IPython.display import display, HTML, Markdown, Latex, JSON, SVG, Javascript
display(HTML("<b>hi</b>"))
display(Markdown("# title"))
display(Latex(r"$x^2$"))
display(JSON({"a": [1, 2]}))
display(SVG('<svg xmlns="http://www.w3.org/2000/svg" width="1" height="1"></svg>'))
display(Javascript("console.log(1)"))
display({"text/plain": "plain", "application/x-custom": "custom"}, raw=True)
"done"`)
	results := exe.of("result")
	if len(results) != 8 {
		t.Fatalf("%d results, want 8: %v", len(results), results)
	}
	checks := []struct{ field, want string }{
		{"html", "<b>hi</b>"}, {"markdown", "# title"}, {"latex", "$x^2$"}, {"", ""},
		{"svg", "<svg"}, {"javascript", "console.log(1)"},
	}
	for i, c := range checks {
		if c.field == "" {
			continue
		}
		if !strings.Contains(results[i].str(c.field), c.want) || results[i]["is_main_result"] != false {
			t.Errorf("result %d: %s = %q (main %v), want %q", i, c.field, results[i].str(c.field), results[i]["is_main_result"], c.want)
		}
	}
	if j, ok := results[3]["json"].(map[string]any); !ok || fmt.Sprint(j["a"]) != "[1 2]" {
		t.Errorf("json result: %v", results[3])
	}
	if extra, ok := results[6]["extra"].(map[string]any); !ok || extra["application/x-custom"] != "custom" || results[6].str("text") != "plain" {
		t.Errorf("an unknown MIME type goes to extra: %v", results[6])
	}
	if results[7]["is_main_result"] != true || results[7].str("text") != "done" {
		t.Errorf("main result: %v", results[7])
	}
}

func testDataFrame(t *testing.T, s *server) {
	requirePython(t, "pandas")
	exe := s.code(`import pandas as pd, numpy as np
pd.DataFrame({"name": ["a", "b"], "v": [1.5, np.nan], "n": np.array([1, 2], dtype=np.int64), "t": pd.to_datetime(["2024-01-02", None])})`)
	results := exe.of("result")
	if len(results) != 1 {
		t.Fatalf("results %v", exe.lines)
	}
	r := results[0]
	if !strings.Contains(r.str("html"), "<table") || !strings.Contains(r.str("text"), "name") {
		t.Fatalf("DataFrame result without html table / text: %v", r)
	}
	data, ok := r["data"].(map[string]any)
	if !ok || js(data) != `{"n":[1,2],"name":["a","b"],"t":["2024-01-02T00:00:00",null],"v":[1.5,null]}` {
		t.Fatalf("DataFrame data %v", r["data"])
	}
}

func testEnvVars(t *testing.T, s *server) {
	exe := s.run(map[string]any{"code": "import os, subprocess\nprint(os.environ['SPACE_T'], subprocess.run(['sh', '-c', 'echo $SPACE_T'], capture_output=True, text=True).stdout, end='')",
		"env_vars": map[string]string{"SPACE_T": "scoped"}})
	if exe.stdout() != "scoped scoped\n" || exe.err() != nil {
		t.Fatalf("with env_vars: %q %v", exe.stdout(), exe.err())
	}
	if got := s.code("import os; print(os.environ.get('SPACE_T'))").stdout(); got != "None\n" {
		t.Fatalf("env var outlived its execution: %q", got)
	}
	// An existing variable gets its value back.
	s.code("os.environ['SPACE_KEEP'] = 'orig'")
	if got := s.run(map[string]any{"code": "print(os.environ['SPACE_KEEP'])", "env_vars": map[string]string{"SPACE_KEEP": "tmp"}}).stdout(); got != "tmp\n" {
		t.Fatalf("override: %q", got)
	}
	if got := s.code("print(os.environ['SPACE_KEEP'])").stdout(); got != "orig\n" {
		t.Fatalf("restored: %q", got)
	}
	// Restored after an error too, and the count is the user's alone.
	before := s.code("1").count()
	exe = s.run(map[string]any{"code": "raise KeyError('k')", "env_vars": map[string]string{"SPACE_T": "x"}})
	if exe.err() == nil || exe.count() != before+1 {
		t.Fatalf("error run: %v count %d want %d", exe.err(), exe.count(), before+1)
	}
	if got := s.code("print(os.environ.get('SPACE_T'))").stdout(); got != "None\n" {
		t.Fatalf("not restored after an error: %q", got)
	}
}

func testCwd(t *testing.T, s *server) {
	if got, _ := s.code("import os; os.getcwd()").mainText(); got != s.cwd {
		t.Fatalf("default cwd %q, want %q", got, s.cwd)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "f.txt"), []byte("content"), 0o644); err != nil {
		t.Fatal(err)
	}
	c := s.createContext(map[string]any{"cwd": dir})
	if c.Cwd != dir || c.Language != "python" || c.ID == "" {
		t.Fatalf("context %+v", c)
	}
	got, _ := s.run(map[string]any{"code": "open('f.txt').read()", "context_id": c.ID}).mainText()
	if got != "content" {
		t.Fatalf("relative read in cwd: %q", got)
	}
	s.status("DELETE", "/contexts/"+c.ID, nil)
	if code, body := s.status("POST", "/contexts", []byte(`{"cwd": "/nonexistent/dir"}`)); code != 400 {
		t.Fatalf("missing cwd: %d %s", code, body)
	}
}

func testContexts(t *testing.T, s *server) {
	c := s.createContext(map[string]any{"language": "python"})
	in := func(id string) bool {
		return slices.ContainsFunc(s.listContexts(), func(x contextInfo) bool { return x.ID == id })
	}
	if !in(c.ID) {
		t.Fatalf("%s not listed", c.ID)
	}
	// State is per context.
	s.run(map[string]any{"code": "only_here = 7", "context_id": c.ID})
	if e := s.code("only_here").err(); e == nil || e.str("name") != "NameError" {
		t.Fatalf("state leaked into the default context: %v", e)
	}
	if got, _ := s.run(map[string]any{"code": "only_here", "context_id": c.ID}).mainText(); got != "7" {
		t.Fatalf("context state: %q", got)
	}
	// Restart: same id, fresh state, count from 1.
	if code, body := s.status("POST", "/contexts/"+c.ID+"/restart", nil); code != 200 {
		t.Fatalf("restart: %d %s", code, body)
	}
	exe := s.run(map[string]any{"code": "only_here", "context_id": c.ID})
	if e := exe.err(); e == nil || e.str("name") != "NameError" || exe.count() != 1 {
		t.Fatalf("after restart: %v count %d", e, exe.count())
	}
	// Delete: gone from the list; executing in it or deleting it again is 404.
	if code, body := s.status("DELETE", "/contexts/"+c.ID, nil); code != 200 {
		t.Fatalf("delete: %d %s", code, body)
	}
	if in(c.ID) {
		t.Fatalf("%s listed after delete", c.ID)
	}
	resp, err := s.post("/execute", map[string]any{"code": "1", "context_id": c.ID})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 404 {
		t.Fatalf("execute in a deleted context: %d", resp.StatusCode)
	}
	for _, p := range []struct{ m, p string }{{"DELETE", "/contexts/" + c.ID}, {"POST", "/contexts/nope/restart"}} {
		if code, body := s.status(p.m, p.p, nil); code != 404 || !strings.Contains(body, "not found") {
			t.Errorf("%s %s: %d %q, want 404 not found", p.m, p.p, code, body)
		}
	}
}

func testLanguages(t *testing.T, s *server) {
	// "python" (any case) is the default context.
	before := s.code("1").count()
	if exe := s.run(map[string]any{"code": "1", "language": "Python"}); exe.count() != before+1 {
		t.Fatalf("language python ran elsewhere: count %d after %d", exe.count(), before)
	}
	code, body := s.status("POST", "/execute", []byte(`{"code": "1", "language": "cobol"}`))
	if code != 400 || !strings.Contains(body, "cobol") || !strings.Contains(body, "python") {
		t.Fatalf("unknown language: %d %q, want 400 naming it and the installed ones", code, body)
	}
	if code, body := s.status("POST", "/contexts", []byte(`{"language": "cobol"}`)); code != 400 {
		t.Fatalf("context of an unknown language: %d %s", code, body)
	}
}

func testInterruptOnDisconnect(t *testing.T, s *server) {
	c := s.createContext(nil)
	defer s.status("DELETE", "/contexts/"+c.ID, nil)
	s.run(map[string]any{"code": "y = 5", "context_id": c.ID})
	// The SDK aborts its fetch at timeoutMs: the connection closes.
	ctx, cancel := context.WithCancel(context.Background())
	started := false
	_, _, err := s.execute(ctx, map[string]any{"code": "print('looping', flush=True)\nwhile True: pass", "context_id": c.ID}, func(l line) bool {
		if l.typ() == "stdout" {
			started = true
			return false
		}
		return true
	})
	cancel()
	if err != nil || !started {
		t.Fatalf("loop did not start: %v", err)
	}
	t0 := time.Now()
	exe := s.run(map[string]any{"code": "y * 2", "context_id": c.ID})
	if got, _ := exe.mainText(); got != "10" {
		t.Fatalf("after the interrupt: %v", exe.lines)
	}
	t.Logf("next execution done %v after the disconnect", time.Since(t0).Round(time.Millisecond))
}

func testSerialized(t *testing.T, s *server) {
	c := s.createContext(nil)
	defer s.status("DELETE", "/contexts/"+c.ID, nil)
	s.run(map[string]any{"code": "import time\nlog = []", "context_id": c.ID})
	var wg sync.WaitGroup
	counts := make([]int, 3)
	for i := range counts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			exe, status, err := s.execute(context.Background(), map[string]any{"code": fmt.Sprintf("log.append(('start', %d)); time.sleep(0.2); log.append(('end', %d))", i, i), "context_id": c.ID}, nil)
			if err != nil || status != 200 {
				t.Errorf("run %d: %d %v", i, status, err)
			}
			counts[i] = exe.count()
		}()
	}
	wg.Wait()
	got, _ := s.run(map[string]any{"code": "all(log[i][0] == 'start' and log[i+1] == ('end', log[i][1]) for i in range(0, len(log), 2)) and len(log)", "context_id": c.ID}).mainText()
	if got != "6" {
		t.Fatalf("executions overlapped or were lost: %s", got)
	}
	slices.Sort(counts)
	if counts[0] < 2 || counts[1] != counts[0]+1 || counts[2] != counts[1]+1 {
		t.Fatalf("counts %v", counts)
	}
}

func testKernelDeath(t *testing.T, s *server) {
	c := s.createContext(nil)
	defer s.status("DELETE", "/contexts/"+c.ID, nil)
	exe := s.run(map[string]any{"code": "import os\nos._exit(3)", "context_id": c.ID})
	if e := exe.err(); e == nil || e.str("name") != "ContextRestarting" || exe.lines[len(exe.lines)-1].typ() != "unexpected_end_of_execution" {
		t.Fatalf("kernel death: %v", exe.lines)
	}
	if got, _ := s.run(map[string]any{"code": "40 + 2", "context_id": c.ID}).mainText(); got != "42" {
		t.Fatalf("context not usable after its kernel died: %q", got)
	}
}

func testBadRequests(t *testing.T, s *server) {
	for _, tc := range []struct {
		method, path, body string
		want               int
		bodyHas            string
	}{
		{"POST", "/execute", `{"code": `, 400, "invalid JSON"},
		{"POST", "/execute", `[1, 2]`, 400, "object"},
		{"POST", "/execute", `{}`, 400, "code"},
		{"POST", "/execute", `{"code": 5}`, 400, "code"},
		{"POST", "/execute", `{"code": "1", "context_id": "x", "language": "python"}`, 400, "Only one of context_id or language"},
		{"POST", "/execute", `{"code": "1", "context_id": "nope"}`, 404, "Context nope not found"},
		{"POST", "/execute", `{"code": "1", "env_vars": {"A": 1}}`, 400, "env_vars"},
		{"POST", "/execute", `{"code": "1", "env_vars": {"A=B": "1"}}`, 400, "env_vars"},
		{"POST", "/execute", `{"code": "1", "env_vars": ["A"]}`, 400, "env_vars"},
		{"POST", "/execute", "{\"code\": \"\xff\"}", 400, "invalid JSON"},
		{"POST", "/contexts", `{"cwd": 7}`, 400, "cwd"},
		{"GET", "/execute", ``, 405, "POST"},
		{"PUT", "/contexts", ``, 405, ""},
		{"GET", "/nope", ``, 404, ""},
	} {
		code, body := s.status(tc.method, tc.path, []byte(tc.body))
		if code != tc.want || !strings.Contains(body, tc.bodyHas) {
			t.Errorf("%s %s %q: %d %q, want %d with %q", tc.method, tc.path, tc.body, code, body, tc.want, tc.bodyHas)
		}
	}
	// A huge body is refused from its Content-Length, before it is read.
	conn, err := net.Dial("tcp", strings.TrimPrefix(s.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{", 1<<30)
	buf := make([]byte, 512)
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, _ := conn.Read(buf)
	if !bytes.HasPrefix(buf[:n], []byte("HTTP/1.1 413")) {
		t.Errorf("1 GiB body: %q, want 413", buf[:n])
	}
	// A chunked body (no Content-Length) is refused too.
	req, _ := http.NewRequest("POST", s.url+"/execute", struct{ *strings.Reader }{strings.NewReader(`{"code":"1"}`)})
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 411 {
		t.Errorf("chunked body: %d, want 411", resp.StatusCode)
	}
	// And the server still serves.
	if got, _ := s.code("'still here'").mainText(); got != "still here" {
		t.Fatalf("after bad requests: %q", got)
	}
}

// ansi matches the colour codes IPython puts in tracebacks.
var ansi = regexp.MustCompile("\x1b\\[[0-9;]*m")

// A server-side limit interrupts a long execution with a TimeoutError
// (one error: the kernel's KeyboardInterrupt is not passed on) and the
// context stays usable.
func TestExecutionTimeout(t *testing.T) {
	s := startServer(t, "--execution-timeout", "1")
	s.code("z = 3")
	t0 := time.Now()
	exe := s.code("while True: pass")
	errs := exe.of("error")
	if len(errs) != 1 || errs[0].str("name") != "TimeoutError" {
		t.Fatalf("errors %v, want one TimeoutError", errs)
	}
	if d := time.Since(t0); d > 10*time.Second {
		t.Fatalf("timeout took %v", d)
	}
	if got, _ := s.code("z").mainText(); got != "3" {
		t.Fatalf("after the timeout: %q", got)
	}
}

// Code that does not stop on an interrupt gets its kernel restarted after
// the grace period: the client is told, the context is usable again.
func TestInterruptIgnored(t *testing.T) {
	s := startServer(t, "--execution-timeout", "1", "--interrupt-grace", "1")
	exe := s.code("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass")
	var names []string
	for _, e := range exe.of("error") {
		names = append(names, e.str("name"))
	}
	if !slices.Equal(names, []string{"TimeoutError", "ContextRestarting"}) || exe.lines[len(exe.lines)-1].typ() != "unexpected_end_of_execution" {
		t.Fatalf("errors %v: %v", names, exe.lines)
	}
	if got, _ := s.code("'back'").mainText(); got != "back" {
		t.Fatalf("after the restart: %q", got)
	}
}

func pngOf(t *testing.T, r line) []byte {
	t.Helper()
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(r.str("png")))
	if err != nil || !bytes.HasPrefix(b, []byte("\x89PNG")) {
		t.Fatalf("png field is not a base64 PNG (%v): %.60q", err, r.str("png"))
	}
	return b
}

// In a sandbox the server runs as user (uid 1000) with its own home: the
// kernels' connection files go to a private runtime dir it can write, and
// code runs as that user.
func TestRunsAsUser(t *testing.T) {
	testenv.RequireRoot(t, "to run the server as uid 1000")
	s := startServerAs(t, 1000)
	got, _ := s.code("import os, pathlib; (os.getuid(), os.getcwd() == " + fmt.Sprintf("%q", s.cwd) + ", pathlib.Path.home().name)").mainText()
	if got != "(1000, True, 'userhome')" {
		t.Fatalf("as user: %s", got)
	}
	c := s.createContext(nil)
	if got, _ := s.run(map[string]any{"code": "import os; os.getuid()", "context_id": c.ID}).mainText(); got != "1000" {
		t.Fatalf("second context: %s", got)
	}
}

// A restart or delete while code runs ends that execution with an error
// saying so (not a hung stream); a restarted context is usable.
func testTakeOver(t *testing.T, s *server) {
	for _, tc := range []struct{ method, suffix, wantErr string }{
		{"POST", "/restart", "ContextRestarting"},
		{"DELETE", "", "ContextDeleted"},
	} {
		c := s.createContext(nil)
		started := make(chan struct{})
		done := make(chan execution, 1)
		go func() {
			once := false
			exe, _, err := s.execute(context.Background(), map[string]any{"code": "print('go', flush=True)\nwhile True: pass", "context_id": c.ID}, func(l line) bool {
				if l.typ() == "stdout" && !once {
					once = true
					close(started)
				}
				return true
			})
			if err != nil {
				t.Errorf("execute: %v", err)
			}
			done <- exe
		}()
		select {
		case <-started:
		case <-time.After(60 * time.Second):
			t.Fatal("loop did not start")
		}
		if code, body := s.status(tc.method, "/contexts/"+c.ID+tc.suffix, nil); code != 200 {
			t.Fatalf("%s during an execution: %d %s", tc.method, code, body)
		}
		select {
		case exe := <-done:
			if e := exe.err(); e == nil || e.str("name") != tc.wantErr {
				t.Fatalf("%s: the running execution got %v", tc.method, exe.lines)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: the running execution did not end", tc.method)
		}
		if tc.method == "POST" {
			if got, _ := s.run(map[string]any{"code": "'ok'", "context_id": c.ID}).mainText(); got != "ok" {
				t.Fatalf("after restart: %q", got)
			}
			s.status("DELETE", "/contexts/"+c.ID, nil)
		}
	}
}

// "bash" runs on the server's own kernel (spaceci/bash_kernel.py): one
// bash per context, so variables and the directory carry over.
func testBash(t *testing.T, s *server) {
	if _, err := exec.LookPath("bash"); err != nil {
		testenv.Skipf(t, "needs bash")
	}
	bash := func(code string, extra ...any) execution {
		body := map[string]any{"code": code, "language": "bash"}
		for i := 0; i+1 < len(extra); i += 2 {
			body[extra[i].(string)] = extra[i+1]
		}
		return s.run(body)
	}
	exe := bash("X=5; cd /; echo out; echo err >&2")
	if exe.stdout() != "out\n" || len(exe.of("stderr")) != 1 || exe.of("stderr")[0].str("text") != "err\n" || exe.err() != nil {
		t.Fatalf("bash: %v", exe.lines)
	}
	if got := bash("echo $X $(pwd); printf 'no newline'").stdout(); got != "5 /\nno newline" {
		t.Fatalf("bash state: %q", got)
	}
	if e := bash("false").err(); e == nil || e.str("name") != "ExitCode" || e.str("value") != "1" {
		t.Fatalf("bash status: %v", e)
	}
	if got := bash("echo \"$V\"", "env_vars", map[string]string{"V": "it's scoped"}).stdout(); got != "it's scoped\n" {
		t.Fatalf("bash env_vars: %q", got)
	}
	if got := bash("echo \"${V-unset}\"").stdout(); got != "unset\n" {
		t.Fatalf("bash env var outlived its execution: %q", got)
	}
	// An interrupt (the client leaves) drops the rest of the code, not bash.
	ctx, cancel := context.WithCancel(context.Background())
	_, _, err := s.execute(ctx, map[string]any{"code": "echo looping; while true; do sleep 1; done", "language": "bash"}, func(l line) bool { return l.typ() != "stdout" })
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	if got := bash("echo $X").stdout(); got != "5\n" {
		t.Fatalf("bash after an interrupt: %q", got)
	}
	if e := bash("exit 3").err(); e == nil || e.str("name") != "BashExited" {
		t.Fatalf("bash exit: %v", e)
	}
	if got := bash("echo ${X-new}").stdout(); got != "new\n" {
		t.Fatalf("bash after exit: %q", got)
	}
	code, body := s.status("POST", "/execute", []byte(`{"code": "1", "language": "bash", "env_vars": {"A-B": "x"}}`))
	if code != 400 || !strings.Contains(body, "A-B") {
		t.Fatalf("bad bash variable name: %d %s", code, body)
	}
}
