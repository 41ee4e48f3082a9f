package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/netsim"
	"github.com/spacesbx/space/internal/testenv"
)

const apiKey = testenv.TestAPIKey

type platform struct {
	*testenv.Platform
	bin  string
	inet string // SPACE_TEST_INET: the simulated internet, as JSON
}

// startUp starts a simulated internet (network.test.mjs drives egress to
// it) and `space up` with two workers whose egress resolves and trusts
// it, and checks the banner.
func startUp(t *testing.T) *platform {
	t.Helper()
	testenv.RequirePlatform(t)
	inet, err := netsim.Start(netsim.Options{Hosts: 3})
	if err != nil {
		t.Fatalf("simulated internet: %v", err)
	}
	t.Cleanup(func() { inet.Close() })
	for name, host := range map[string]int{"allowed.test": 0, "api.allowed.test": 1, "deep.sub.allowed.test": 1, "denied.test": 2, "secret.test": 0} {
		if err := inet.SetZone(name, inet.Host(host)); err != nil {
			t.Fatal(err)
		}
	}
	ca := filepath.Join(t.TempDir(), "inet-ca.pem")
	if err := os.WriteFile(ca, inet.CAPEM(), 0o644); err != nil {
		t.Fatal(err)
	}
	desc, _ := json.Marshal(map[string]any{"hosts": inet.Hosts(), "caPEM": string(inet.CAPEM())})
	tp := testenv.StartPlatform(t, testenv.PlatformOptions{Workers: 2, APIKey: apiKey, ReadyTimeout: 60 * time.Second,
		Args: []string{"--egress=deny", "--egress-dns=" + inet.DNS().String(), "--egress-upstream-ca=" + ca, "--volume-size-mb=64"}})
	for _, want := range []string{"export E2B_API_URL=" + tp.APIURL, "export E2B_SANDBOX_URL=" + tp.SandboxURL, apiKey} {
		if !strings.Contains(tp.Banner, want) {
			t.Fatalf("banner lacks %q:\n%s", want, tp.Banner)
		}
	}
	return &platform{tp, tp.BinDir, string(desc)}
}

func (p *platform) env() []string { return append(p.Env(), "SPACE_TEST_INET="+p.inet) }

func TestE2BSDK(t *testing.T) {
	if _, err := os.Stat("node_modules/e2b/package.json"); err != nil {
		testenv.Skipf(t, "the e2b npm package is not installed (make e2e-deps installs it)")
	}
	if _, err := exec.LookPath("node"); err != nil {
		testenv.Skipf(t, "node is not installed (make deps installs it)")
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
