//go:build !linux

package cli

import "os"

// stdinTerminal: raw terminals are supported on Linux only.
func stdinTerminal() terminal { return nil }

// isTerminal: progress is drawn on Linux terminals only.
func isTerminal(*os.File) bool { return false }
