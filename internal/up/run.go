package up

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/spacesbx/space/internal/controlplane"
	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/node"
	"github.com/spacesbx/space/internal/telemetry"
	"github.com/spacesbx/space/internal/volume"
)

// Run is `space up`: it parses args, starts the platform, prints how to
// reach it and serves until ctx ends. getenv supplies SPACE_API_KEY and
// the log defaults (logsetup.EnvFormat, logsetup.EnvLevel).
func Run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("space up", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := Config{VMPrewarm: true}
	fs.StringVar(&cfg.APIAddr, "api-addr", DefaultAPIAddr, "control plane listen address")
	fs.StringVar(&cfg.EdgeAddr, "edge-addr", DefaultEdgeAddr, "edge (sandbox traffic) listen address")
	fs.StringVar(&cfg.EdgeTLSAddr, "edge-tls-addr", DefaultEdgeTLSAddr, "edge HTTPS listen address for the direct sandbox URLs https://<port>-<id>.<domain>[:port] (empty: none)")
	fs.StringVar(&cfg.TLSCertFile, "tls-cert", "", "PEM certificate (chain) for *.<domain> the edge serves HTTPS with (default: a local CA under <data-dir>/tls)")
	fs.StringVar(&cfg.TLSKeyFile, "tls-key", "", "PEM key of --tls-cert")
	fs.StringVar(&cfg.DataDir, "data-dir", DefaultDataDir, "state directory (etcd, keys, workers)")
	fs.IntVar(&cfg.Workers, "workers", 1, "number of workers in this process; 0: none, workers are space-node processes joining (the banner prints their flags)")
	fs.IntVar(&cfg.Capacity, "capacity", node.DefaultCapacity, "sandboxes per worker the scheduler may place (each idle ns sandbox holds about 13 host tasks against kernel.pid_max; a warning says when the host cannot hold them)")
	fs.StringVar(&cfg.APIKey, "api-key", "", "bootstrap API key e2b_<40 hex> (default $SPACE_API_KEY, else generated)")
	fs.StringVar(&cfg.BinDir, "bin-dir", "", "directory of spaced-host and spaced-guest (default: next to this binary)")
	fs.StringVar(&cfg.VMKernelDir, "vm-kernel-dir", "", "microvm guest kernel dir with vmlinuz and modules/ (default: .cache/vm/kernel of the checkout the binaries were built in; none: ns only)")
	fs.StringVar(&cfg.VMAccel, "vm-accel", "", "force the microvm accelerator, kvm or tcg (default: boot a probe guest under kvm, then tcg, and use the first that works)")
	fs.StringVar(&cfg.Domain, "domain", DefaultDomain, "public sandbox domain for <port>-<id>.<domain>")
	fs.BoolVar(&cfg.NSNoUserNamespaces, "no-user-namespaces", false, "run ns sandboxes without user namespaces (root in a sandbox is then host root for uid checks)")
	fs.BoolVar(&cfg.KeepSandboxesOnExit, "keep-sandboxes", true, "leave the sandboxes running when space up stops (SIGTERM, Ctrl-C); the next start on the same --data-dir re-adopts them. false: stop them")
	fs.Func("insecure-registry", "a registry (host:port) templates may pull images from over plain HTTP or on a private address (repeatable)", func(s string) error {
		cfg.InsecureRegistries = append(cfg.InsecureRegistries, s)
		return nil
	})
	fs.StringVar(&cfg.BaseImage, "base-image", node.BaseImageAuto, "the base template's root file system: auto (the Debian image when make base-image built it, else the host's /usr), build (build it first if missing), off (the host's /usr)")
	fs.BoolVar(&cfg.NSNoDiskQuota, "no-disk-quota", false, "keep ns sandboxes' writable layers in plain directories (no per-sandbox disk quota)")
	fs.StringVar(&cfg.VolumeRoot, "volume-root", "", "directory of the team volumes' disk images (default <data-dir>/volumes; shared storage such as NFS lets a volume follow its sandboxes to other hosts)")
	volMB := fs.Int64("volume-size-mb", volume.DefaultSize>>20, "quota of each new team volume in MiB (a sparse image: the host pays for what is written)")
	fs.DurationVar(&cfg.WorkerLossGrace, "worker-loss-grace", controlplane.DefaultWorkerLossGrace, "how long a worker's registration must be gone before its running sandboxes are recovered on other workers (new executions from their last snapshot, else their template); keep it above the workers' lease TTL (10s)")
	etcd := fs.String("etcd-endpoints", "", "comma-separated external etcd endpoints (default: embedded etcd)")
	egressFlags := node.EgressFlags(fs)
	teamDeny := fs.String("egress-deny-teams", "", "comma-separated team ids whose sandboxes never get a way out (their network options that would open one are refused)")
	// Events and webhooks.
	fs.BoolVar(&cfg.WebhookAllowPrivate, "webhook-allow-private", false, "let webhook URLs reach loopback, private and link-local addresses (tests, closed labs)")
	logOpts := logsetup.Flags(fs, logsetup.Options{Format: getenv(logsetup.EnvFormat), Level: getenv(logsetup.EnvLevel)})
	// Observability (docs/OPERATIONS.md).
	fs.StringVar(&cfg.APIMetricsAddr, "api-metrics-addr", telemetry.DefaultControlPlaneMetricsAddr, "control plane's Prometheus /metrics listener (off: none)")
	fs.StringVar(&cfg.EdgeMetricsAddr, "edge-metrics-addr", telemetry.DefaultEdgeMetricsAddr, "edge's Prometheus /metrics listener (off: none)")
	fs.StringVar(&cfg.NodeMetricsAddr, "node-metrics-addr", telemetry.DefaultNodeMetricsAddr, "workers' Prometheus /metrics listener (off: none)")
	traceCfg := telemetry.Flags(fs, telemetry.FromEnv(getenv))
	if err := fs.Parse(args); err != nil {
		return 2
	}
	// Read after parsing, not as the flag's default: -h prints defaults.
	if cfg.APIKey == "" {
		cfg.APIKey = getenv("SPACE_API_KEY")
	}
	if *etcd != "" {
		cfg.EtcdEndpoints = strings.Split(*etcd, ",")
	}
	if cfg.Workers < 0 {
		fmt.Fprintln(stderr, "space up: --workers must be 0 or more")
		return 2
	}
	cfg.ExternalWorkers = cfg.Workers == 0
	cfg.VolumeSizeBytes = *volMB << 20
	eg, err := egressFlags.Resolve()
	if err != nil {
		fmt.Fprintf(stderr, "space up: %v\n", err)
		return 2
	}
	cfg.Egress = eg
	for _, team := range strings.Split(*teamDeny, ",") {
		if team = strings.TrimSpace(team); team != "" {
			if cfg.EgressLimits == nil {
				cfg.EgressLimits = map[string]controlplane.EgressLimit{}
			}
			cfg.EgressLimits[team] = controlplane.EgressLimit{Deny: true}
		}
	}
	log, err := logsetup.New(stderr, *logOpts)
	if err != nil {
		fmt.Fprintf(stderr, "space up: %v\n", err)
		return 2
	}
	cfg.Logger, cfg.Log = log, *logOpts
	cfg.Tracing = *traceCfg
	p, err := Start(ctx, cfg)
	if err != nil {
		fmt.Fprintf(stderr, "space up: %v\n", err)
		return 1
	}
	defer p.Close()
	keyNote := ""
	if p.APIKeyGenerated {
		keyNote = " (generated; pass --api-key or SPACE_API_KEY to keep one)"
	}
	fmt.Fprintf(stdout, `SPACE is up with %d worker(s).
  control plane: %s
  edge:          %s
  API key:       %s%s
  team:          %s (the key is its admin; users and access tokens: docs/API.md)
`, len(p.Workers), p.APIURL, p.SandboxURL, p.APIKey, keyNote, controlplane.DefaultTeamID)
	printMetrics(stdout, p)
	printDirectURLs(stdout, p, cfg.Domain)
	fmt.Fprintf(stdout, `
Paste into your shell to use the e2b SDK or the space CLI:
export E2B_API_URL=%s
export E2B_SANDBOX_URL=%s
export E2B_VOLUME_API_URL=%s
`, p.APIURL, p.SandboxURL, p.APIURL)
	if p.CAFile != "" {
		fmt.Fprintf(stdout, "export NODE_EXTRA_CA_CERTS=%s\n", p.CAFile)
	}
	fmt.Fprintf(stdout, "export E2B_API_KEY=%s\n", p.APIKey)
	if cfg.ExternalWorkers {
		// Printed after the API key line, which tells a reader the
		// platform is up: the workers still have to join.
		fmt.Fprintf(stdout, "\nNo worker runs in this process; start each with:\n  space-node --id <id> --data-dir <dir> --etcd-endpoints %s --snapshot-dir %s\n",
			strings.Join(p.EtcdEndpoints(), ","), p.SnapshotDir())
	}
	<-ctx.Done()
	if cfg.KeepSandboxesOnExit {
		fmt.Fprintln(stderr, "space up: shutting down; sandboxes keep running and are re-adopted at the next start on this --data-dir (--keep-sandboxes=false stops them)")
	} else {
		fmt.Fprintln(stderr, "space up: shutting down and stopping the sandboxes")
	}
	return 0
}

// printMetrics lists the metrics listeners (docs/OPERATIONS.md).
func printMetrics(w io.Writer, p *Platform) {
	for _, m := range []struct{ name, url string }{{"api", p.APIMetricsURL}, {"edge", p.EdgeMetricsURL}, {"node", p.NodeMetricsURL}} {
		if m.url != "" {
			fmt.Fprintf(w, "  metrics %-5s  %s\n", m.name+":", m.url)
		}
	}
}

// printDirectURLs says where the direct sandbox URLs are served and, for
// the local CA, how to trust it and how the names resolve.
func printDirectURLs(w io.Writer, p *Platform, domain string) {
	if !p.DirectURLs {
		return
	}
	fmt.Fprintf(w, "  sandbox URLs:  https://<port>-<id>.%s (what the SDKs build when E2B_SANDBOX_URL is unset)\n", p.SandboxDomain)
	if p.CAFile == "" {
		return
	}
	made := ""
	if p.CACreated {
		made = " (made by this start: trust it anew)"
	}
	fmt.Fprintf(w, `
The edge's HTTPS certificates come from a local CA%s, valid only for *.%s:
  Node:   export NODE_EXTRA_CA_CERTS=%s
  curl:   curl --cacert %s https://<port>-<id>.%s/
  system: cp %s /usr/local/share/ca-certificates/space-local-ca.crt && update-ca-certificates   (Debian)
`, made, domain, p.CAFile, p.CAFile, p.SandboxDomain, p.CAFile)
	if domain == "localhost" || strings.HasSuffix(domain, ".localhost") {
		fmt.Fprintln(w, "  names:  *.localhost resolves to the loopback with glibc's myhostname module: `make run` (or `make localhost-names`) installs libnss-myhostname and adds it to the hosts line of /etc/nsswitch.conf")
	}
}
