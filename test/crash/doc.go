// Package crash holds the crash-point suite (issue 13): `space up` is
// started with one crash point armed (internal/crashpoint,
// SPACE_CRASHPOINT), an operation is driven into that point, the process
// dies there by SIGKILL, and a restart on the same data must show no lost
// sandbox, no lost acknowledged write, no resurrected kill, no request
// served by a replaced execution and no leaked process, cgroup, mount,
// loop device or disk. `make test` runs a short pass; SPACE_CRASH_LONG=1
// (`make crash`) runs every point, in rounds with randomised hit counts.
// It runs the binaries (testenv's platform tier).
package crash
