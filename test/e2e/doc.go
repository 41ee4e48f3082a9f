// Package e2e runs SPACE end to end from its built binaries: it starts
// `space up` as a separate process and drives it with the unmodified e2b
// npm SDK (sdk.test.mjs, run by node's test runner) and with the space CLI.
package e2e
