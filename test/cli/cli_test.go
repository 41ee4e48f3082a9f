package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"

	"github.com/spacesbx/space/internal/testenv"
)

// space is the built binary and the platform it talks to.
type space struct {
	t   *testing.T
	bin string
	env []string
}

type result struct {
	code           int
	stdout, stderr string
}

// run runs `space args...` with stdin and plain pipes.
func (s *space) runIn(stdin string, args ...string) result {
	s.t.Helper()
	cmd := exec.Command(s.bin, args...)
	cmd.Env = s.env
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := runTimeout(cmd, 3*time.Minute)
	r := result{code: cmd.ProcessState.ExitCode(), stdout: out.String(), stderr: errb.String()}
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		s.t.Fatalf("space %q: %v", args, err)
	}
	return r
}

func (s *space) run(args ...string) result { s.t.Helper(); return s.runIn("", args...) }

// ok runs space and fails t unless it exits 0.
func (s *space) ok(args ...string) string {
	s.t.Helper()
	r := s.run(args...)
	if r.code != 0 {
		s.t.Fatalf("space %q: exit %d\nstdout: %s\nstderr: %s", args, r.code, r.stdout, r.stderr)
	}
	return r.stdout
}

// json runs space with --json and decodes its output into v.
func (s *space) json(v any, args ...string) {
	s.t.Helper()
	out := s.ok(append(args, "--json")...)
	if err := json.Unmarshal([]byte(out), v); err != nil {
		s.t.Fatalf("space %q --json: %v\n%s", args, err, out)
	}
}

func runTimeout(cmd *exec.Cmd, d time.Duration) error {
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		_ = cmd.Process.Kill()
		<-done
		return fmt.Errorf("timed out after %v", d)
	}
}

// ptyCmd is `space` running on a pseudo-terminal (its controlling
// terminal), as from an interactive shell.
type ptyCmd struct {
	cmd    *exec.Cmd
	master *os.File
	mu     sync.Mutex
	out    bytes.Buffer
	read   chan struct{}
	done   chan error
}

func (s *space) startPTY(args ...string) *ptyCmd {
	s.t.Helper()
	master, slave, err := pty.Open()
	if err != nil {
		s.t.Fatal(err)
	}
	if err := pty.Setsize(master, &pty.Winsize{Rows: 30, Cols: 100}); err != nil {
		s.t.Fatal(err)
	}
	cmd := exec.Command(s.bin, args...)
	cmd.Env = append(s.env, "TERM=xterm")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	slave.Close()
	p := &ptyCmd{cmd: cmd, master: master, read: make(chan struct{}), done: make(chan error, 1)}
	go func() {
		defer close(p.read)
		buf := make([]byte, 4096)
		for {
			n, err := master.Read(buf)
			p.mu.Lock()
			p.out.Write(buf[:n])
			p.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	go func() { p.done <- cmd.Wait() }()
	s.t.Cleanup(func() {
		_ = cmd.Process.Kill()
		master.Close()
		<-p.read
	})
	return p
}

func (p *ptyCmd) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// waitFor waits until the output contains s.
func (p *ptyCmd) waitFor(t *testing.T, s string, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !strings.Contains(p.output(), s) {
		if time.Now().After(deadline) {
			t.Fatalf("no %q on the terminal after %v; it shows:\n%s", s, d, p.output())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (p *ptyCmd) write(t *testing.T, s string) {
	t.Helper()
	if _, err := p.master.WriteString(s); err != nil {
		t.Fatal(err)
	}
}

// wait waits for the command to exit and returns its exit code.
func (p *ptyCmd) wait(t *testing.T, d time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
		return p.cmd.ProcessState.ExitCode()
	case <-time.After(d):
		t.Fatalf("space did not exit within %v; terminal:\n%s", d, p.output())
	}
	return -1
}

func setup(t *testing.T) *space {
	p := testenv.StartPlatform(t, testenv.PlatformOptions{Workers: 2, ReadyTimeout: 90 * time.Second})
	return &space{t: t, bin: filepath.Join(p.BinDir, "space"), env: p.Env()}
}

// sandboxInfo is `space sandbox get --json` (the SDK's SandboxInfo names).
type sandboxInfo struct {
	SandboxID  string `json:"sandboxID"`
	TemplateID string `json:"templateID"`
	State      string `json:"state"`
}

func (s *space) create() string {
	s.t.Helper()
	var c struct {
		SandboxID string `json:"sandboxID"`
	}
	s.json(&c, "sandbox", "create", "--timeout", "600")
	if c.SandboxID == "" {
		s.t.Fatal("create --json named no sandbox")
	}
	return c.SandboxID
}

// sleeps counts the live (not zombie) sleep processes in sandbox id.
func (s *space) sleeps(id string) int {
	s.t.Helper()
	out := s.ok("exec", id, "--", "sh", "-c", "cat /proc/[0-9]*/stat 2>/dev/null")
	n := 0
	for _, l := range strings.Split(out, "\n") {
		// pid (comm) state ...
		i, j := strings.IndexByte(l, '('), strings.LastIndexByte(l, ')')
		if i < 0 || j < i || j+2 >= len(l) {
			continue
		}
		if l[i+1:j] == "sleep" && l[j+2] != 'Z' {
			n++
		}
	}
	return n
}

func (s *space) waitSleeps(id string, want int, d time.Duration) {
	s.t.Helper()
	deadline := time.Now().Add(d)
	for {
		n := s.sleeps(id)
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("sandbox %s runs %d sleep processes after %v, want %d", id, n, d, want)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func TestCLI(t *testing.T) {
	s := setup(t)
	t.Run("help", func(t *testing.T) { s.t = t; testHelp(s) })
	t.Run("json", func(t *testing.T) { s.t = t; testJSON(s) })
	t.Run("exec", func(t *testing.T) { s.t = t; testExec(s) })
	t.Run("interrupt", func(t *testing.T) { s.t = t; testInterrupt(s) })
	t.Run("terminal", func(t *testing.T) { s.t = t; testTerminal(s) })
	t.Run("lifecycle", func(t *testing.T) { s.t = t; testLifecycle(s) })
	t.Run("observe", func(t *testing.T) { s.t = t; testObserve(s) })
	t.Run("errors", func(t *testing.T) { s.t = t; testErrors(s) })
}
