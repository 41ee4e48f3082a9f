// Command space-node runs one SPACE worker: node-api and sbx-manager over the
// namespace substrate (and microvm with --vm-kernel-dir), registered with
// the control plane through etcd. Package node builds the worker, the same
// way `space up` builds each of its own.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/node"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/substrate/ns"
	"github.com/spacesbx/space/internal/telemetry"
	"github.com/spacesbx/space/internal/volume"
	"github.com/spacesbx/space/internal/worker"
)

func main() {
	ns.MaybeInit() // the sandbox init re-exec; never returns in that role
	node.SealInheritedFDs()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("space-node", flag.ContinueOnError)
	fs.SetOutput(stderr)
	id := fs.String("id", "", "worker id (required)")
	addr := fs.String("addr", "127.0.0.1:0", "node-api listen address")
	dataDir := fs.String("data-dir", "", "worker state directory (required)")
	etcd := fs.String("etcd-endpoints", "", "comma-separated etcd endpoints of the control plane (required)")
	binDir := fs.String("bin-dir", "", "directory of spaced-host and spaced-guest (default: next to this binary)")
	snapDir := fs.String("snapshot-dir", "", "snapshot store shared by all workers (required for resume on another worker)")
	vmKernel := fs.String("vm-kernel-dir", "", "microvm guest kernel dir with vmlinuz and modules/ (make vm-deps); empty: ns only")
	capacity := fs.Int("capacity", node.DefaultCapacity, "sandboxes the scheduler may place on this worker (each idle ns sandbox holds about 13 host tasks against kernel.pid_max; a warning says when the host cannot hold them)")
	noUserNS := fs.Bool("no-user-namespaces", false, "run ns sandboxes without user namespaces (root in a sandbox is then host root for uid checks)")
	noQuota := fs.Bool("no-disk-quota", false, "keep ns sandboxes' writable layers in plain directories (no per-sandbox disk quota)")
	var insecure []string
	fs.Func("insecure-registry", "a registry (host:port) templates may pull images from over plain HTTP or on a private address (repeatable)", func(s string) error { insecure = append(insecure, s); return nil })
	baseImage := fs.String("base-image", node.BaseImageAuto, "the base template's root file system: auto (the Debian image when make base-image built it, else the host's /usr), build (build it first if missing), off (the host's /usr)")
	keep := fs.Bool("keep-sandboxes", true, "leave the sandboxes running when space-node stops (SIGTERM); the next start on the same --data-dir re-adopts them. false: stop them")
	leaseTTL := fs.Duration("lease-ttl", 10*time.Second, "registration lease in etcd: a worker whose renewals go unanswered stops serving a quarter of it before the lease can expire, and serves again once it has retired what the control plane replaced meanwhile (keep space-api's --worker-loss-grace above it)")
	vmAccel := fs.String("vm-accel", "", "force the microvm accelerator, kvm or tcg (default: probe kvm, then tcg)")
	volRoot := fs.String("volume-root", "", "directory of the team volumes' disk images (default <data-dir>/volumes; mount shared storage such as NFS here so a volume follows its sandboxes to other workers)")
	volMB := fs.Int64("volume-size-mb", volume.DefaultSize>>20, "quota of each new team volume in MiB (a sparse image: the host pays for what is written)")
	egressFlags := node.EgressFlags(fs)
	logOpts := logsetup.Flags(fs, logsetup.Options{Format: getenv(logsetup.EnvFormat), Level: getenv(logsetup.EnvLevel)})
	// Observability (docs/OPERATIONS.md).
	metricsAddr := fs.String("metrics-addr", telemetry.DefaultNodeMetricsAddr, "Prometheus /metrics listener of this worker (off: none)")
	traceCfg := telemetry.Flags(fs, telemetry.FromEnv(getenv))
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *id == "" || *dataDir == "" || *etcd == "" || *snapDir == "" {
		fmt.Fprintln(stderr, "space-node: --id, --data-dir, --etcd-endpoints and --snapshot-dir are required")
		return 2
	}
	eg, err := egressFlags.Resolve()
	if err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 2
	}
	if *leaseTTL < 2*time.Second {
		fmt.Fprintln(stderr, "space-node: --lease-ttl must be at least 2s")
		return 2
	}
	if *capacity <= 0 {
		fmt.Fprintln(stderr, "space-node: --capacity must be positive")
		return 2
	}
	log, err := logsetup.New(stderr, *logOpts)
	if err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 2
	}
	if spec := getenv(crashpoint.EnvVar); spec != "" {
		if err := crashpoint.Arm(spec); err != nil {
			fmt.Fprintf(stderr, "space-node: %s: %v\n", crashpoint.EnvVar, err)
			return 2
		}
		log.Warn("crash point armed: this process kills itself there (crash-point tests only)", "point", spec)
	}
	if short := worker.PidBudget(*capacity); short != "" {
		log.Warn("host task limits below capacity: sandboxes past them fail to start", "capacity", *capacity, "limits", short)
	}
	traceCfg.ServiceName = "space-node"
	tp, err := telemetry.Setup(ctx, *traceCfg)
	if err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 2
	}
	defer tp.Shutdown(context.Background())
	st, err := store.Open(ctx, store.Config{Endpoints: strings.Split(*etcd, ","), Logger: log})
	if err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 1
	}
	defer st.Close()
	host, err := node.Open(node.Config{
		DataDir: *dataDir, SnapshotDir: *snapDir, BinDir: *binDir, Capacity: *capacity,
		VMKernelDir: *vmKernel, VMRequired: true, VMAccel: *vmAccel,
		NSNoUserNamespaces: *noUserNS, NSNoDiskQuota: *noQuota, BaseImage: *baseImage, InsecureRegistries: insecure, KeepSandboxesOnExit: *keep, Egress: eg, Logger: log, Log: *logOpts,
		VolumeRoot: *volRoot, VolumeSizeBytes: *volMB << 20, Tracing: *traceCfg, LeaseTTL: *leaseTTL,
	})
	if err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 1
	}
	defer host.Close()
	w, err := host.NewWorker(node.WorkerConfig{ID: *id, Addr: *addr, StateDir: filepath.Join(*dataDir, "worker")}, node.WorkerDeps{Store: st})
	if err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 1
	}
	ms, err := telemetry.ListenMetrics(*metricsAddr, host.Metrics(), log)
	if err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 1
	}
	defer ms.Close()
	go ms.Run(ctx)
	fmt.Fprintf(stdout, "space-node %s: node-api %s\n", *id, w.URL())
	if ms != nil {
		fmt.Fprintf(stdout, "space-node %s: metrics %s\n", *id, ms.URL())
	}
	if err := w.Run(ctx); err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 1
	}
	return 0
}
