package archtest

import (
	"os/exec"
	"strings"
	"testing"
)

const mod = "github.com/spacesbx/space/"

func deps(t *testing.T, pkg string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", mod+pkg).Output()
	if err != nil {
		t.Fatalf("go list -deps %s: %v", pkg, err)
	}
	return strings.Fields(string(out))
}

// inGuest reports whether d is the guest package, one of its own
// subpackages, the host-guest channel it speaks in a microVM or the span
// report it answers traced requests with (telemetry/guestspan).
func inGuest(d string) bool {
	return d == mod+"internal/guest" || strings.HasPrefix(d, mod+"internal/guest/") || d == mod+"internal/vmchan" ||
		d == mod+"internal/telemetry/guestspan"
}

func TestDependencyRules(t *testing.T) {
	rules := []struct {
		pkg     string
		allowed func(dep string) bool
		why     string
	}{
		{"internal/identity", func(d string) bool {
			return !strings.HasPrefix(d, mod) || d == mod+"internal/identity" || d == mod+"internal/errdefs"
		}, "identity depends on nothing internal but the error classes"},
		{"internal/capability", func(d string) bool {
			return !strings.HasPrefix(d, mod) || d == mod+"internal/identity" || d == mod+"internal/capability" || d == mod+"internal/errdefs"
		}, "capability depends only on identity (and the error classes)"},
		{"internal/guest", func(d string) bool {
			return !strings.HasPrefix(d, mod) || strings.HasPrefix(d, mod+"api/envd") || inGuest(d)
		}, "the guest imports no server-side package"},
		{"internal/vmchan", func(d string) bool { return !strings.HasPrefix(d, mod) || d == mod+"internal/vmchan" },
			"the host-guest channel depends on nothing internal (both sides link it)"},
		{"internal/telemetry/guestspan", func(d string) bool { return !strings.HasPrefix(d, mod) || d == mod+"internal/telemetry/guestspan" },
			"the guest's span report depends on nothing internal (both sides link it)"},
		{"cmd/spaced-guest", func(d string) bool {
			return !strings.Contains(d, "go.etcd.io") && !strings.HasPrefix(d, mod+"internal/") || inGuest(d)
		}, "the in-sandbox binary carries only the guest"},
	}
	for _, r := range rules {
		for _, d := range deps(t, r.pkg) {
			if !r.allowed(d) {
				t.Errorf("%s imports %s: %s", r.pkg, d, r.why)
			}
		}
	}
}

// Only internal/store imports etcd.
func TestOnlyStoreImportsEtcd(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}} {{join .Imports " "}}`, mod+"...").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		for _, imp := range f[1:] {
			if strings.HasPrefix(imp, "go.etcd.io/etcd") && f[0] != mod+"internal/store" {
				t.Errorf("%s imports %s; only internal/store may", f[0], imp)
			}
		}
	}
}

// Every package says what it holds (a package doc comment), tests-only
// packages included.
func TestEveryPackageHasADocComment(t *testing.T) {
	out, err := exec.Command("go", "list", "-test=false", "-f", `{{.ImportPath}}|{{.Doc}}|{{len .GoFiles}}|{{len .TestGoFiles}}|{{len .XTestGoFiles}}`, mod+"...").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Split(line, "|")
		if len(f) != 5 {
			t.Fatalf("go list line %q", line)
		}
		if f[1] == "" {
			t.Errorf("%s has no package doc comment", f[0])
		}
	}
}

// uidlease is shared by both substrates and depends on nothing internal.
func TestUIDLeaseIsALeaf(t *testing.T) {
	for _, d := range deps(t, "internal/substrate/uidlease") {
		if strings.HasPrefix(d, mod) && d != mod+"internal/substrate/uidlease" {
			t.Errorf("internal/substrate/uidlease imports %s", d)
		}
	}
}
