// Package hostile is the hostile-workload suite: it starts `space up` from
// the built binaries and attacks it for real from inside sandboxes (the
// attack programs in ./attack, built statically and uploaded through the
// files API, plus shell one-liners) and from the network. Every test is an
// attack that must fail: a failing test is a hole in the platform.
//
// One `space up` (two workers, ns substrate only) serves the whole suite.
// It runs in a session of its own with a pseudo-terminal as its
// controlling terminal (the operator's terminal, for the TIOCSTI test) and
// with two extra inherited descriptors, fds 3 and 20 (for the
// descriptor-leak test), as
// an operator's shell would start it.
//
// The heavy attacks (floods, fork bomb, memory and disk hogs, the edge
// floods) run one at a time; the probes run in parallel after them.
package hostile
