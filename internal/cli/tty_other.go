//go:build !linux

package cli

// stdinTerminal: raw terminals are supported on Linux only.
func stdinTerminal() terminal { return nil }
