// Package archtest holds no code: its test enforces the package dependency
// rules of docs/ARCHITECTURE.md with `go list -deps`.
package archtest
