// Package node builds SPACE workers from one configuration: the
// substrates a machine's workers share (ns, and microvm when a guest
// kernel is configured), the snapshot store, and each worker's
// sbx-manager configuration and collaborators over the store. `space up`
// (internal/up, N workers in one process) and space-node (one worker
// joined to a control plane's etcd) both build their workers here, so a
// new substrate or worker dependency is wired in one place.
package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/guest"
	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/sbxmanager"
	"github.com/spacesbx/space/internal/snapshot"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/substrate/microvm"
	"github.com/spacesbx/space/internal/substrate/ns"
	"github.com/spacesbx/space/internal/telemetry"
	"github.com/spacesbx/space/internal/volume"
	"github.com/spacesbx/space/internal/worker"
)

// Config configures the substrates and workers of one machine.
type Config struct {
	// DataDir holds the substrates' state (ns/, microvm/). Required.
	DataDir string
	// SnapshotDir is the snapshot store every worker shares (resume on
	// another worker restores from it). Required.
	SnapshotDir string
	// BinDir holds spaced-host, spaced-guest, netgtw and space-nsinit.
	// Default: the directory of the running executable.
	BinDir string
	// VMKernelDir holds the microvm guest kernel (vmlinuz) and its
	// modules (modules/). Empty (the default): ns only.
	VMKernelDir string
	// VMRequired makes a microvm substrate that fails to open an error of
	// Open (space-node, whose operator named the kernel). Off (the
	// default): a warning, and the workers run ns only (space up, which
	// finds a kernel by itself when there is one).
	VMRequired bool
	// VMAccel forces the microvm accelerator ("kvm" or "tcg"). Default:
	// probe KVM, then TCG.
	VMAccel string
	// VMPrewarm builds the base-vm template snapshot in the background at
	// open. Default off: the first create builds it.
	VMPrewarm bool
	// VMNoTemplates boots every microVM cold (the benchmark's baseline).
	VMNoTemplates bool
	// NSNoUserNamespaces and NSNoDiskQuota turn off the ns substrate's
	// user namespaces and layer disks (ns.Config; both on by default where
	// the host supports them).
	NSNoUserNamespaces, NSNoDiskQuota bool
	// BaseImage is where the ns `base` template's root file system comes
	// from (BaseImageAuto, BaseImageBuild, BaseImageOff; default auto).
	// The host template stays reachable as ns.TemplateBaseHost.
	BaseImage string
	// BaseImageCache is the Debian base image cache (default
	// baseimage.DefaultCacheDir).
	BaseImageCache string
	// ImageDir is the layer store of pulled OCI images, shared by the
	// host's workers (default DataDir/images).
	ImageDir string
	// InsecureRegistries (host[:port]) may be pulled from over plain HTTP
	// and on private addresses; every other registry must be public and
	// speak HTTPS.
	InsecureRegistries []string
	// VolumeRoot holds the team volumes' disk images (volume.Config.Root).
	// Default <DataDir>/volumes, on this host's disk. Point it at shared
	// storage the operator mounted (NFS) so a sandbox moved to another
	// host mounts the same volumes there (one host at a time per volume:
	// internal/volume's package doc).
	VolumeRoot string
	// VolumeSizeBytes is a new volume's quota (volume.Config.SizeBytes;
	// default volume.DefaultSize, 10 GiB, sparse on the host).
	VolumeSizeBytes int64
	// Capacity is how many sandboxes the scheduler places on each worker
	// (worker.Config.Capacity). Default 100.
	Capacity int
	// LeaseTTL is each worker's registration lease
	// (worker.Config.LeaseTTL; default 10 s). A worker whose renewals go
	// unanswered fences itself a quarter of it before the lease can
	// expire; keep the control plane's worker-loss grace above it.
	LeaseTTL time.Duration
	// DefaultLimits apply to sandboxes (zero: substrate defaults).
	DefaultLimits spacev1.Limits
	// KeepSandboxesOnExit leaves the workers' sandboxes running when
	// they stop, for the next start to re-adopt
	// (worker.Config.KeepSandboxesOnExit). Default false; the commands'
	// flag (--keep-sandboxes) defaults to true.
	KeepSandboxesOnExit bool
	// UnsafeSkipIdentityChecks is the baseline of the on/off benchmark only.
	UnsafeSkipIdentityChecks bool
	// Egress is the workers' way out for sandboxes (default: links and
	// proxy on, policy deny unless a sandbox's options open it).
	Egress EgressConfig
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Log is the format and level Logger was made with; the worker's
	// helper processes (spaced-host, netgtw) log the same way.
	Log logsetup.Options

	// Observability (internal/telemetry): Tracing is passed on to each
	// spaced-host (telemetry.Env) so it exports to the same collector.
	Tracing telemetry.Config
}

// Config.BaseImage's values.
const (
	// BaseImageAuto: the Debian base image when it is in the cache (make
	// base-image builds it), else the host template, with a warning saying
	// why. Starting a worker never waits for a build.
	BaseImageAuto = "auto"
	// BaseImageBuild: build the image first when it is missing (minutes);
	// the host template only if that fails.
	BaseImageBuild = "build"
	// BaseImageOff: the host template (the host's /usr).
	BaseImageOff = "off"
)

// DefaultCapacity is Config.Capacity's default.
const DefaultCapacity = 100

func (c Config) withDefaults() Config {
	if c.BinDir == "" {
		if exe, err := os.Executable(); err == nil {
			c.BinDir = filepath.Dir(exe)
		}
	}
	if c.Capacity == 0 {
		c.Capacity = DefaultCapacity
	}
	if c.BaseImage == "" {
		c.BaseImage = BaseImageAuto
	}
	if c.VolumeRoot == "" && c.DataDir != "" {
		c.VolumeRoot = filepath.Join(c.DataDir, "volumes")
	}
	if abs, err := filepath.Abs(c.VolumeRoot); err == nil && c.VolumeRoot != "" {
		c.VolumeRoot = abs
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate checks c; a zero field that has a default is valid.
func (c Config) Validate() error {
	if c.DataDir == "" || c.SnapshotDir == "" {
		return fmt.Errorf("node: %w: data dir and snapshot dir are required", errdefs.ErrInvalid)
	}
	if err := c.Egress.Validate(); err != nil {
		return err
	}
	switch c.BaseImage {
	case "", BaseImageAuto, BaseImageBuild, BaseImageOff:
	default:
		return fmt.Errorf("node: %w: base image %q: want auto, build or off", errdefs.ErrInvalid, c.BaseImage)
	}
	if c.Capacity < 0 {
		return fmt.Errorf("node: %w: capacity %d: want a positive number of sandboxes per worker", errdefs.ErrInvalid, c.Capacity)
	}
	return nil
}

// Host is what one machine's workers share: the substrates and the
// snapshot store. Close it after its workers have stopped.
type Host struct {
	cfg   Config
	snaps *snapshot.Local
	// reg has the process collectors, regs each worker's own registry
	// (its series labelled worker; a worker built again under the same id
	// replaces its predecessor's): the node's metrics listener serves all
	// of them (Metrics).
	reg    *prometheus.Registry
	regsMu sync.Mutex
	regs   map[string]*prometheus.Registry

	// ns holds each worker's ns substrate (NS), by worker id.
	nsMu sync.Mutex
	ns   map[string]*ns.Substrate
	// images are the ns substrates' template images (Config.BaseImage).
	images map[string]substrate.Image
	// pulls resolves the OCI images of templates built fromImage.
	pulls *imageResolver

	// vols holds the team volumes every worker of the host mounts (nil
	// where the host cannot: no loop devices or mkfs.ext4).
	vols *volume.Manager

	vmOnce  sync.Once
	vmReady chan vmResult // nil: no microvm configured
	vm      *microvm.Substrate
	vmErr   error
}

type vmResult struct {
	vm  *microvm.Substrate
	err error
}

// Open validates cfg, starts opening the microvm substrate in the
// background (its accelerator probe boots guests, seconds under TCG, while
// the caller starts the rest) and opens the snapshot store. Each worker's
// ns substrate is opened with the worker (NS).
func Open(cfg Config) (_ *Host, err error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	h := &Host{cfg: cfg, ns: map[string]*ns.Substrate{}, reg: telemetry.NewRegistry(), regs: map[string]*prometheus.Registry{}}
	h.images = baseImages(cfg)
	if cfg.VMKernelDir != "" {
		prewarm := ""
		if cfg.VMPrewarm {
			prewarm = filepath.Join(cfg.BinDir, "spaced-guest")
		}
		h.vmReady = make(chan vmResult, 1)
		go func() { // owned: waitVM (from Substrates or Close) receives its result
			vm, err := microvm.New(microvm.Config{StateDir: filepath.Join(cfg.DataDir, "microvm"),
				KernelPath: filepath.Join(cfg.VMKernelDir, "vmlinuz"), ModulesDir: filepath.Join(cfg.VMKernelDir, "modules"),
				Accel: cfg.VMAccel, NoTemplates: cfg.VMNoTemplates, PrewarmAgent: prewarm, Logger: cfg.Logger,
				Images: vmImages(h.images)})
			h.vmReady <- vmResult{vm, err}
		}()
	}
	defer func() {
		if err != nil {
			h.Close()
		}
	}()
	h.snaps, err = snapshot.NewLocal(cfg.SnapshotDir)
	if err != nil {
		return nil, fmt.Errorf("node: snapshot store: %w", err)
	}
	imgDir := cfg.ImageDir
	if imgDir == "" {
		imgDir = filepath.Join(cfg.DataDir, "images")
	}
	if h.pulls, err = newImageResolver(imgDir, cfg.InsecureRegistries); err != nil {
		return nil, err
	}
	if why := volume.Unsupported(); why != "" {
		cfg.Logger.Warn("team volumes are unavailable on this host: sandboxes that mount one are refused", "reason", why)
	} else if h.vols, err = volume.New(volume.Config{Root: cfg.VolumeRoot, SizeBytes: cfg.VolumeSizeBytes, Logger: cfg.Logger}); err != nil {
		return nil, fmt.Errorf("node: volumes: %w", err)
	}
	return h, nil
}

// NSCgroupParent is the cgroup parent of the ns sandboxes of worker
// workerID on data dir dataDir. Every worker has its own: at start a
// worker ends whatever runs under its parent that it has no record of
// (ns.Substrate.Sweep), which must never be another worker's sandboxes
// (space up runs several workers on one host, and two platforms on one
// host both have a worker w1: the data dir's hash tells them apart).
func NSCgroupParent(dataDir, workerID string) string {
	abs, err := filepath.Abs(dataDir)
	if err != nil {
		abs = dataDir
	}
	sum := sha256.Sum256([]byte(abs))
	return ns.DefaultCgroupParent + "/" + workerID + "." + hex.EncodeToString(sum[:4])
}

// NS returns the ns substrate of worker workerID, opened on first use
// (the same one for every later call: a worker run again in this process
// finds its sandboxes there). The workers of a host share its state dir
// (templates, layer disk images) and differ in their cgroup parent
// (NSCgroupParent).
func (h *Host) NS(workerID string) (*ns.Substrate, error) {
	h.nsMu.Lock()
	defer h.nsMu.Unlock()
	if sub := h.ns[workerID]; sub != nil {
		return sub, nil
	}
	sub, err := ns.New(ns.Config{StateDir: filepath.Join(h.cfg.DataDir, "ns"), CgroupParent: NSCgroupParent(h.cfg.DataDir, workerID),
		InitPath: NSInitPath(h.cfg.BinDir), Logger: h.cfg.Logger, Images: h.images,
		NoUserNamespaces: h.cfg.NSNoUserNamespaces, NoDiskQuota: h.cfg.NSNoDiskQuota})
	if err != nil {
		return nil, fmt.Errorf("node: ns substrate of worker %s: %w", workerID, err)
	}
	h.ns[workerID] = sub
	return sub, nil
}

// waitVM waits for the microvm substrate once; it logs what became of it.
func (h *Host) waitVM() {
	h.vmOnce.Do(func() {
		if h.vmReady == nil {
			return
		}
		r := <-h.vmReady
		h.vm, h.vmErr = r.vm, r.err
		log := h.cfg.Logger
		switch {
		case r.err != nil:
			h.vm = nil
			if !h.cfg.VMRequired {
				log.Warn("microvm substrate unavailable; workers run ns only", "err", r.err)
			}
		case r.vm.Unavailable() != "":
			// Workers keep it so they report the reason; they do not
			// advertise it.
			log.Warn("microvm substrate unavailable; base-vm creates get 503", "reason", r.vm.Unavailable())
		default:
			log.Info("microvm substrate ready", "accel", r.vm.Accel())
		}
	})
}

// Substrates waits for the microvm substrate and returns the substrates
// worker workerID runs, its ns substrate (NS) first. With VMRequired, a
// microvm substrate that failed to open is its error.
func (h *Host) Substrates(workerID string) ([]substrate.Substrate, error) {
	h.waitVM()
	if h.vmErr != nil && h.cfg.VMRequired {
		return nil, fmt.Errorf("node: microvm substrate: %w", h.vmErr)
	}
	nsSub, err := h.NS(workerID)
	if err != nil {
		return nil, err
	}
	subs := []substrate.Substrate{nsSub}
	if h.vm != nil {
		subs = append(subs, h.vm)
	}
	return subs, nil
}

// VM waits for the microvm substrate and returns it, or nil when there is
// none (no guest kernel configured, or it failed to open).
func (h *Host) VM() *microvm.Substrate {
	h.waitVM()
	return h.vm
}

// Snapshots is the snapshot store the workers (and the control plane)
// share.
func (h *Host) Snapshots() *snapshot.Local { return h.snaps }

// Config is the host's configuration, defaults filled.
func (h *Host) Config() Config { return h.cfg }

// Close closes the substrates. The workers over them must have stopped.
func (h *Host) Close() error {
	h.waitVM()
	h.nsMu.Lock()
	for _, sub := range h.ns {
		sub.Close()
	}
	h.ns = map[string]*ns.Substrate{}
	h.nsMu.Unlock()
	if h.vm != nil {
		h.vm.Close()
	}
	if h.vols != nil {
		h.vols.Close()
	}
	return nil
}

// Volumes is the host's team volumes (nil where the host has none): the
// control plane of a single-machine SPACE serves their content API
// through it.
func (h *Host) Volumes() *volume.Manager { return h.vols }

// volumeGC removes the files of volumes st no longer has (nil without
// volumes).
func (h *Host) volumeGC(st *store.Store) func(context.Context) error {
	if h.vols == nil {
		return nil
	}
	return func(ctx context.Context) error {
		_, err := h.vols.Collect(ctx, st.VolumeIDs)
		return err
	}
}

// volumeSource is the host's volumes as sbx-manager takes them (a nil
// interface, not a nil pointer, when there are none).
func (h *Host) volumeSource() sbxmanager.VolumeSource {
	if h.vols == nil {
		return nil
	}
	return h.vols
}

// WorkerConfig is what differs between the workers of one host.
type WorkerConfig struct {
	// ID is the worker id (DNS-label safe). Required.
	ID string
	// StateDir holds the worker's records, bundle cache and sandboxes.
	// Required.
	StateDir string
	// Addr is node-api's listen address (worker.Config.Addr's default
	// when empty).
	Addr string
}

// WorkerDeps connect a worker to the control plane's store. Registrar
// and Sandboxes default to adapters over Store; Substrates to the host's.
type WorkerDeps struct {
	Store      *store.Store
	Registrar  worker.Registrar
	Sandboxes  worker.SandboxWatcher
	Substrates []substrate.Substrate
}

// NewWorker builds a worker over the host's substrates, registered
// through the store. Run it with its Run method.
func (h *Host) NewWorker(wc WorkerConfig, d WorkerDeps) (*worker.Worker, error) {
	if d.Store == nil {
		return nil, fmt.Errorf("node: worker %s: %w: no store", wc.ID, errdefs.ErrInvalid)
	}
	subs := d.Substrates
	if subs == nil {
		var err error
		if subs, err = h.Substrates(wc.ID); err != nil {
			return nil, err
		}
	}
	if d.Registrar == nil {
		d.Registrar = Registrar(d.Store)
	}
	if d.Sandboxes == nil {
		d.Sandboxes = SandboxWatch(d.Store)
	}
	cfg := h.cfg
	var egressOpen func(prometheus.Registerer, func(sbxmanager.EgressDenial)) (worker.EgressService, error)
	if cfg.Egress.Mode != EgressOff {
		ec, stateDir, log := cfg.Egress, wc.StateDir, cfg.Logger.With("worker", wc.ID)
		egressOpen = func(reg prometheus.Registerer, aud func(sbxmanager.EgressDenial)) (worker.EgressService, error) {
			return newWorkerEgress(ec, stateDir, reg, aud, log)
		}
	}
	w, err := worker.New(worker.Config{
		ID: wc.ID, Addr: wc.Addr, StateDir: wc.StateDir, Capacity: cfg.Capacity, Logger: cfg.Logger, LeaseTTL: cfg.LeaseTTL,
		KeepSandboxesOnExit: cfg.KeepSandboxesOnExit,
		Manager: sbxmanager.Config{
			SpacedHostPath: filepath.Join(cfg.BinDir, "spaced-host"), AgentPath: filepath.Join(cfg.BinDir, "spaced-guest"),
			EnvdVersion: guest.EnvdVersion, DefaultLimits: cfg.DefaultLimits, UnsafeSkipIdentityChecks: cfg.UnsafeSkipIdentityChecks,
			ChildLog: cfg.Log, Volumes: h.volumeSource(), ChildEnv: telemetry.Env(cfg.Tracing),
		},
	}, worker.Deps{
		Substrates: subs,
		Registerer: h.workerRegistry(wc.ID),
		Registrar:  d.Registrar, Bundles: d.Store, Sandboxes: d.Sandboxes, Snapshots: h.snaps, Lost: d.Store,
		Egress: egressOpen, Images: h.pulls, VolumeGC: h.volumeGC(d.Store),
	})
	if err != nil {
		return nil, fmt.Errorf("node: worker %s: %w", wc.ID, err)
	}
	return w, nil
}

// Metrics gathers the series of the host's workers (labelled worker) and
// the Go and process collectors: what the node's metrics listener serves.
func (h *Host) Metrics() prometheus.Gatherer { return hostGatherer{h} }

func (h *Host) workerRegistry(id string) *prometheus.Registry {
	r := prometheus.NewRegistry()
	h.regsMu.Lock()
	h.regs[id] = r
	h.regsMu.Unlock()
	return r
}

type hostGatherer struct{ h *Host }

func (g hostGatherer) Gather() ([]*dto.MetricFamily, error) {
	g.h.regsMu.Lock()
	gs := prometheus.Gatherers{g.h.reg}
	for _, r := range g.h.regs {
		gs = append(gs, r)
	}
	g.h.regsMu.Unlock()
	return gs.Gather()
}

// NSInitPath is the ns sandboxes' init binary in binDir (make build puts
// space-nsinit there), or "" when there is none: the hosting binary then
// re-executes itself as the init, about 15 ms slower per sandbox start.
func NSInitPath(binDir string) string {
	p := filepath.Join(binDir, "space-nsinit")
	if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
		if abs, err := filepath.Abs(p); err == nil {
			return abs
		}
	}
	return ""
}
