// Command space-edge runs the client-facing data-plane edge (E2B_SANDBOX_URL).
package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spacesbx/space/internal/edge"
	"github.com/spacesbx/space/internal/edgecert"
	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/telemetry"
)

func main() {
	fs := flag.NewFlagSet("space-edge", flag.ExitOnError)
	addr := fs.String("addr", envOr("SPACE_EDGE_ADDR", edge.DefaultAddr), "listen address")
	cp := fs.String("control-plane", os.Getenv("SPACE_API_URL"), "control plane base URL, or several replicas' comma-separated (tried in turn when one is down) (env SPACE_API_URL)")
	domain := fs.String("domain", envOr("SPACE_DOMAIN", edge.DefaultDomain), "public sandbox domain for <port>-<sandbox>.<domain> hosts")
	tlsAddr := fs.String("tls-addr", "", "HTTPS listen address for https://<port>-<sandbox>.<domain> (empty: none; the plain listener stays)")
	tlsCert := fs.String("tls-cert", "", "PEM certificate (chain) for *.<domain>")
	tlsKey := fs.String("tls-key", "", "PEM key of -tls-cert")
	tlsCADir := fs.String("tls-ca-dir", "", "without -tls-cert: directory of a local CA made once (ca.pem, ca-key.pem) that signs the edge's certificates")
	maxBody := fs.Int64("max-buffered-body", edge.DefaultMaxBufferedBody, "largest request body held for a rebuilt attempt (bytes)")
	logOpts := logsetup.Flags(fs, logsetup.Options{Format: os.Getenv(logsetup.EnvFormat), Level: os.Getenv(logsetup.EnvLevel)})
	// Observability (docs/OPERATIONS.md).
	metricsAddr := fs.String("metrics-addr", telemetry.DefaultEdgeMetricsAddr, "Prometheus /metrics listener (off: none)")
	traceCfg := telemetry.Flags(fs, telemetry.FromEnv(os.Getenv))
	_ = fs.Parse(os.Args[1:])

	log, err := logsetup.New(os.Stderr, *logOpts)
	if err != nil {
		fmt.Fprintln(os.Stderr, "space-edge:", err)
		os.Exit(2)
	}
	var tlsConf *tls.Config
	if *tlsAddr != "" {
		certs, err := edgecert.New(edgecert.Config{Domain: *domain, CertFile: *tlsCert, KeyFile: *tlsKey, Dir: *tlsCADir, Logger: log})
		if err != nil {
			fmt.Fprintln(os.Stderr, "space-edge:", err)
			os.Exit(2)
		}
		if ca := certs.CAFile(); ca != "" {
			log.Info("clients trust the local CA", "ca", ca)
		}
		tlsConf = certs.TLSConfig()
	}
	// The edge key is read from the environment only, never from flags
	// (visible in process listings).
	e, err := edge.New(edge.Config{
		Addr:            *addr,
		ControlPlaneURL: *cp,
		EdgeKey:         os.Getenv("SPACE_EDGE_KEY"),
		Domain:          *domain,
		TLSAddr:         *tlsAddr,
		TLS:             tlsConf,
		MaxBufferedBody: *maxBody,
		Logger:          log,
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "space-edge:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	traceCfg.ServiceName = "space-edge"
	tp, err := telemetry.Setup(ctx, *traceCfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "space-edge:", err)
		os.Exit(2)
	}
	defer tp.Shutdown(context.Background())
	ms, err := telemetry.ListenMetrics(*metricsAddr, e.Metrics(), log)
	if err != nil {
		fmt.Fprintln(os.Stderr, "space-edge:", err)
		os.Exit(1)
	}
	defer ms.Close()
	go ms.Run(ctx)
	if err := e.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "space-edge:", err)
		os.Exit(1)
	}
}

func envOr(k, d string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return d
}
