// Package testenv is the one place tests ask what the machine gives them
// (root, /dev/kvm) and say loudly what they did not run. Every test that
// needs root calls RequireRoot; `make test` runs as root, so there these
// checks pass and everything runs. A non-root `go test ./...` still goes
// green on the unit tier, but each skipped test names the tier it belongs
// to, and `make test-unit` prints the list (see docs/ARCHITECTURE.md,
// "Test tiers").
package testenv

import (
	"os"
	"testing"
)

// SkipPrefix starts every skip message from this package, so a run's
// output can be searched for what it did not run.
const SkipPrefix = "NOT RUN"

// IsRoot reports whether the test binary runs as root.
func IsRoot() bool { return os.Geteuid() == 0 }

// RequireRoot skips t unless it runs as root; why names what root is
// needed for (namespaces, cgroups, mounts...).
func RequireRoot(t testing.TB, why string) {
	t.Helper()
	if !IsRoot() {
		t.Skipf("%s (needs root: %s)", SkipPrefix, why)
	}
}

// RequireNonRoot skips t when it runs as root: it checks what an
// unprivileged caller gets.
func RequireNonRoot(t testing.TB, why string) {
	t.Helper()
	if IsRoot() {
		t.Skipf("%s (needs a non-root run: %s)", SkipPrefix, why)
	}
}

// KVM says whether /dev/kvm can be opened read-write by this process;
// reason says why not. A paravirtual KVM (kvm_pvm) opens fine: whether a
// guest boots under it is the microvm substrate's own probe, not this.
func KVM() (ok bool, reason string) {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return false, "/dev/kvm: " + err.Error()
	}
	f.Close()
	return true, ""
}

// RequireKVM skips t unless /dev/kvm can be opened.
func RequireKVM(t testing.TB) {
	t.Helper()
	if ok, why := KVM(); !ok {
		t.Skipf("%s (needs KVM: %s)", SkipPrefix, why)
	}
}

// RequireMainRoot is for TestMain of packages whose every test needs root:
// it returns false (and prints why, loudly) when the package must not run.
func RequireMainRoot(pkg, why string) bool {
	if IsRoot() {
		return true
	}
	os.Stdout.WriteString(SkipPrefix + ": " + pkg + " (the whole package needs root: " + why + ")\n")
	return false
}
