package hostile

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

const apiKey = "e2b_5ace5ace5ace5ace5ace5ace5ace5ace5ace5ace"

// platform is one running `space up`.
type platform struct {
	api, edge string // host:port
	dir       string // temp dir: data dir, logs, markers
	dataDir   string
	pid       int
	tp        *testenv.Platform
	logPath   string
	client    *sdk.Client

	// The operator's terminal: space up's controlling terminal.
	ptyMaster, ptySlave *os.File
	ptyMu               sync.Mutex
	ptyOut              bytes.Buffer

	// leakPaths are the files behind the extra descriptors space up
	// inherited (fds 3 and 20).
	leakPaths []string
	// canary is an environment variable value only space up has.
	canary string
	// hostSecret is a host file no sandbox may read.
	hostSecret string
}

var (
	sharedOnce sync.Once
	sharedP    *platform
	sharedErr  error

	attackOnce sync.Once
	attackBin  []byte
	attackErr  error
)

func TestMain(m *testing.M) {
	// Many connections at once (edge floods): lift the soft file limit;
	// space up inherits it.
	var rl unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &rl) == nil && rl.Cur < rl.Max {
		rl.Cur = rl.Max
		_ = unix.Setrlimit(unix.RLIMIT_NOFILE, &rl)
	}
	code := m.Run()
	if sharedP != nil {
		if code != 0 {
			b, _ := os.ReadFile(sharedP.logPath)
			if len(b) > 64<<10 {
				b = b[len(b)-64<<10:]
			}
			fmt.Fprintf(os.Stderr, "space up log (tail):\n%s\n", b)
		}
		if err := sharedP.stop(); err != nil {
			fmt.Fprintln(os.Stderr, "hostile:", err)
			if code == 0 {
				code = 1
			}
		}
	}
	os.Exit(code)
}

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// attackProgram is the static attack binary's content.
func attackProgram(t *testing.T) []byte {
	t.Helper()
	attackOnce.Do(func() {
		d, err := os.MkdirTemp("", "hostile-attack-")
		if err != nil {
			attackErr = err
			return
		}
		defer os.RemoveAll(d)
		out := filepath.Join(d, "attack")
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, "./attack")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-buildvcs=false")
		if b, err := cmd.CombinedOutput(); err != nil {
			attackErr = fmt.Errorf("building the attack program: %v\n%s", err, b)
			return
		}
		attackBin, attackErr = os.ReadFile(out)
	})
	if attackErr != nil {
		t.Fatal(attackErr)
	}
	return attackBin
}

// shared returns the suite's platform, starting it on first use.
func shared(t *testing.T) *platform {
	t.Helper()
	testenv.RequirePlatform(t)
	sharedOnce.Do(func() { sharedP, sharedErr = start(2) })
	if sharedErr != nil {
		t.Fatalf("starting space up: %v", sharedErr)
	}
	return sharedP
}

// start runs `space up` with workers workers the way an operator's shell
// does: its own session with a terminal (a pty) as controlling terminal,
// plus two inherited descriptors it did not ask for.
func start(workers int) (*platform, error) {
	dir, err := os.MkdirTemp("", "hostile-")
	if err != nil {
		return nil, err
	}
	p := &platform{dir: dir, canary: "HOSTILE_CANARY_" + randHex(8)}
	p.hostSecret = filepath.Join(dir, "host-secret")
	if err := os.WriteFile(p.hostSecret, []byte(p.canary+"\n"), 0o644); err != nil {
		return nil, err
	}
	// fd 3 (which the sandbox's agent reuses for its socket) and fd 20
	// (which nothing reuses).
	extra := make([]*os.File, 18)
	for i, fd := range []int{3, 20} {
		path := filepath.Join(dir, fmt.Sprintf("hostile-leak-marker-%d", i))
		f, err := os.Create(path)
		if err != nil {
			return nil, err
		}
		p.leakPaths = append(p.leakPaths, path)
		extra[fd-3] = f
	}
	p.ptyMaster, p.ptySlave, err = pty.Open()
	if err != nil {
		return nil, fmt.Errorf("pty: %w", err)
	}
	go func() { // the operator's screen: everything written to the terminal
		b := make([]byte, 4096)
		for {
			n, err := p.ptyMaster.Read(b)
			if n > 0 {
				p.ptyMu.Lock()
				p.ptyOut.Write(b[:n])
				p.ptyMu.Unlock()
			}
			if err != nil {
				return
			}
		}
	}()
	// ns only: the microvm substrate's accelerator probe (seconds of TCG
	// boots) is not what this suite attacks.
	p.tp, err = testenv.LaunchPlatform(testenv.PlatformOptions{
		Workers: workers, APIKey: apiKey, Dir: dir,
		Args:        []string{"--vm-kernel-dir", filepath.Join(dir, "no-vm-kernel")},
		Env:         append(os.Environ(), "HOSTILE_CANARY="+p.canary),
		Stdin:       p.ptySlave,
		ExtraFiles:  extra,
		SysProcAttr: &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0},
	})
	for _, f := range extra {
		if f != nil {
			f.Close()
		}
	}
	if err != nil {
		p.ptyMaster.Close()
		p.ptySlave.Close()
		return nil, err
	}
	p.api, p.edge, p.dataDir, p.logPath = p.tp.APIAddr, p.tp.EdgeAddr, p.tp.DataDir, p.tp.LogPath
	p.pid = p.tp.Cmd.Process.Pid
	p.client, err = sdk.New(sdk.Config{APIURL: p.tp.APIURL, SandboxURL: p.tp.SandboxURL, APIKey: apiKey})
	if err != nil {
		p.stop()
		return nil, err
	}
	return p, nil
}

// stop interrupts space up, waits for it and removes its files (unless it
// exited badly: then they stay for the log).
func (p *platform) stop() error {
	err := p.tp.Stop()
	p.ptyMaster.Close()
	p.ptySlave.Close()
	return err
}

// ptyScreen is what reached the operator's terminal so far.
func (p *platform) ptyScreen() string {
	p.ptyMu.Lock()
	defer p.ptyMu.Unlock()
	return p.ptyOut.String()
}

// ---- sandboxes ----

type sandbox struct {
	*sdk.Sandbox
	p *platform
}

// sandbox creates a sandbox that the test kills at its end.
func (p *platform) sandbox(t *testing.T, secure bool) *sandbox {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s, err := p.client.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 10 * time.Minute, Secure: secure})
	if err != nil {
		t.Fatalf("create sandbox: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		if err := s.Kill(ctx); err != nil && !errors.Is(err, sdk.ErrNotFound) {
			t.Errorf("kill sandbox %s: %v", s.ID, err)
		}
	})
	return &sandbox{s, p}
}

// syncBuf is an io.Writer safe for concurrent reads, with waiting for a
// substring.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *syncBuf) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(b)
}

func (w *syncBuf) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// waitFor waits until the output contains s.
func (w *syncBuf) waitFor(s string, d time.Duration) bool {
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		if strings.Contains(w.String(), s) {
			return true
		}
		time.Sleep(50 * time.Millisecond)
	}
	return strings.Contains(w.String(), s)
}

// result is a finished command.
type result struct {
	out  string // stdout and stderr
	code int    // -1: did not exit normally
	err  error
}

// exec runs argv as user (root or user) and returns its combined output.
func (s *sandbox) exec(t *testing.T, d time.Duration, user string, argv ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var out syncBuf
	code, err := s.Exec(ctx, argv, sdk.RunOptions{User: user, Stdout: &out, Stderr: &out})
	return result{out.String(), code, err}
}

// sh runs a shell command line as user.
func (s *sandbox) sh(t *testing.T, user, cmd string) result {
	t.Helper()
	return s.exec(t, 90*time.Second, user, "/bin/bash", "-c", cmd)
}

// mustSh runs cmd and fails the test unless it exits 0.
func (s *sandbox) mustSh(t *testing.T, user, cmd string) string {
	t.Helper()
	r := s.sh(t, user, cmd)
	if r.err != nil || r.code != 0 {
		t.Fatalf("%s as %s: exit %d, %v:\n%s", cmd, user, r.code, r.err, r.out)
	}
	return r.out
}

// start runs argv in the background; out collects its output and done is
// closed with the result once it ends (or ctx ends).
func (s *sandbox) start(ctx context.Context, user string, argv ...string) (*syncBuf, <-chan result) {
	out := &syncBuf{}
	done := make(chan result, 1)
	go func() {
		code, err := s.Exec(ctx, argv, sdk.RunOptions{User: user, Stdout: out, Stderr: out})
		done <- result{out.String(), code, err}
	}()
	return out, done
}

// upload puts the attack program at /tmp/attack (root-owned, 0755).
func (s *sandbox) upload(t *testing.T) string {
	t.Helper()
	bin := attackProgram(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := s.WriteFile(ctx, "/tmp/attack", bin, sdk.FileOptions{User: "root"}); err != nil {
		t.Fatalf("upload the attack program: %v", err)
	}
	s.mustSh(t, "root", "chmod 755 /tmp/attack")
	return "/tmp/attack"
}

// attack runs the attack program's subcommand as user.
func (s *sandbox) attack(t *testing.T, user string, args ...string) result {
	t.Helper()
	return s.exec(t, 90*time.Second, user, append([]string{"/tmp/attack"}, args...)...)
}

// line is one "name: ok ..." / "name: err ERRNO" result.
type line struct{ name, v string }

// lines parses the attack program's result lines, in order.
func lines(out string) []line {
	var ls []line
	for _, l := range strings.Split(out, "\n") {
		name, rest, ok := strings.Cut(l, ": ")
		if !ok {
			continue
		}
		ls = append(ls, line{name, strings.TrimSpace(rest)})
	}
	return ls
}

// lookup returns the result named name.
func lookup(ls []line, name string) (string, bool) {
	for _, l := range ls {
		if l.name == name {
			return l.v, true
		}
	}
	return "", false
}

// alive checks that the sandbox still runs commands, within d.
func (s *sandbox) alive(t *testing.T, d time.Duration) time.Duration {
	t.Helper()
	t0 := time.Now()
	r := s.exec(t, d, "user", "/bin/echo", "alive")
	if r.err != nil || r.code != 0 || r.out != "alive\n" {
		t.Errorf("sandbox %s did not answer within %v: exit %d, %v, %q", s.ID, d, r.code, r.err, r.out)
	}
	return time.Since(t0)
}

// rest calls the control plane with the API key.
func (p *platform) rest(ctx context.Context, method, path string, body any, out any) (int, error) {
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://"+p.api+path, rd)
	if err != nil {
		return 0, err
	}
	req.Header.Set("X-API-Key", apiKey)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer res.Body.Close()
	raw, _ := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	if res.StatusCode/100 != 2 {
		return res.StatusCode, fmt.Errorf("%s %s: %d %s", method, path, res.StatusCode, raw)
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			return res.StatusCode, fmt.Errorf("%s %s: %v: %s", method, path, err, raw)
		}
	}
	return res.StatusCode, nil
}

// ---- the host's view ----

// hostPids are the host pids of the sandbox's processes (its agent and
// everything in its cgroups).
func hostPids(id string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		if err != nil {
			continue
		}
		cg := string(b)
		if strings.Contains(cg, "/"+id+"-") || strings.Contains(cg, "/agent."+id+"-") {
			pids = append(pids, pid)
		}
	}
	return pids
}

// agentPid is the host pid of the sandbox's agent (its pid 1).
func agentPid(t *testing.T, id string) int {
	t.Helper()
	for _, pid := range hostPids(id) {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) == 3 && f[0] == "NSpid:" && f[2] == "1" {
				return pid
			}
		}
	}
	t.Fatalf("no host process is pid 1 of sandbox %s", id)
	return 0
}

// statField returns field n (1-based, as in proc(5)) of /proc/pid/stat.
func statField(pid, n int) (int, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("bad stat %q", s)
	}
	f := strings.Fields(s[i+1:]) // field 3 onwards
	if n-3 >= len(f) {
		return 0, fmt.Errorf("bad stat %q", s)
	}
	return strconv.Atoi(f[n-3])
}

func vmRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			return kb << 10, err
		}
	}
	return 0, errors.New("no VmRSS")
}

// upperDir is the host path of the sandbox's writable layer: the
// activation directory's upper/ under the data dir that holds a marker
// file the sandbox writes now. "" when no host directory holds it (a
// layer kept elsewhere, e.g. in a disk image).
func (s *sandbox) upperDir(t *testing.T) string {
	t.Helper()
	marker := ".hostile-layer-" + randHex(6)
	s.mustSh(t, "user", "touch /home/user/"+marker)
	m, _ := filepath.Glob(filepath.Join(s.p.dataDir, "workers", "*", "act", "*", "upper", "home", "user", marker))
	if len(m) != 1 {
		t.Logf("sandbox %s: no host directory holds its writable layer (%d matches for its marker)", s.ID, len(m))
		return ""
	}
	return strings.TrimSuffix(m[0], "/home/user/"+marker)
}

// allocated is the bytes allocated to the file at path in the sandbox,
// seen from the host through its pid 1's root.
func (s *sandbox) allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st unix.Stat_t
	p := fmt.Sprintf("/proc/%d/root%s", agentPid(t, s.ID), path)
	if err := unix.Stat(p, &st); err != nil {
		t.Fatalf("stat %s: %v", p, err)
	}
	return st.Blocks * 512
}

// duBytes is what du reports for dir: allocated bytes of everything under
// it, symlinks not followed.
func duBytes(dir string) (int64, error) {
	var n int64
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(path, &st); err != nil {
			return err
		}
		n += st.Blocks * 512
		return nil
	})
	return n, err
}

func hostFree(path string) uint64 {
	var st unix.Statfs_t
	if unix.Statfs(path, &st) != nil {
		return 0
	}
	return st.Bavail * uint64(st.Bsize)
}

const mib = 1 << 20
