// Package up runs a whole single-machine SPACE in one process: embedded etcd,
// the control plane, N workers (built by package node, sharing one set of
// substrates, each launching spaced-host bridges) and the edge. It is what
// `space up` and the integration and end-to-end tests start.
package up

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/controlplane"
	"github.com/spacesbx/space/internal/edge"
	"github.com/spacesbx/space/internal/edgecert"
	"github.com/spacesbx/space/internal/guest"
	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/node"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/substrate/ns"
	"github.com/spacesbx/space/internal/telemetry"
	"github.com/spacesbx/space/internal/worker"
)

// Config configures a single-machine SPACE.
type Config struct {
	// APIAddr is the control plane's address. Default 127.0.0.1:3000.
	APIAddr string
	// EdgeAddr is the edge's address (E2B_SANDBOX_URL). Default 127.0.0.1:3001.
	EdgeAddr string
	// DataDir holds etcd, keys and worker state. Default ./.data.
	DataDir string
	// SnapshotDir is the snapshot store every worker shares (resume on
	// another worker restores from it). Default <DataDir>/snapshots.
	SnapshotDir string
	// Workers is the number of workers in this process. Default 1.
	Workers int
	// ExternalWorkers runs no worker in this process (`--workers 0`):
	// workers are space-node processes joining its etcd (Platform.
	// EtcdEndpoints) with its SnapshotDir, so one can crash or be
	// upgraded without the control plane and edge. Start returns without
	// waiting for any worker.
	ExternalWorkers bool
	// Capacity is how many sandboxes the scheduler places on each worker
	// (worker.Config.Capacity). Default 100. Start logs a warning when
	// the host's task limits (kernel.pid_max) cannot hold that many.
	Capacity int
	// VolumeRoot and VolumeSizeBytes place and size team volumes
	// (node.Config; default <DataDir>/volumes, 10 GiB each).
	VolumeRoot      string
	VolumeSizeBytes int64
	// APIKey is the bootstrap API key (e2b_<40 hex>); generated if empty.
	APIKey string
	// EtcdEndpoints selects an external etcd instead of the embedded one.
	EtcdEndpoints []string
	// BinDir holds spaced-host and spaced-guest. Default: the directory of
	// the running executable.
	BinDir string
	// Domain is the public sandbox domain. Default localhost.
	Domain string
	// EdgeTLSAddr is the edge's HTTPS address for the direct sandbox URLs
	// https://<port>-<id>.<Domain> (`space up`: 127.0.0.1:3443); empty:
	// no HTTPS. With it, the domain the API reports carries its port
	// unless that is 443 ("localhost:3443"), so the SDKs' getHost(port)
	// and envd URLs reach it as they are.
	EdgeTLSAddr string
	// TLSCertFile and TLSKeyFile are the operator's certificate and key
	// for *.<Domain>; without them the edge's certificates come from a
	// local CA made once under <DataDir>/tls (package edgecert).
	TLSCertFile, TLSKeyFile string
	// VMKernelDir holds the microvm guest kernel (vmlinuz) and its modules
	// (modules/), as `make vm-deps` extracts them. Default: .cache/vm/kernel
	// beside BinDir's parent (the repository) when it exists. Without it,
	// or without QEMU, workers run the ns substrate only and creating a
	// base-vm sandbox is unavailable (503).
	VMKernelDir string
	// VMAccel forces the microvm accelerator ("kvm" or "tcg"); empty (the
	// default): each start boots a probe guest under KVM, then TCG, and
	// uses the first that works (none: base-vm creates get 503 with the
	// reason).
	VMAccel string
	// VMPrewarm builds the base-vm template snapshot at start (in the
	// background), so the first microVM create is a clone too; `space up`
	// sets it. Off: the first create builds it.
	VMPrewarm bool
	// VMNoTemplates boots every microVM cold (no template snapshots); the
	// benchmark's baseline.
	VMNoTemplates bool
	// NSNoUserNamespaces and NSNoDiskQuota turn off the ns substrate's
	// user namespaces and layer disks (ns.Config; both on by default where
	// the host supports them).
	NSNoUserNamespaces, NSNoDiskQuota bool
	// BaseImage is where the `base` template's root file system comes
	// from: node.BaseImageAuto (default; the Debian base image when make
	// base-image built it, else the host's /usr), BaseImageBuild or
	// BaseImageOff. BaseImageCache is its cache (default
	// /var/cache/space/images). The host-/usr template is always
	// creatable as "base-host".
	BaseImage, BaseImageCache string
	// InsecureRegistries may serve templates' OCI images over plain HTTP
	// and on private addresses (node.Config.InsecureRegistries).
	InsecureRegistries []string
	// DefaultLimits apply to sandboxes (zero: substrate defaults).
	DefaultLimits spacev1.Limits
	// KeepSandboxesOnExit leaves the sandboxes running when the platform
	// stops; the next start on DataDir re-adopts them (node.Config).
	// Default false; `space up --keep-sandboxes` defaults to true.
	KeepSandboxesOnExit bool
	// UnsafeSkipIdentityChecks is the baseline of the on/off benchmark only.
	UnsafeSkipIdentityChecks bool
	// Egress is the workers' way out for sandboxes (node.EgressConfig;
	// default: deny unless a sandbox's network options open it).
	Egress node.EgressConfig
	// EgressLimits are per-team limits (controlplane.Config.EgressLimits).
	EgressLimits map[string]controlplane.EgressLimit
	// WorkerLossGrace is controlplane.Config.WorkerLossGrace (default
	// 30 s): how long a worker stays unregistered before its running
	// sandboxes are recovered on other workers.
	WorkerLossGrace time.Duration
	// WebhookAllowPrivate: controlplane.Config.WebhookAllowPrivate (events).
	WebhookAllowPrivate bool
	// Logger defaults to slog.Default(); `space up` builds it with
	// package logsetup.
	Logger *slog.Logger
	// Log is the format and level Logger was made with; the workers'
	// helper processes log the same way.
	Log logsetup.Options

	// Observability (internal/telemetry, docs/OPERATIONS.md): each
	// component's metrics listener (empty: none; `space up` defaults to
	// telemetry.Default*MetricsAddr) and the tracing configuration
	// (Start installs it; spaced-host gets it too).
	APIMetricsAddr, EdgeMetricsAddr, NodeMetricsAddr string
	Tracing                                          telemetry.Config
}

// Defaults of Config's fields.
const (
	DefaultAPIAddr  = "127.0.0.1:3000"
	DefaultEdgeAddr = "127.0.0.1:3001"
	// DefaultEdgeTLSAddr is `space up`'s --edge-tls-addr (Config's
	// EdgeTLSAddr has no default: no HTTPS).
	DefaultEdgeTLSAddr = "127.0.0.1:3443"
	DefaultDataDir     = ".data"
	DefaultDomain      = "localhost"
)

// maxWorkers bounds Config.Workers.
const maxWorkers = 64

// withDefaults returns c with the documented defaults in its zero fields.
// DataDir is made absolute (the workers' and substrates' paths derive
// from it).
func (c Config) withDefaults() Config {
	if c.APIAddr == "" {
		c.APIAddr = DefaultAPIAddr
	}
	if c.EdgeAddr == "" {
		c.EdgeAddr = DefaultEdgeAddr
	}
	if c.DataDir == "" {
		c.DataDir = DefaultDataDir
	}
	if abs, err := filepath.Abs(c.DataDir); err == nil {
		c.DataDir = abs
	}
	if c.ExternalWorkers {
		c.Workers = 0
	} else if c.Workers <= 0 { // a negative count has always meant the default
		c.Workers = 1
	}
	if c.Capacity == 0 {
		c.Capacity = node.DefaultCapacity
	}
	if c.BinDir == "" {
		if exe, err := os.Executable(); err == nil {
			c.BinDir = filepath.Dir(exe)
		}
	}
	if c.Domain == "" {
		c.Domain = DefaultDomain
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.SnapshotDir == "" {
		c.SnapshotDir = filepath.Join(c.DataDir, "snapshots")
	}
	if c.VMKernelDir == "" && c.BinDir != "" {
		if d := filepath.Join(filepath.Dir(c.BinDir), ".cache", "vm", "kernel"); fileExists(filepath.Join(d, "vmlinuz")) {
			c.VMKernelDir = d
		}
	}
	return c
}

// Validate checks c (a zero field that has a default is valid) and that
// BinDir holds the binaries every worker starts.
func (c Config) Validate() error {
	if c.Workers > maxWorkers {
		return fmt.Errorf("up: at most %d workers", maxWorkers)
	}
	if c.Capacity < 0 {
		return fmt.Errorf("up: capacity %d: want a positive number of sandboxes per worker", c.Capacity)
	}
	if (c.TLSCertFile != "" || c.TLSKeyFile != "") && c.EdgeTLSAddr == "" {
		return fmt.Errorf("up: a TLS certificate without EdgeTLSAddr (--edge-tls-addr) would not be served")
	}
	if c.BinDir == "" { // the default: beside the executable
		return nil
	}
	for _, b := range []string{"spaced-host", "spaced-guest"} {
		if _, err := os.Stat(filepath.Join(c.BinDir, b)); err != nil {
			return fmt.Errorf("up: %s not found in %s (run make build): %w", b, c.BinDir, err)
		}
	}
	return nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// Platform is a running single-machine SPACE.
type Platform struct {
	cfg     Config
	st      *store.Store
	cp      *controlplane.Server
	host    *node.Host // the substrates and snapshot store every worker shares
	Workers []*worker.Worker
	edge    *edge.Edge

	// APIURL, SandboxURL and APIKey are what clients need.
	APIURL     string
	SandboxURL string
	APIKey     string
	// SandboxDomain is the domain the API reports (Domain, with the
	// HTTPS port unless it is 443); DirectURLs is true when the edge
	// serves https://<port>-<id>.<SandboxDomain>. CAFile is the local
	// CA clients trust ("" with an operator certificate); CACreated
	// says this start made it.
	SandboxDomain string
	DirectURLs    bool
	CAFile        string
	CACreated     bool
	// APIKeyGenerated is true when no key was configured.
	APIKeyGenerated bool

	// MetricsURLs are the /metrics URLs of the control plane, the edge and
	// the node ("" when that listener is off).
	APIMetricsURL, EdgeMetricsURL, NodeMetricsURL string
	tracer                                        *telemetry.Provider

	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	errs   []error
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// Start brings every component up, in dependency order, and returns once
// all workers are registered and the edge listens.
func Start(ctx context.Context, cfg Config) (_ *Platform, err error) {
	cfg = cfg.withDefaults()
	if cfg.BinDir == "" {
		return nil, fmt.Errorf("up: find binaries: the running executable's path is unknown: set BinDir")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return nil, fmt.Errorf("up: %w", err)
	}
	rctx, cancel := context.WithCancel(context.Background())
	p := &Platform{cfg: cfg, cancel: cancel}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()

	// The microvm substrate boots its accelerator probe guests (seconds
	// under TCG) while etcd and the control plane start: node.Open only
	// begins it.
	vmKernel := cfg.VMKernelDir
	if cfg.ExternalWorkers {
		vmKernel = "" // no worker here boots a guest: the host serves snapshots and volumes only
	}
	p.host, err = node.Open(node.Config{
		DataDir: cfg.DataDir, SnapshotDir: cfg.SnapshotDir, BinDir: cfg.BinDir,
		VMKernelDir: vmKernel, VMAccel: cfg.VMAccel, VMPrewarm: cfg.VMPrewarm, VMNoTemplates: cfg.VMNoTemplates,
		NSNoUserNamespaces: cfg.NSNoUserNamespaces, NSNoDiskQuota: cfg.NSNoDiskQuota,
		BaseImage: cfg.BaseImage, BaseImageCache: cfg.BaseImageCache, InsecureRegistries: cfg.InsecureRegistries,
		Capacity: cfg.Capacity, DefaultLimits: cfg.DefaultLimits, UnsafeSkipIdentityChecks: cfg.UnsafeSkipIdentityChecks,
		KeepSandboxesOnExit: cfg.KeepSandboxesOnExit, Egress: cfg.Egress,
		VolumeRoot: cfg.VolumeRoot, VolumeSizeBytes: cfg.VolumeSizeBytes,
		Logger: log, Log: cfg.Log, Tracing: cfg.Tracing,
	})
	if err != nil {
		return nil, fmt.Errorf("up: %w", err)
	}
	if err := p.startObservability(); err != nil {
		return nil, err
	}
	p.st, err = store.Open(ctx, store.Config{DataDir: filepath.Join(cfg.DataDir, "store"), Endpoints: cfg.EtcdEndpoints, Logger: log})
	if err != nil {
		return nil, fmt.Errorf("up: store: %w", err)
	}
	edgeKey := "edge_" + randomHex(24)
	// The edge's address first: template builds reach their sandboxes
	// through it.
	edgeLn, err := net.Listen("tcp", cfg.EdgeAddr)
	if err != nil {
		return nil, fmt.Errorf("up: edge listen: %w", err)
	}
	edgeServed := false
	defer func() {
		if !edgeServed {
			edgeLn.Close()
		}
	}()
	p.SandboxURL = "http://" + edgeLn.Addr().String()
	var tlsLn net.Listener
	var certs *edgecert.Certs
	p.SandboxDomain = cfg.Domain
	if cfg.EdgeTLSAddr != "" {
		certs, err = edgecert.New(edgecert.Config{Domain: cfg.Domain, CertFile: cfg.TLSCertFile, KeyFile: cfg.TLSKeyFile,
			Dir: filepath.Join(cfg.DataDir, "tls"), Logger: log})
		if err != nil {
			return nil, fmt.Errorf("up: %w", err)
		}
		p.CAFile, p.CACreated = certs.CAFile(), certs.CACreated()
		if tlsLn, err = net.Listen("tcp", cfg.EdgeTLSAddr); err != nil {
			return nil, fmt.Errorf("up: edge TLS listen: %w", err)
		}
		defer func() {
			if !edgeServed {
				tlsLn.Close()
			}
		}()
		p.DirectURLs = true
		if port := tlsLn.Addr().(*net.TCPAddr).Port; port != 443 {
			p.SandboxDomain = net.JoinHostPort(cfg.Domain, strconv.Itoa(port))
		}
	}
	p.cp, err = controlplane.New(controlplane.Config{
		Addr: cfg.APIAddr, DataDir: filepath.Join(cfg.DataDir, "api"), BootstrapAPIKey: cfg.APIKey,
		EdgeKey: edgeKey, Domain: p.SandboxDomain, DefaultEnvdVersion: guest.EnvdVersion, EgressLimits: cfg.EgressLimits,
		SandboxURL:          p.SandboxURL,
		WebhookAllowPrivate: cfg.WebhookAllowPrivate, // events
		WorkerLossGrace:     cfg.WorkerLossGrace,
		Templates: map[string]controlplane.Template{
			"base": controlplane.DefaultTemplate, "base-vm": controlplane.DefaultVMTemplate,
			ns.TemplateBaseHost:            controlplane.DefaultTemplate,
			node.TemplateCodeInterpreter:   controlplane.CodeInterpreterTemplate,
			node.VMTemplateCodeInterpreter: controlplane.CodeInterpreterVMTemplate,
		},
	}, controlplane.Deps{Store: p.st, Logger: log, Snapshots: p.host.Snapshots(), Volumes: volumeFiles(p.host)})
	if err != nil {
		return nil, fmt.Errorf("up: control plane: %w", err)
	}
	p.APIKey, p.APIKeyGenerated = p.cp.BootstrapAPIKey()
	apiLn, err := net.Listen("tcp", cfg.APIAddr)
	if err != nil {
		return nil, fmt.Errorf("up: control plane listen: %w", err)
	}
	p.APIURL = "http://" + apiLn.Addr().String()
	p.goRun("control plane", func() error { return p.cp.Serve(rctx, apiLn) })

	if short := worker.PidBudget(cfg.Workers * cfg.Capacity); short != "" {
		log.Warn("host task limits below capacity: sandboxes past them fail to start", "workers", cfg.Workers, "capacity", cfg.Capacity, "limits", short)
	}
	for i := range cfg.Workers {
		id := fmt.Sprintf("w%d", i+1)
		w, err := p.host.NewWorker(node.WorkerConfig{ID: id, StateDir: filepath.Join(cfg.DataDir, "workers", id)}, node.WorkerDeps{Store: p.st})
		if err != nil {
			return nil, fmt.Errorf("up: %w", err)
		}
		p.Workers = append(p.Workers, w)
		p.goRun("worker "+id, func() error { return w.Run(rctx) })
	}
	if err := p.waitWorkers(ctx); err != nil {
		return nil, err
	}

	ecfg := edge.Config{Addr: cfg.EdgeAddr, ControlPlaneURL: p.APIURL, EdgeKey: edgeKey, Domain: cfg.Domain, Logger: log}
	if certs != nil {
		ecfg.TLS = certs.TLSConfig()
	}
	p.edge, err = edge.New(ecfg)
	if err != nil {
		return nil, fmt.Errorf("up: edge: %w", err)
	}
	edgeServed = true
	p.goRun("edge", func() error { return p.edge.Serve(rctx, edgeLn) })
	if err := p.serveMetrics(rctx); err != nil {
		return nil, err
	}
	if tlsLn != nil {
		p.goRun("edge https", func() error { return p.edge.ServeTLS(rctx, tlsLn) })
	}
	return p, nil
}

// EtcdEndpoints are the client URLs of the platform's etcd (the embedded
// one's, or Config.EtcdEndpoints): what a space-node joining it names.
func (p *Platform) EtcdEndpoints() []string { return p.st.Endpoints() }

// SnapshotDir is the snapshot store its workers share.
func (p *Platform) SnapshotDir() string { return p.cfg.SnapshotDir }

// VMAccel reports the microvm substrate's accelerator ("kvm" or "tcg"), or
// "" when the platform runs without it (no guest kernel or QEMU).
func (p *Platform) VMAccel() string {
	if vm := p.host.VM(); vm != nil {
		return vm.Accel()
	}
	return ""
}

func (p *Platform) goRun(name string, f func() error) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		if err := f(); err != nil && !errors.Is(err, context.Canceled) {
			p.cfg.Logger.Error("component stopped", "component", name, "err", err)
			p.mu.Lock()
			p.errs = append(p.errs, fmt.Errorf("%s: %w", name, err))
			p.mu.Unlock()
		}
	}()
}

func (p *Platform) waitWorkers(ctx context.Context) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		ws, err := p.st.ListWorkers(ctx)
		if err == nil && len(ws) >= len(p.Workers) {
			return nil
		}
		p.mu.Lock()
		errs := errors.Join(p.errs...)
		p.mu.Unlock()
		if errs != nil {
			return fmt.Errorf("up: %w", errs)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("up: workers did not register within 30s (have %d of %d): %v", len(ws), len(p.Workers), err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Err reports components that stopped on their own.
func (p *Platform) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return errors.Join(p.errs...)
}

// Close stops the edge, then the control plane and the workers (which
// deregister and stop their sandboxes), then the substrate and the store.
func (p *Platform) Close() error {
	if p.edge != nil {
		p.edge.Close()
	}
	p.cancel()
	p.wg.Wait()
	if p.cp != nil {
		p.cp.Close()
	}
	if p.host != nil {
		p.host.Close()
	}
	if p.st != nil {
		p.st.Close()
	}
	if p.tracer != nil {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		p.tracer.Shutdown(sctx)
		cancel()
	}
	return nil
}

// volumeFiles is the host's volumes for the control plane's content API
// (a nil interface when the host has none).
func volumeFiles(h *node.Host) controlplane.VolumeFiles {
	if v := h.Volumes(); v != nil {
		return v
	}
	return nil
}
