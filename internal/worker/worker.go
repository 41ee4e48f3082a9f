// Package worker assembles one SPACE worker (space-node): sbx-manager and
// node-api over a substrate, the verification key bundle kept current from
// the control plane's store and cached on disk, and the worker's
// registration under a lease.
package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/atomicfile"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/nodeapi"
	"github.com/spacesbx/space/internal/sbxmanager"
	"github.com/spacesbx/space/internal/substrate"
)

// Registrar registers the worker under a lease; closing the result
// deregisters it.
type Registrar interface {
	RegisterWorker(ctx context.Context, w spacev1.Worker, ttl time.Duration) (io.Closer, error)
}

// BundleSource delivers the current key bundle and every change until ctx ends.
type BundleSource interface {
	WatchBundle(ctx context.Context, fn func(capability.Bundle)) error
}

// Config configures a worker.
type Config struct {
	// ID is the worker id (DNS-label safe). Required.
	ID string
	// StateDir holds the worker's records, bundle cache and sandboxes.
	StateDir string
	// Addr is node-api's listen address. Default 127.0.0.1:0.
	Addr string
	// Capacity is the number of sandboxes the scheduler may place here.
	// Default 100.
	Capacity int
	// LeaseTTL is the registration lease. Default 10s.
	LeaseTTL time.Duration
	// FenceMargin is how long before its lease could expire in etcd the
	// worker stops serving when renewals go unanswered: it fences itself
	// at (send time of the last answered renewal + LeaseTTL −
	// FenceMargin) (fence.go). Default LeaseTTL/4; must stay below
	// LeaseTTL/2 (renewals go out every LeaseTTL/3). Fencing needs a
	// Deps.Registrar that is a LeasedRegistrar and Deps.Sandboxes that is
	// a SandboxLister.
	FenceMargin time.Duration
	// BundleWait bounds waiting for the first key bundle. Default 15s.
	BundleWait time.Duration
	// KeepSandboxesOnExit leaves the sandboxes running when the worker
	// stops (Run returns): the next worker started on StateDir re-adopts
	// them, so a restart or an upgrade of the worker binary loses nothing.
	// Default false: a stopping worker stops its sandboxes (records are
	// kept either way). A worker that dies leaves them running regardless.
	KeepSandboxesOnExit bool
	// Manager is passed to sbx-manager (its WorkerID, StateDir and Logger
	// are set from this Config's).
	Manager sbxmanager.Config
	// Logger receives the worker's logs (default slog.Default()).
	Logger *slog.Logger
}

// withDefaults returns c with its zero (or negative) fields set to the
// documented defaults.
func (c Config) withDefaults() Config {
	if c.Addr == "" {
		c.Addr = "127.0.0.1:0"
	}
	if c.Capacity <= 0 {
		c.Capacity = 100
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = 10 * time.Second
	}
	if c.FenceMargin <= 0 {
		c.FenceMargin = c.LeaseTTL / 4
	}
	if c.BundleWait <= 0 {
		c.BundleWait = 15 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate checks c; fields left zero take their defaults in New.
func (c Config) Validate() error {
	if c.ID == "" || c.StateDir == "" {
		return fmt.Errorf("worker: %w: id and state dir are required", errdefs.ErrInvalid)
	}
	if c.LeaseTTL > 0 && c.FenceMargin >= c.LeaseTTL/2 {
		return fmt.Errorf("worker: %w: fence margin %s must be below half the lease ttl %s", errdefs.ErrInvalid, c.FenceMargin, c.LeaseTTL)
	}
	return nil
}

// Deps are the worker's collaborators.
type Deps struct {
	// Substrates are the substrates this worker runs (e.g. ns and
	// microvm); routes pick one by name, and all of them are advertised
	// at registration. At least one is required.
	Substrates []substrate.Substrate
	Registrar  Registrar
	Bundles    BundleSource
	// Registerer receives metrics (nil: a private registry).
	Registerer *prometheus.Registry
	// Sandboxes, when set, tells the worker about the control plane's
	// sandbox records: executions superseded there are retired here
	// (retire.go), beside the control plane's own retire calls.
	Sandboxes SandboxWatcher
	// Snapshots is the snapshot store shared by the workers that resume
	// each other's sandboxes (nil: no snapshots).
	Snapshots sbxmanager.SnapshotStore
	// Lost, when set, is told at start about the executions this worker
	// holds records of but whose processes are gone (it restarted), so the
	// control plane recovers them instead of leaving them unserved.
	Lost LostReporter
	// Egress, when set, opens the worker's egress (links, proxy,
	// resolver) with the worker's metrics registerer and a sink for its
	// denials (the audit log). The worker runs it while it serves and
	// closes it last. Nil: sandboxes have loopback only.
	Egress func(reg prometheus.Registerer, audit func(sbxmanager.EgressDenial)) (EgressService, error)
	// Images resolves OCI images for installs that name one (nil: such
	// installs are refused).
	Images sbxmanager.ImageResolver
	// VolumeGC, when set, removes the files of team volumes the control
	// plane no longer has (deleted ones); the worker runs it at start and
	// every VolumeGCInterval while it serves.
	VolumeGC func(ctx context.Context) error
}

// VolumeGCInterval is how often Deps.VolumeGC runs.
const VolumeGCInterval = 5 * time.Minute

// EgressService is a worker's egress as the worker runs it.
type EgressService interface {
	sbxmanager.Egress
	// Run serves the proxy and the resolver until ctx ends.
	Run(ctx context.Context) error
	// Close stops them; the sandboxes' links and the egress namespace
	// stay for the next start (KeepSandboxesOnExit).
	Close() error
	// Destroy stops them and removes the namespace and every link (the
	// worker stopped its sandboxes).
	Destroy() error
}

// LostReporter is told about lost executions (the store's PutLost).
type LostReporter interface {
	PutLost(ctx context.Context, route identity.Route) error
}

// Worker is one running worker.
type Worker struct {
	cfg  Config
	deps Deps
	ver  *capability.Verifier
	mgr  *sbxmanager.Manager
	api  *nodeapi.Server
	log  *slog.Logger
	// egress is nil without Deps.Egress.
	egress EgressService
}

// New builds the worker: it loads the cached bundle (if any), opens the
// runtime records and binds node-api. Run starts serving.
func New(cfg Config, deps Deps) (*Worker, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if len(deps.Substrates) == 0 || deps.Registrar == nil || deps.Bundles == nil {
		return nil, fmt.Errorf("worker: %w: substrate, registrar and bundle source are required", errdefs.ErrInvalid)
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("worker: %w", err)
	}
	reg := deps.Registerer
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	// An empty bundle trusts no key: until one arrives every capability is
	// denied (fail closed).
	ver, _ := capability.NewVerifier(capability.Bundle{Revision: -1})
	if b, err := readBundle(bundlePath(cfg.StateDir)); err == nil {
		if err := ver.SetBundle(b); err != nil {
			cfg.Logger.Warn("cached key bundle rejected", "err", err)
		}
	}
	mc := cfg.Manager
	mc.WorkerID, mc.StateDir, mc.Logger = cfg.ID, cfg.StateDir, cfg.Logger
	mc.Registerer = prometheus.WrapRegistererWith(prometheus.Labels{"worker": cfg.ID}, reg)
	log := cfg.Logger.With("worker", cfg.ID)
	onLost := func(r identity.Route) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		putLost(ctx, deps.Lost, log, r, "its init exited")
	}
	var (
		eg      EgressService
		mgrSink atomic.Pointer[sbxmanager.Manager]
	)
	if deps.Egress != nil {
		var err error
		eg, err = deps.Egress(mc.Registerer, func(d sbxmanager.EgressDenial) {
			if m := mgrSink.Load(); m != nil {
				m.AuditEgress(d)
			}
		})
		if err != nil {
			return nil, fmt.Errorf("worker %s: egress: %w", cfg.ID, err)
		}
	}
	md := sbxmanager.Deps{Substrates: deps.Substrates, Verifier: ver, Snapshots: deps.Snapshots, WriteError: nodeapi.WriteError, OnLost: onLost, Images: deps.Images}
	if eg != nil {
		md.Egress = eg
	}
	mgr, err := sbxmanager.New(mc, md)
	if err != nil {
		if eg != nil {
			eg.Close()
		}
		return nil, err
	}
	mgrSink.Store(mgr)
	api, err := nodeapi.New(nodeapi.Config{Addr: cfg.Addr, WorkerID: cfg.ID, Gatherer: reg, Registerer: mc.Registerer, Logger: cfg.Logger}, mgr, ver)
	if err != nil {
		mgr.Close()
		if eg != nil {
			eg.Close()
		}
		return nil, err
	}
	return &Worker{cfg: cfg, deps: deps, ver: ver, mgr: mgr, api: api, log: log, egress: eg}, nil
}

// URL is node-api's base URL.
func (w *Worker) URL() string { return w.api.URL() }

// Manager exposes the worker's sbx-manager (tests, measurements).
func (w *Worker) Manager() *sbxmanager.Manager { return w.mgr }

// Verifier exposes the worker's capability verifier.
func (w *Worker) Verifier() *capability.Verifier { return w.ver }

func bundlePath(dir string) string { return filepath.Join(dir, "bundle.json") }

func readBundle(path string) (capability.Bundle, error) {
	var b capability.Bundle
	data, err := os.ReadFile(path)
	if err != nil {
		return b, err
	}
	return b, json.Unmarshal(data, &b)
}

// writeBundle caches b atomically.
func writeBundle(path string, b capability.Bundle) error {
	data, err := json.Marshal(b)
	if err != nil {
		return err
	}
	return atomicfile.Write(path, data, 0o600)
}

// Run keeps the bundle current, serves node-api, registers the worker once
// a bundle is installed, and on ctx's end deregisters, stops serving and
// stops every activation (or, with KeepSandboxesOnExit, leaves them
// running for the next worker), in that order.
func (w *Worker) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	first := make(chan struct{})
	var once sync.Once
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		err := w.deps.Bundles.WatchBundle(ctx, func(b capability.Bundle) {
			if err := w.ver.SetBundle(b); err != nil {
				w.log.Error("key bundle rejected", "revision", b.Revision, "err", err)
				return
			}
			if err := writeBundle(bundlePath(w.cfg.StateDir), b); err != nil {
				w.log.Warn("key bundle cache", "err", err)
			}
			w.log.Info("key bundle installed", "revision", b.Revision, "keys", len(b.Keys))
			once.Do(func() { close(first) })
		})
		if err != nil && ctx.Err() == nil {
			w.log.Error("key bundle watch ended", "err", err)
		}
	}()
	apiErr := make(chan error, 1)
	go func() { defer wg.Done(); apiErr <- w.api.Run(ctx) }()
	if w.egress != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := w.egress.Run(ctx); err != nil {
				w.log.Error("egress proxy stopped; sandboxes' connections out fail until the worker restarts", "err", err)
			}
		}()
	}
	if w.deps.VolumeGC != nil {
		wg.Add(1)
		go func() { defer wg.Done(); w.collectVolumes(ctx) }()
	}
	ret := &retirer{w: w, pending: map[string]chan struct{}{}, known: map[string]bool{}, atStart: w.mgr.Records(),
		unconfirmed: map[string]identity.Record{}}
	for _, rec := range ret.atStart {
		if !rec.Retired {
			ret.unconfirmed[rec.Route.SandboxID] = rec
		}
	}
	if w.deps.Sandboxes != nil {
		wg.Add(1)
		go func() { defer wg.Done(); w.watchSandboxes(ctx, ret) }()
	} else {
		w.mgr.ConfirmAdopted() // no control-plane view to wait for
	}
	defer func() {
		cancel()
		wg.Wait()
		ret.wg.Wait()
		if w.cfg.KeepSandboxesOnExit {
			w.mgr.Detach()
		} else {
			w.mgr.Close()
		}
		if w.egress != nil {
			var err error
			if w.cfg.KeepSandboxesOnExit {
				err = w.egress.Close()
			} else {
				err = w.egress.Destroy()
			}
			if err != nil {
				w.log.Warn("closing the egress namespace", "err", err)
			}
		}
	}()

	select {
	case <-first:
	case <-time.After(w.cfg.BundleWait):
		return fmt.Errorf("worker %s: %w: no key bundle after %s", w.cfg.ID, errdefs.ErrUnavailable, w.cfg.BundleWait)
	case err := <-apiErr:
		return err
	case <-ctx.Done():
		return nil
	}
	unavailable, accels := w.mgr.SubstrateStatus()
	var f *fencer
	if _, ok := w.deps.Sandboxes.(SandboxLister); ok {
		f = newFencer(w)
		wg.Add(1)
		go func() { defer wg.Done(); f.run(ctx) }()
	}
	reg, err := w.register(ctx, spacev1.Worker{
		ID: w.cfg.ID, NodeURL: w.URL(), State: "ready", Capacity: w.cfg.Capacity, Since: time.Now().UTC(),
		Substrates: w.mgr.Substrates(), Unavailable: unavailable, Accelerators: accels,
	}, f)
	if err != nil {
		return fmt.Errorf("worker %s: register: %w", w.cfg.ID, err)
	}
	w.log.Info("worker registered", "node_url", w.URL())
	w.reportLost(ctx)
	select {
	case err = <-apiErr:
	case <-ctx.Done():
	}
	if cerr := reg.Close(); cerr != nil && !errors.Is(cerr, context.Canceled) {
		w.log.Warn("deregister", "err", cerr)
	}
	return err
}

// reportLost tells the control plane about the executions whose processes
// did not survive this worker's restart. Each is logged; a report that
// fails leaves that sandbox unserved until the worker restarts again or a
// resume finds it lost, so it is logged as an error.
func (w *Worker) reportLost(ctx context.Context) {
	for _, r := range w.mgr.Lost() {
		putLost(ctx, w.deps.Lost, w.log, r, "with the worker's restart")
	}
}

// putLost reports r lost (how says how it was lost) to lr, if any, and
// logs the outcome.
func putLost(ctx context.Context, lr LostReporter, log *slog.Logger, r identity.Route, how string) {
	if lr == nil {
		return
	}
	if err := lr.PutLost(ctx, r); err != nil {
		log.Error("reporting a lost execution failed", "sandbox", r.SandboxID, "generation", r.Generation, "err", err)
		return
	}
	log.Warn("execution lost "+how+"; reported for recovery", "sandbox", r.SandboxID, "generation", r.Generation, "execution", r.ExecutionID)
}
