// Package testenv is the one place tests ask what the machine gives them
// (root, /dev/kvm, built binaries, a running platform) and say loudly what
// they did not run. The tiers (docs/TESTING.md):
//
//   - unit: runs anywhere, as any user, in seconds to a minute; what
//     `make test-unit` (go test -short) runs.
//   - root: needs root (namespaces, cgroups, mounts): RequireRoot, or
//     RequireMainRoot in TestMain for a package that is all root tier.
//   - platform: needs root and a running `space up` or the built binaries
//     (SPACE_BIN_DIR): StartPlatform, LaunchPlatform, RequirePlatform.
//   - kvm: needs /dev/kvm: RequireKVM.
//
// Every tier above unit is skipped under -short, and every skip goes
// through Skipf, whose message starts with SkipPrefix, so a run can list
// what it did not run (internal/testenv/notrun reads go test -json and prints the list;
// make test and make test-unit pipe through it).
package testenv

import (
	"flag"
	"fmt"
	"os"
	"testing"
)

// SkipPrefix starts every skip message from this package, so a run's
// output can be searched for what it did not run.
const SkipPrefix = "NOT RUN"

// IsRoot reports whether the test binary runs as root.
func IsRoot() bool { return os.Geteuid() == 0 }

// Short reports whether this is a unit-tier run (go test -short), parsing
// the test flags first when TestMain has not yet.
func Short() bool {
	if !flag.Parsed() {
		flag.Parse()
	}
	return testing.Short()
}

// Skipf skips t with a SkipPrefix message: every test that does not run
// says why, whatever the reason (a missing tool, a host setting).
func Skipf(t testing.TB, format string, args ...any) {
	t.Helper()
	t.Skipf("%s (%s)", SkipPrefix, fmt.Sprintf(format, args...))
}

// RequireRoot skips t unless it runs as root, and in the unit tier; why
// names what root is needed for (namespaces, cgroups, mounts...).
func RequireRoot(t testing.TB, why string) {
	t.Helper()
	if Short() {
		Skipf(t, "root tier, skipped by -short; needs root: %s", why)
	}
	if !IsRoot() {
		Skipf(t, "needs root: %s", why)
	}
}

// RequireNonRoot skips t when it runs as root: it checks what an
// unprivileged caller gets.
func RequireNonRoot(t testing.TB, why string) {
	t.Helper()
	if IsRoot() {
		Skipf(t, "needs a non-root run: %s", why)
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

// RequireKVM skips t unless /dev/kvm can be opened, and in the unit tier.
func RequireKVM(t testing.TB) {
	t.Helper()
	if Short() {
		Skipf(t, "kvm tier, skipped by -short; needs KVM")
	}
	if ok, why := KVM(); !ok {
		Skipf(t, "needs KVM: %s", why)
	}
}

// RequireMainRoot is for TestMain of packages whose every test needs root:
// it returns false (and prints why, loudly) when the package must not
// run: not root, or the unit tier.
func RequireMainRoot(pkg, why string) bool {
	switch {
	case Short():
		fmt.Printf("%s: %s (the whole package is root tier, skipped by -short; needs root: %s)\n", SkipPrefix, pkg, why)
		return false
	case !IsRoot():
		fmt.Printf("%s: %s (the whole package needs root: %s)\n", SkipPrefix, pkg, why)
		return false
	}
	return true
}
