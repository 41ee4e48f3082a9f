// Command space-api runs SPACE's control plane.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/spacesbx/space/internal/controlplane"
	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/telemetry"
)

func main() {
	addr := flag.String("addr", controlplane.DefaultAddr, "listen address")
	dataDir := flag.String("data-dir", "/var/lib/space/api", "embedded etcd data and, without --template-files-dir, template build files (a signing.key left here by an older release is migrated into etcd once)")
	filesDir := flag.String("template-files-dir", "", "files uploaded for template builds (default <data-dir>/template-files); with several replicas, storage they all mount (an upload reaches one replica, its build may run on another)")
	etcd := flag.String("etcd-endpoints", "", "comma-separated external etcd endpoints (default: embedded etcd)")
	// Keys default to empty and are read from the environment after
	// parsing: an environment default would be printed by -h.
	apiKey := flag.String("api-key", "", "bootstrap API key e2b_<40 hex> (default $SPACE_API_KEY, else generated)")
	edgeKey := flag.String("edge-key", "", "space-edge service key (default $SPACE_EDGE_KEY)")
	domain := flag.String("domain", controlplane.DefaultDomain, "domain reported to E2B clients, who build https://<port>-<id>.<domain>: the edge's sandbox domain with its HTTPS port unless 443 (e.g. localhost:3443)")
	sandboxURL := flag.String("sandbox-url", "", "the edge's URL, where template builds reach their build sandboxes (empty: builds disabled)")
	workerLossGrace := flag.Duration("worker-loss-grace", controlplane.DefaultWorkerLossGrace, "how long a worker's registration must be gone before its running sandboxes are recovered on other workers (new executions from their last snapshot, else their template); keep it above the workers' --lease-ttl")
	leaderTTL := flag.Duration("leader-ttl", controlplane.DefaultLeaderTTL, "lease of the control-plane election: with several space-api replicas on one etcd, a crashed leader's singletons (reaper, rotation completion) move to another within it")
	webhookAllowPrivate := flag.Bool("webhook-allow-private", false, "let webhook URLs reach loopback, private and link-local addresses (tests, closed labs)")
	logOpts := logsetup.Flags(flag.CommandLine, logsetup.Options{Format: os.Getenv(logsetup.EnvFormat), Level: os.Getenv(logsetup.EnvLevel)})
	// Observability (docs/OPERATIONS.md).
	metricsAddr := flag.String("metrics-addr", telemetry.DefaultControlPlaneMetricsAddr, "Prometheus /metrics listener (off: none)")
	traceCfg := telemetry.Flags(flag.CommandLine, telemetry.FromEnv(os.Getenv))
	flag.Parse()
	if *apiKey == "" {
		*apiKey = os.Getenv("SPACE_API_KEY")
	}
	if *edgeKey == "" {
		*edgeKey = os.Getenv("SPACE_EDGE_KEY")
	}
	log, err := logsetup.New(os.Stderr, *logOpts)
	if err != nil {
		fmt.Fprintln(os.Stderr, "space-api:", err)
		os.Exit(2)
	}
	if spec := os.Getenv(crashpoint.EnvVar); spec != "" {
		if err := crashpoint.Arm(spec); err != nil {
			fmt.Fprintf(os.Stderr, "space-api: %s: %v\n", crashpoint.EnvVar, err)
			os.Exit(2)
		}
		log.Warn("crash point armed: this process kills itself there (crash-point tests only)", "point", spec)
	}
	cfg := controlplane.Config{Addr: *addr, DataDir: *dataDir, TemplateFilesDir: *filesDir, BootstrapAPIKey: *apiKey, EdgeKey: *edgeKey, Domain: *domain, SandboxURL: *sandboxURL}
	cfg.WebhookAllowPrivate = *webhookAllowPrivate
	cfg.WorkerLossGrace = *workerLossGrace
	cfg.LeaderTTL = *leaderTTL
	traceCfg.ServiceName = "space-api"
	if err := run(log, *etcd, cfg, *metricsAddr, *traceCfg); err != nil {
		fmt.Fprintln(os.Stderr, "space-api:", err)
		os.Exit(1)
	}
}

func run(log *slog.Logger, etcd string, cfg controlplane.Config, metricsAddr string, tc telemetry.Config) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	tp, err := telemetry.Setup(ctx, tc)
	if err != nil {
		return err
	}
	defer tp.Shutdown(context.Background())
	scfg := store.Config{DataDir: filepath.Join(cfg.DataDir, "store"), Logger: log}
	if etcd != "" {
		scfg.Endpoints = strings.Split(etcd, ",")
	}
	st, err := store.Open(ctx, scfg)
	if err != nil {
		return err
	}
	defer st.Close()
	srv, err := controlplane.New(cfg, controlplane.Deps{Store: st, Logger: log})
	if err != nil {
		return err
	}
	defer srv.Close()
	if err := srv.Metrics().Register(st.Collector()); err != nil {
		return err
	}
	ms, err := telemetry.ListenMetrics(metricsAddr, srv.Metrics(), log)
	if err != nil {
		return err
	}
	defer ms.Close()
	go ms.Run(ctx) // ends with ctx; Close above waits for nothing it owns
	if key, generated := srv.BootstrapAPIKey(); generated {
		fmt.Printf("SPACE_API_KEY=%s\n", key)
	}
	return srv.Run(ctx)
}
