// Command space is SPACE's CLI (sandboxes, exec, files, terminals).
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spacesbx/space/internal/cli"
	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/node"
	"github.com/spacesbx/space/internal/substrate/ns"
)

func main() {
	// Must run first: when this binary is re-executed as a sandbox's init
	// process, MaybeInit takes over and never returns.
	ns.MaybeInit()
	node.SealInheritedFDs()
	// The crash-point suite (test/crash) kills `space up` at a named point;
	// nothing is armed without the variable.
	if spec := os.Getenv(crashpoint.EnvVar); spec != "" {
		if err := crashpoint.Arm(spec); err != nil {
			fmt.Fprintf(os.Stderr, "space: %s: %v\n", crashpoint.EnvVar, err)
			os.Exit(2)
		}
		fmt.Fprintf(os.Stderr, "space: crash point armed: %s (%s)\n", spec, crashpoint.EnvVar)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
