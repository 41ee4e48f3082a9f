package testenv

import (
	"fmt"
	"strings"
	"testing"
)

// A skipped check must say NOT RUN and why, so a run's output lists it.
func TestRequireRootSkipsLoudly(t *testing.T) {
	ft := &fakeT{}
	func() {
		defer func() { _ = recover() }()
		if IsRoot() {
			RequireNonRoot(ft, "checks EACCES")
		} else {
			RequireRoot(ft, "namespaces")
		}
	}()
	if !ft.skipped || !strings.HasPrefix(ft.msg, SkipPrefix) || !strings.Contains(ft.msg, "needs") {
		t.Fatalf("skipped %v message %q", ft.skipped, ft.msg)
	}
}

type fakeT struct {
	testing.TB
	skipped bool
	msg     string
}

func (f *fakeT) Helper() {}
func (f *fakeT) Skipf(format string, args ...any) {
	f.skipped = true
	f.msg = sprintf(format, args...)
	panic("skip")
}

func sprintf(format string, args ...any) string { return fmt.Sprintf(format, args...) }
