// Package restart holds the restart suite: `space up` killed with SIGKILL
// and started again on the same data loses no sandbox (issue 13). It runs
// the binaries (testenv's platform tier).
package restart
