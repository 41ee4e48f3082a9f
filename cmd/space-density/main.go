// Command space-density measures how many idle ns sandboxes one host
// holds and what each costs (make density): tasks, processes and PSS per
// sandbox, and exec latency at that density beside low density.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spacesbx/space/internal/bench"
	"github.com/spacesbx/space/internal/substrate/ns"
)

func main() {
	// Must run first: sandboxes started by this process re-execute it as
	// their init, and MaybeInit takes over then and never returns.
	ns.MaybeInit()

	cfg := bench.DefaultDensityConfig()
	flag.IntVar(&cfg.Sandboxes, "sandboxes", cfg.Sandboxes, "target number of idle sandboxes")
	flag.IntVar(&cfg.Low, "low", cfg.Low, "sandboxes of the low-density baseline")
	flag.IntVar(&cfg.ExecSamples, "execs", cfg.ExecSamples, "timed execs at each density")
	flag.IntVar(&cfg.TaskReserve, "task-reserve", cfg.TaskReserve, "stop creating when fewer host tasks than this remain below kernel.pid_max")
	flag.StringVar(&cfg.BinDir, "bin-dir", os.Getenv("SPACE_BIN_DIR"), "directory of spaced-host, netgtw and spaced-guest (default $SPACE_BIN_DIR)")
	flag.Parse()
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "space-density: needs root (namespaces, cgroups, mounts)")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := bench.RunDensity(ctx, cfg, os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "space-density: %v\n", err)
		os.Exit(1)
	}
}
