// Package crashpoint kills the current process with SIGKILL at a named
// point of an operation, so the crash-point suite (test/crash) can prove
// what a restart recovers from a crash at exactly that point: between a
// record write and its acknowledgement, mid-archive, mid-restore.
//
// A point is one line in the code it names, crashpoint.Hit(Name). Nothing
// is armed in production: Hit then costs one atomic load. A main arms at
// most one point from its environment (SPACE_CRASHPOINT, read in cmd/
// only) with Arm before anything runs; "name@N" fires on the Nth hit.
package crashpoint

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/spacesbx/space/internal/errdefs"
)

// EnvVar is the environment variable the mains read the armed point from.
const EnvVar = "SPACE_CRASHPOINT"

// HitMessage starts the line Hit writes to stderr just before the kill:
// the harness reads it to tell the armed point's kill from any other
// death ("crashpoint hit: <name> (hit N)").
const HitMessage = "crashpoint hit: "

type armed struct {
	name string
	nth  int64
	hits atomic.Int64
}

var current atomic.Pointer[armed]

// Hit kills the process with SIGKILL when name is the armed point and
// this is its Nth hit. Nothing runs after it: no deferred function, no
// buffered log, no shutdown, as in a power cut of this process alone.
func Hit(name string) {
	a := current.Load()
	if a == nil || a.name != name {
		return
	}
	n := a.hits.Add(1)
	if n != a.nth {
		return
	}
	// Unbuffered: the line is in the log file before the kill.
	fmt.Fprintf(os.Stderr, "%s%s (hit %d)\n", HitMessage, name, n)
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // the signal is on its way; nothing after this point may run
}

// Arm parses spec ("name" or "name@N", N >= 1) and arms that point; an
// empty spec disarms. An unknown name is an error: a misspelled point
// would never fire and a crash test would prove nothing.
func Arm(spec string) error {
	if spec == "" {
		current.Store(nil)
		return nil
	}
	name, nth, err := Parse(spec)
	if err != nil {
		return err
	}
	current.Store(&armed{name: name, nth: nth})
	return nil
}

// Armed returns the armed point and its N ("" when none).
func Armed() (string, int64) {
	a := current.Load()
	if a == nil {
		return "", 0
	}
	return a.name, a.nth
}

// Parse splits spec into a known point's name and its N (1 without @N).
func Parse(spec string) (string, int64, error) {
	name, nstr, hasN := strings.Cut(spec, "@")
	nth := int64(1)
	if hasN {
		n, err := strconv.ParseInt(nstr, 10, 64)
		if err != nil || n < 1 || strings.TrimSpace(nstr) != nstr || strings.HasPrefix(nstr, "+") {
			return "", 0, fmt.Errorf("crashpoint %q: %w: the hit count after @ must be a positive integer", spec, errdefs.ErrInvalid)
		}
		nth = n
	}
	if !Known(name) {
		return "", 0, fmt.Errorf("crashpoint %q: %w: no point is named %q (see crashpoint.Points)", spec, errdefs.ErrInvalid, name)
	}
	return name, nth, nil
}

// Known reports whether name is one of Points.
func Known(name string) bool {
	for _, p := range Points {
		if p.Name == name {
			return true
		}
	}
	return false
}
