// Command space-node runs one SPACE worker: node-api and sbx-manager over the
// namespace substrate, registered with the control plane through etcd.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/spacesbx/space/internal/substrate/ns"
	"github.com/spacesbx/space/internal/up"
)

func main() {
	ns.MaybeInit() // the sandbox init re-exec; never returns in that role
	up.SealInheritedFDs()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := up.RunNode(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
