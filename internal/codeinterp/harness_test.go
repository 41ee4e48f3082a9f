package codeinterp_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/internal/codeinterp"
	"github.com/spacesbx/space/internal/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// requirePython skips t unless Debian's python3 has the packages the
// server runs on (make codeinterp-deps installs them); mods are extra
// modules the test needs. Tests with kernels are long for the unit tier:
// -short skips them.
func requirePython(t testing.TB, mods ...string) {
	t.Helper()
	if testenv.Short() {
		testenv.Skipf(t, "real Jupyter kernels, a minute or so; skipped by -short")
	}
	if _, err := os.Stat(codeinterp.Python); err != nil {
		testenv.Skipf(t, "needs %s: %v (make codeinterp-deps)", codeinterp.Python, err)
	}
	imports := append([]string{"jupyter_client", "ipykernel", "zmq"}, mods...)
	out, err := exec.Command(codeinterp.Python, "-c", "import "+strings.Join(imports, ", ")).CombinedOutput()
	if err != nil {
		testenv.Skipf(t, "needs python3 modules %s: %v: %s (make codeinterp-deps)", strings.Join(imports, " "), err, bytes.TrimSpace(out))
	}
}

// server is a running code interpreter server.
type server struct {
	t    testing.TB
	url  string
	cwd  string
	cmd  *exec.Cmd
	log  *bytes.Buffer
	done chan error
}

// startServer installs the server into a temp dir and runs it on a free
// loopback port as the test's user, with a throwaway IPython dir (the
// host's ~/.ipython is left alone).
func startServer(t testing.TB, args ...string) *server {
	t.Helper()
	return startServerAs(t, -1, args...)
}

// serverEnv is added to the environment of the servers a test starts
// (set before startServer, e.g. JUPYTER_PATH for extra kernelspecs).
var serverEnv []string

// startServerAs is startServer as uid (and the same gid) when uid >= 0:
// the files it needs are made readable, its home and cwd its own.
func startServerAs(t testing.TB, uid int, args ...string) *server {
	t.Helper()
	requirePython(t)
	dir := t.TempDir()
	if err := codeinterp.Install(filepath.Join(dir, "app")); err != nil {
		t.Fatal(err)
	}
	cwd := filepath.Join(dir, "home")
	if err := os.Mkdir(cwd, 0o755); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	argv := append([]string{filepath.Join(dir, "app", codeinterp.Entry), "--host", "127.0.0.1",
		"--port", fmt.Sprint(port), "--cwd", cwd}, args...)
	cmd := exec.Command(codeinterp.Python, argv...)
	cmd.Dir = cwd
	cmd.Env = append(os.Environ(), "IPYTHONDIR="+filepath.Join(dir, "ipython"), "PYTHONDONTWRITEBYTECODE=1")
	cmd.Env = append(cmd.Env, serverEnv...)
	// A process group of its own: the kernels go with it if the test dies.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if uid >= 0 {
		// As in a sandbox: a user with a home of its own and nothing
		// of the caller's runtime dirs.
		home := filepath.Join(dir, "userhome")
		for _, d := range []string{home, cwd} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(d, uid, uid); err != nil {
				t.Fatal(err)
			}
		}
		for d := dir; d != filepath.Dir(d) && strings.HasPrefix(d, os.TempDir()) && d != os.TempDir(); d = filepath.Dir(d) {
			if err := os.Chmod(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		var env []string
		for _, e := range cmd.Env {
			if !strings.HasPrefix(e, "HOME=") && !strings.HasPrefix(e, "XDG_RUNTIME_DIR=") && !strings.HasPrefix(e, "IPYTHONDIR=") {
				env = append(env, e)
			}
		}
		cmd.Env = append(env, "HOME="+home, "USER=user")
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid)}
	}
	log := &bytes.Buffer{}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s := &server{t: t, url: fmt.Sprintf("http://127.0.0.1:%d", port), cwd: cwd, cmd: cmd, log: log, done: make(chan error, 1)}
	go func() { s.done <- cmd.Wait() }()
	t.Cleanup(s.stop)
	deadline := time.Now().Add(90 * time.Second)
	for {
		resp, err := http.Get(s.url + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return s
			}
		}
		select {
		case err := <-s.done:
			s.done <- err
			t.Fatalf("server exited: %v\n%s", err, log)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("server not healthy in 90 s\n%s", log)
		}
	}
}

// stop ends the server with SIGTERM (it shuts its kernels down) and
// checks that it exits by itself.
func (s *server) stop() {
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-s.done:
		if err != nil {
			s.t.Errorf("server exit: %v\n%s", err, s.log)
		}
	case <-time.After(20 * time.Second):
		_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
		<-s.done
		s.t.Errorf("server did not exit on SIGTERM in 20 s\n%s", s.log)
	}
	// Nothing of the group may outlive the server (its kernels).
	_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	if s.t.Failed() {
		s.t.Logf("server log:\n%s", s.log)
	}
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// line is one NDJSON line of /execute.
type line map[string]any

func (l line) typ() string { s, _ := l["type"].(string); return s }
func (l line) str(k string) string {
	s, _ := l[k].(string)
	return s
}

// execution is what one /execute returned, in order.
type execution struct {
	lines []line
}

func (e execution) of(typ string) []line {
	var out []line
	for _, l := range e.lines {
		if l.typ() == typ {
			out = append(out, l)
		}
	}
	return out
}

func (e execution) stdout() string {
	var b strings.Builder
	for _, l := range e.of("stdout") {
		b.WriteString(l.str("text"))
	}
	return b.String()
}

// mainText is Execution.text in the SDK: the main result's text.
func (e execution) mainText() (string, bool) {
	for _, l := range e.of("result") {
		if l["is_main_result"] == true {
			return l.str("text"), true
		}
	}
	return "", false
}

func (e execution) err() line {
	errs := e.of("error")
	if len(errs) == 0 {
		return nil
	}
	return errs[len(errs)-1]
}

func (e execution) count() int {
	for _, l := range e.of("number_of_executions") {
		if n, ok := l["execution_count"].(float64); ok {
			return int(n)
		}
	}
	return -1
}

func (s *server) post(path string, body any) (*http.Response, error) {
	data, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	return http.Post(s.url+path, "application/json", bytes.NewReader(data))
}

// run executes code as the SDK's runCode does and reads the whole stream;
// the stream must end with end_of_execution (or, when the kernel died,
// unexpected_end_of_execution).
func (s *server) run(body map[string]any) execution {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	exe, status, err := s.execute(ctx, body, nil)
	if err != nil || status != 200 {
		s.t.Fatalf("execute %v: status %d: %v", body, status, err)
	}
	if n := len(exe.lines); n == 0 || (exe.lines[n-1].typ() != "end_of_execution" && exe.lines[n-1].typ() != "unexpected_end_of_execution") {
		s.t.Fatalf("execute %v: stream does not end with end_of_execution: %v", body, exe.lines)
	}
	return exe
}

func (s *server) code(code string) execution {
	s.t.Helper()
	return s.run(map[string]any{"code": code})
}

// execute posts to /execute and reads lines until the stream ends or
// each returns false (then it returns at once, leaving ctx's cancel to
// the caller).
func (s *server) execute(ctx context.Context, body map[string]any, each func(line) bool) (execution, int, error) {
	data, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, "POST", s.url+"/execute", bytes.NewReader(data))
	if err != nil {
		return execution{}, 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return execution{}, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		return execution{}, resp.StatusCode, errors.New(string(b))
	}
	var exe execution
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 1<<20), 64<<20)
	for sc.Scan() {
		var l line
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return exe, 200, fmt.Errorf("line %q: %w", sc.Text(), err)
		}
		exe.lines = append(exe.lines, l)
		if each != nil && !each(l) {
			return exe, 200, nil
		}
	}
	return exe, 200, sc.Err()
}

// status sends method path with a raw body and returns the status and body.
func (s *server) status(method, path string, body []byte) (int, string) {
	s.t.Helper()
	req, err := http.NewRequest(method, s.url+path, bytes.NewReader(body))
	if err != nil {
		s.t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// contextInfo is the JSON of a context.
type contextInfo struct {
	ID       string `json:"id"`
	Language string `json:"language"`
	Cwd      string `json:"cwd"`
}

func (s *server) createContext(body map[string]any) contextInfo {
	s.t.Helper()
	resp, err := s.post("/contexts", body)
	if err != nil {
		s.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		s.t.Fatalf("create context %v: %d %s", body, resp.StatusCode, b)
	}
	var c contextInfo
	if err := json.Unmarshal(b, &c); err != nil {
		s.t.Fatalf("create context: %s: %v", b, err)
	}
	return c
}

func (s *server) listContexts() []contextInfo {
	s.t.Helper()
	code, body := s.status("GET", "/contexts", nil)
	if code != 200 {
		s.t.Fatalf("list contexts: %d %s", code, body)
	}
	var out []contextInfo
	if err := json.Unmarshal([]byte(body), &out); err != nil {
		s.t.Fatalf("list contexts: %s: %v", body, err)
	}
	return out
}
