// Command space is SPACE's CLI (sandboxes, exec, files, terminals).
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/spacesbx/space/internal/cli"
	"github.com/spacesbx/space/internal/node"
	"github.com/spacesbx/space/internal/substrate/ns"
)

func main() {
	// Must run first: when this binary is re-executed as a sandbox's init
	// process, MaybeInit takes over and never returns.
	ns.MaybeInit()
	node.SealInheritedFDs()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
