package deploycheck

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/testenv"
)

func unitRules(t *testing.T) UnitRules {
	t.Helper()
	env := map[string]map[string]string{}
	files, _ := filepath.Glob(filepath.Join(root, "deploy/systemd/env/*"))
	for _, f := range files {
		fh, err := os.Open(f)
		if err != nil {
			t.Fatal(err)
		}
		vars, err := ParseEnvFile(f, fh)
		fh.Close()
		if err != nil {
			t.Fatal(err)
		}
		base := filepath.Base(f)
		if strings.HasSuffix(base, ".env") {
			env["/etc/space/"+base] = vars
		} else {
			env["/etc/default/"+base] = vars
		}
	}
	return UnitRules{
		Built: built(t), Flags: binFlags(t), EnvFiles: env, Secret: secretFlags,
		Docs: readFile(t, "docs/DEPLOY.md") + readFile(t, "docs/CONFIGURATION.md"),
	}
}

func parseUnitFile(t *testing.T, path string) *Unit {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	u, err := ParseUnit(filepath.Base(path), f)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// unitFiles are deploy/systemd's units and drop-ins.
func unitFiles(t *testing.T) []string {
	units, _ := filepath.Glob(filepath.Join(root, "deploy/systemd/*.service"))
	dropins, _ := filepath.Glob(filepath.Join(root, "deploy/systemd/*.service.d/*.conf"))
	if len(units) != 3 || len(dropins) < 2 {
		t.Fatalf("units %v, drop-ins %v", units, dropins)
	}
	return append(units, dropins...)
}

// Every unit and drop-in passes: its binary is one we build, every flag
// it passes exists, its users and environment files are documented, and
// it is hardened as its role allows.
func TestSystemdUnits(t *testing.T) {
	r := unitRules(t)
	for _, f := range unitFiles(t) {
		for _, err := range r.Check(parseUnitFile(t, f)) {
			t.Error(err)
		}
	}
	// The etcd member example is a complete member of three.
	ex := r.EnvFiles["/etc/default/etcd"]
	if n := strings.Count(ex["ETCD_INITIAL_CLUSTER"], "="); n != 3 || ex["ETCD_NAME"] == "" {
		t.Errorf("etcd example: ETCD_INITIAL_CLUSTER %q, ETCD_NAME %q", ex["ETCD_INITIAL_CLUSTER"], ex["ETCD_NAME"])
	}
}

// Each broken unit in testdata is rejected for what is wrong with it.
func TestSystemdRejects(t *testing.T) {
	r := unitRules(t)
	for name, want := range map[string][]string{
		"unknown-flag.service":  {`--no-such-flag is not defined`},
		"not-ours.service":      {`/usr/bin/python3: not a binary make build builds`},
		"secret-flag.service":   {`--edge-key carries a secret`},
		"undefined-var.service": {`\$\{SPACE_NOPE\} is not set`},
		"node-unsafe.service":   {`KillMode=process`, `Delegate=yes`, `ProtectSystem=strict gives space-node a mount namespace`, `--keep-sandboxes=false`, `needs root`},
		"api-root.service":      {`runs as root`, `want NoNewPrivileges=yes`, `CapabilityBoundingSet is unset`, `--data-dir=/srv/api is not under a StateDirectory`},
		"undocumented.service":  {`EnvironmentFile /etc/space/secret.env has no example`, `user or group "spaceapi" is not documented`},
		"no-install.service":    {`WantedBy is missing`, `want exactly one ExecStart`},
		"dropin-execstart.conf": {`must not replace ExecStart`},
	} {
		u := parseUnitFile(t, filepath.Join("testdata/systemd-broken", name))
		wantErrs(t, name, r.Check(u), want...)
	}
	for _, bad := range []string{"[Service\nX=1\n", "X=1\n", "[Service]\nnot a pair\n", "[Service]\nExecStart=/x \\\n"} {
		if _, err := ParseUnit("bad", strings.NewReader(bad)); err == nil {
			t.Errorf("%q: parsed", bad)
		}
	}
	if _, _, err := SplitCommand(`/x "unterminated`, nil); err == nil {
		t.Error("unterminated quote accepted")
	}
}

func TestSplitCommand(t *testing.T) {
	p, argv, err := SplitCommand(`-/usr/local/bin/x --a="b c" '--d=e f' --g=${G}x $OPTS --h=\$`, map[string]string{"G": "1", "OPTS": "--i --j=2"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"/usr/local/bin/x", "--a=b c", "--d=e f", "--g=1x", "--i", "--j=2", "--h=$"}
	if p != "-" || strings.Join(argv, "|") != strings.Join(want, "|") {
		t.Errorf("%q %q, want %q", p, argv, want)
	}
}

// systemd's own reader: systemd-analyze verify on each unit, its binary
// pointed at the built one (verify insists it exists). Any warning fails,
// and a unit with a setting systemd cannot parse is caught.
func TestSystemdAnalyzeVerify(t *testing.T) {
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		testenv.Skipf(t, "systemd-analyze is not installed (make deploy-deps installs Debian's systemd)")
	}
	binFlags(t) // the binaries: $SPACE_BIN_DIR or a build
	dir := binDir
	units, _ := filepath.Glob(filepath.Join(root, "deploy/systemd/*.service"))
	for _, u := range units {
		if problems := analyzeVerify(t, sa, dir, u); len(problems) > 0 {
			t.Errorf("systemd-analyze verify %s:\n%s", filepath.Base(u), strings.Join(problems, "\n"))
		}
	}
	bad := analyzeVerify(t, sa, dir, "testdata/systemd-broken/verify-bad.service")
	if len(bad) < 2 {
		t.Errorf("systemd-analyze verify accepted verify-bad.service: %q", bad)
	}
}

func analyzeVerify(t *testing.T, sa, binDir, unit string) []string {
	t.Helper()
	data, err := os.ReadFile(unit)
	if err != nil {
		t.Fatal(err)
	}
	abs, _ := filepath.Abs(binDir)
	text := strings.ReplaceAll(string(data), BinDir+"/", abs+"/")
	// The environment file exists on a real host only.
	text = regexp.MustCompile(`(?m)^EnvironmentFile=`).ReplaceAllString(text, "EnvironmentFile=-")
	p := filepath.Join(t.TempDir(), filepath.Base(unit))
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(sa, "verify", "--man=no", p).CombinedOutput()
	var problems []string
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if l != "" {
			problems = append(problems, l)
		}
	}
	if err != nil {
		problems = append(problems, err.Error())
	}
	return problems
}
