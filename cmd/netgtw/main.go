// Command netgtw is the per-activation service-port gateway that
// sbx-manager launches for each sandbox activation (see package gateway).
package main

import (
	"os"

	"github.com/spacesbx/space/internal/gateway"
	"github.com/spacesbx/space/internal/logsetup"
)

func main() {
	os.Exit(gateway.Main(os.Args[1:], os.Stdin, os.Stdout, os.Stderr, logsetup.FromEnv(os.Getenv)))
}
