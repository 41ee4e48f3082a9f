// Package cli is the `space` CLI's suite: it starts `space up` from the
// built binaries and drives the real built `space` binary against it, with
// plain pipes (JSON output, exit codes, stdin) and through a
// pseudo-terminal as a user's shell would (Ctrl-C during exec and inside a
// terminal session, progress on a terminal).
package cli
