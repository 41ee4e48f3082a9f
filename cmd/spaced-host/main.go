// Command spaced-host is the per-activation host bridge between sbx-manager
// and the agent inside one sandbox (see package bridge).
package main

import (
	"os"

	"github.com/spacesbx/space/internal/bridge"
	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/telemetry"
)

func main() {
	os.Exit(bridge.Main(os.Args[1:], os.Stdout, os.Stderr, logsetup.FromEnv(os.Getenv), telemetry.FromEnv(os.Getenv)))
}
