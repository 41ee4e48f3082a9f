package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const apiKey = "e2b_5ace5ace5ace5ace5ace5ace5ace5ace5ace5ace"

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// binDir returns the directory of the built binaries: $SPACE_BIN_DIR (set
// by make test) or a fresh build.
func binDir(t *testing.T) string {
	if d := os.Getenv("SPACE_BIN_DIR"); d != "" {
		return d
	}
	d := t.TempDir()
	for _, c := range [][]string{
		{"go", "build", "-o", d + "/", "github.com/spacesbx/space/cmd/space", "github.com/spacesbx/space/cmd/spaced-host"},
		{"go", "build", "-o", filepath.Join(d, "spaced-guest"), "github.com/spacesbx/space/cmd/spaced-guest"},
	} {
		cmd := exec.Command(c[0], c[1:]...)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", c, err, out)
		}
	}
	return d
}

type platform struct {
	api, edge string
	bin       string
}

// startUp runs `space up` and waits for its banner.
func startUp(t *testing.T) *platform {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: end-to-end tests need root (namespaces, cgroups, mounts)")
	}
	bin := binDir(t)
	p := &platform{api: freeAddr(t), edge: freeAddr(t), bin: bin}
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "space"), "up", "--api-addr", p.api, "--edge-addr", p.edge,
		"--data-dir", t.TempDir(), "--api-key", apiKey, "--workers", "2", "--log-level", "warn")
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 20 * time.Second
	logf, _ := os.Create(filepath.Join(t.TempDir(), "space-up.log"))
	cmd.Stderr = logf
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		cmd.Wait() // reports the cancellation itself; the exit status tells how it ended
		if code := cmd.ProcessState.ExitCode(); code != 0 {
			t.Errorf("space up exited with %d after SIGINT", code)
		}
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("space up log:\n%s", b)
		}
		logf.Close()
	})
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		var banner strings.Builder
		for sc.Scan() {
			banner.WriteString(sc.Text() + "\n")
			if strings.HasPrefix(sc.Text(), "export E2B_API_KEY=") {
				ready <- banner.String()
			}
		}
		close(ready)
	}()
	select {
	case b, ok := <-ready:
		if !ok {
			t.Fatal("space up exited before it was ready")
		}
		for _, want := range []string{"export E2B_API_URL=http://" + p.api, "export E2B_SANDBOX_URL=http://" + p.edge, apiKey} {
			if !strings.Contains(b, want) {
				t.Fatalf("banner lacks %q:\n%s", want, b)
			}
		}
	case <-time.After(60 * time.Second):
		t.Fatal("space up not ready after 60s")
	}
	return p
}

func (p *platform) env() []string {
	return append(os.Environ(), "E2B_API_URL=http://"+p.api, "E2B_SANDBOX_URL=http://"+p.edge, "E2B_API_KEY="+apiKey,
		"SPACE_API_URL=http://"+p.api, "SPACE_SANDBOX_URL=http://"+p.edge, "SPACE_API_KEY="+apiKey)
}

func TestE2BSDK(t *testing.T) {
	if _, err := os.Stat("node_modules/e2b/package.json"); err != nil {
		t.Skip("skipping: the e2b npm package is not installed (make e2e-deps installs it)")
	}
	if _, err := exec.LookPath("node"); err != nil {
		t.Skip("skipping: node is not installed (make deps installs it)")
	}
	// Every *.test.mjs in this directory (sdk, compat-*) is part of the suite.
	files, err := filepath.Glob("*.test.mjs")
	if err != nil || len(files) == 0 {
		t.Fatalf("no *.test.mjs files: %v", err)
	}
	p := startUp(t)
	cmd := exec.Command("node", append([]string{"--test", "--test-reporter=spec"}, files...)...)
	cmd.Env = p.env()
	out, err := cmd.CombinedOutput()
	t.Logf("node --test %s:\n%s", strings.Join(files, " "), out)
	if err != nil {
		t.Fatalf("e2b SDK suite failed: %v", err)
	}
	if !strings.Contains(string(out), "fail 0") {
		t.Fatal("e2b SDK suite reported failures")
	}
}

func TestCLI(t *testing.T) {
	p := startUp(t)
	space := func(args ...string) (string, int) {
		cmd := exec.Command(filepath.Join(p.bin, "space"), args...)
		cmd.Env = p.env()
		out, err := cmd.Output()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatalf("space %v: %v", args, err)
		}
		return string(out), code
	}
	id, code := space("sandbox", "create")
	id = strings.TrimSpace(id)
	if code != 0 || id == "" {
		t.Fatalf("create: %q %d", id, code)
	}
	if out, code := space("exec", id, "--", "echo", "hello"); code != 0 || out != "hello\n" {
		t.Fatalf("exec: %q %d", out, code)
	}
	if _, code := space("exec", id, "--", "sh", "-c", "exit 7"); code != 7 {
		t.Fatalf("exit code: %d", code)
	}
	local := filepath.Join(t.TempDir(), "f.txt")
	os.WriteFile(local, []byte("through the cli\n"), 0o644)
	if _, code := space("fs", "put", id, local, "/home/user/f.txt"); code != 0 {
		t.Fatalf("fs put: %d", code)
	}
	if out, code := space("fs", "cat", id, "/home/user/f.txt"); code != 0 || out != "through the cli\n" {
		t.Fatalf("fs cat: %q %d", out, code)
	}
	if out, _ := space("sandbox", "list"); !strings.Contains(out, id) {
		t.Fatalf("list lacks %s:\n%s", id, out)
	}
	if _, code := space("sandbox", "kill", id); code != 0 {
		t.Fatalf("kill: %d", code)
	}
	if _, code := space("exec", id, "--", "true"); code == 0 {
		t.Fatal("exec in a killed sandbox succeeded")
	}
	fmt.Fprintln(os.Stderr, "cli ok")
}
