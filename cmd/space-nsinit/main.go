// Command space-nsinit is the init of ns sandboxes: the ns substrate
// starts it (ns.Config.InitPath) instead of re-executing the worker's own,
// much larger binary, whose package initialization (etcd, gRPC,
// Prometheus) alone takes about 15 ms on every sandbox start.
package main

import (
	"fmt"
	"os"

	"github.com/spacesbx/space/internal/substrate/ns"
)

func main() {
	ns.MaybeInit() // never returns when started as a sandbox init
	fmt.Fprintln(os.Stderr, "space-nsinit: the init of ns sandboxes; only the ns substrate starts it")
	os.Exit(2)
}
