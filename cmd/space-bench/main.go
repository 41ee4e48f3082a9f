// Command space-bench measures SPACE against its performance targets and
// prints each figure beside a baseline from the same run (make bench).
package main

import (
	"context"
	"flag"
	"fmt"
	"net/http"
	_ "net/http/pprof"
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

	quick := flag.Bool("quick", false, "a smoke run with small sample sizes")
	only := flag.String("only", "", `"create": measure only sandbox creates (latency, throughput, per-phase breakdown); "vm": only the microvm section (template clones vs cold boots, idle VM memory); "restart": only a worker restart with live sandboxes (re-adoption) and the recovery of sandboxes whose init died; "isolation": only the isolation section; "serviceport": only the service-port section (edge+netgtw vs direct); "egress": only a sandbox's connections out through the egress path vs the same client on the host; "template": only template builds (a 3-step template, cold and cached); "codeinterp": only the code interpreter (runCode('1+1') p50 and create to the first result, beside commands.run('python3 -c 1')); "tracing": only the request path with tracing off vs on (no exporter); "fleet": only the control plane against 100 simulated workers (creates/s and scheduling latency, 1 and 2 replicas; needs neither root nor binaries)`)
	pprofAddr := flag.String("pprof", "", "serve net/http/pprof on this address (e.g. 127.0.0.1:6060) while measuring: the platform (edge, workers) runs in this process")
	binDir := flag.String("bin-dir", os.Getenv("SPACE_BIN_DIR"), "directory of spaced-host and spaced-guest (default $SPACE_BIN_DIR)")
	flag.Parse()
	if os.Geteuid() != 0 && *only != "fleet" {
		fmt.Fprintln(os.Stderr, "space-bench: needs root (namespaces, cgroups, mounts)")
		os.Exit(2)
	}
	if *pprofAddr != "" {
		go func() {
			if err := http.ListenAndServe(*pprofAddr, nil); err != nil {
				fmt.Fprintf(os.Stderr, "space-bench: pprof: %v\n", err)
			}
		}()
	}
	cfg := bench.DefaultConfig()
	if *quick {
		cfg = bench.QuickConfig()
	}
	cfg.BinDir = *binDir
	cfg.Only = *only
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := bench.Run(ctx, cfg, os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "space-bench: %v\n", err)
		os.Exit(1)
	}
}
