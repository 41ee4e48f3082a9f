package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
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
	for _, want := range []string{"export E2B_API_URL=" + tp.APIURL, "export E2B_SANDBOX_URL=" + tp.SandboxURL, apiKey,
		"export NODE_EXTRA_CA_CERTS=" + tp.CAFile} {
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
	if err := localhostNamesResolve(); err != nil {
		// direct-urls.test.mjs fetches https://<port>-<id>.localhost:<port>
		// as any client would: the host must resolve those names.
		files = slices.DeleteFunc(files, func(f string) bool { return f == "direct-urls.test.mjs" })
		t.Run("direct-urls", func(t *testing.T) {
			testenv.Skipf(t, "*.localhost does not resolve here (%v): make localhost-names (part of make e2e-deps) sets it up", err)
		})
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

// localhostNamesResolve checks that a *.localhost name resolves to the
// loopback through the host's resolver (glibc NSS, as Node and curl use).
func localhostNamesResolve() error {
	out, err := exec.Command("getent", "hosts", "8000-probe.localhost").Output()
	if err != nil {
		return fmt.Errorf("getent hosts 8000-probe.localhost: %w", err)
	}
	if f := strings.Fields(string(out)); len(f) == 0 || (f[0] != "127.0.0.1" && f[0] != "::1") {
		return fmt.Errorf("8000-probe.localhost resolves to %q", strings.TrimSpace(string(out)))
	}
	return nil
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
	testTemplateBuildCLI(t, p)
	fmt.Fprintln(os.Stderr, "cli ok")
}

// testTemplateBuildCLI builds a template from a Dockerfile with `space
// template build`, starts a sandbox from it, and builds it again from the
// cache.
func testTemplateBuildCLI(t *testing.T, p *platform) {
	dir := t.TempDir()
	files := map[string]string{
		"Dockerfile": `FROM base
ARG GREETING=hi
ENV APP_HOME=/srv/app
WORKDIR $APP_HOME
COPY index.html ./
COPY conf conf
RUN echo "$GREETING from run" > run.txt
EXPOSE 8000
CMD ["python3", "-m", "http.server", "8000"]
`,
		"index.html":  "served by a dockerfile template\n",
		"conf/a.conf": "a=1\n",
	}
	for name, body := range files {
		os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755)
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	build := func(args ...string) (string, string, int) {
		cmd := exec.Command(filepath.Join(p.bin, "space"), append([]string{"template", "build"}, args...)...)
		cmd.Env = p.env()
		var stdout, stderr strings.Builder
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return stdout.String(), stderr.String(), code
	}
	ready := "ss -Htln sport = :8000 | grep -q ."
	t0 := time.Now()
	out, logs, code := build("--name", "cli-web", "--build-arg", "GREETING=hello", "--ready-cmd", ready, dir)
	cold := time.Since(t0)
	if code != 0 || strings.TrimSpace(out) == "" {
		t.Fatalf("template build: %d\n%s", code, logs)
	}
	if !strings.Contains(logs, "EXPOSE is ignored") || !strings.Contains(logs, "uploaded index.html") {
		t.Fatalf("build output lacks the warning or the upload:\n%s", logs)
	}
	run := func(args ...string) string {
		cmd := exec.Command(filepath.Join(p.bin, "space"), args...)
		cmd.Env = p.env()
		b, err := cmd.Output()
		if err != nil {
			t.Fatalf("space %v: %v", args, err)
		}
		return string(b)
	}
	id := strings.TrimSpace(run("sandbox", "create", "--template", "cli-web"))
	defer run("sandbox", "kill", id)
	if got := run("exec", id, "--", "cat", "/srv/app/run.txt"); got != "hello from run\n" {
		t.Fatalf("RUN with the build arg: %q", got)
	}
	if got := run("exec", id, "--", "cat", "/srv/app/conf/a.conf"); got != "a=1\n" {
		t.Fatalf("COPY of a directory: %q", got)
	}
	if got := run("exec", id, "--", "curl", "-s", "http://127.0.0.1:8000/index.html"); got != "served by a dockerfile template\n" {
		t.Fatalf("CMD as the start command, served at the first request: %q", got)
	}
	if got := run("exec", id, "--", "sh", "-c", "echo $APP_HOME"); got != "/srv/app\n" {
		t.Fatalf("ENV: %q", got)
	}
	t1 := time.Now()
	_, logs, code = build("--name", "cli-web", "--build-arg", "GREETING=hello", "--ready-cmd", ready, dir)
	if code != 0 || !strings.Contains(logs, "CACHED [5/5]") || !strings.Contains(logs, "index.html already uploaded") {
		t.Fatalf("second build not from the cache: %d\n%s", code, logs)
	}
	t.Logf("dockerfile template build: cold %s, cached %s", cold.Round(time.Millisecond), time.Since(t1).Round(time.Millisecond))
	os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte("FROM base\nRUN true\nCOPY ../x /x\n"), 0o644)
	if _, logs, code := build("--name", "cli-bad", dir); code == 0 || !strings.Contains(logs, "line 3") {
		t.Fatalf("a Dockerfile escaping its context: %d %s", code, logs)
	}
}
