// Package sbxmanager is the sandbox manager of a worker: it persists the
// runtime records of the executions the worker serves, admits each request
// by verifying its capability and comparing the selected identity with the
// installed record (Allow, RefreshRoute or Deny), launches one spaced-host
// bridge per activation and forwards admitted requests to it over a Unix
// socket whose peer it verifies.
package sbxmanager

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httputil"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/bridge"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/procid"
	"github.com/spacesbx/space/internal/snapshot"
	"github.com/spacesbx/space/internal/substrate"
)

// Config configures a Manager.
type Config struct {
	// WorkerID is this worker's id; installs for other workers are refused.
	WorkerID string
	// StateDir holds records.db, audit.log and one directory per sandbox.
	StateDir string
	// SpacedHostPath is the spaced-host binary. Required.
	SpacedHostPath string
	// ChildLog is how spaced-host and netgtw log (into their files in the
	// activation directory): the worker's own choice, so every component
	// writes one format. Default text, info.
	ChildLog logsetup.Options
	// ChildEnv is more environment for spaced-host (the worker's tracing
	// configuration, telemetry.Env), so its spans reach the same collector.
	ChildEnv []string
	// NetgtwPath is the netgtw binary (service ports). Default: netgtw
	// next to SpacedHostPath; without it sandboxes have no service ports.
	NetgtwPath string
	// AgentPath is the static spaced-guest binary placed in sandboxes.
	AgentPath string
	// EnvdVersion is reported to the control plane for new sandboxes.
	EnvdVersion string
	// DefaultLimits apply where an install leaves a limit at zero.
	DefaultLimits spacev1.Limits
	// StartTimeout bounds activating a sandbox and its bridge. Default 30s.
	StartTimeout time.Duration
	// PauseStreamGrace bounds how long Pause waits, after refusing new
	// requests, for commands already started (process.Process/Start
	// streams) to finish before freezing. A command that finishes in time
	// is not frozen mid-way, so a move that follows the pause does not cut
	// it (the ns substrate restarts processes on a move). Longer-running
	// commands are frozen as they are. Substrates whose state snapshots
	// keep processes (Capabilities.SavesState: microvm) do not wait. Default 2s; negative: no wait.
	PauseStreamGrace time.Duration
	// SnapshotLimits bound a writable-layer snapshot, enforced while it is
	// archived and again while it is restored, so that whatever a sandbox
	// writes (or claims in a forged archive) cannot fill the host's disk
	// on either side of a move. Defaults: MaxBytes (file content stored,
	// holes of sparse files excluded) 10 GiB, MaxLogical (file sizes,
	// holes included) 1 TiB, MaxEntries 4 Mi. Independently, neither side
	// writes into a file system's last max(1 GiB, 5%).
	SnapshotLimits snapshot.Limits
	// UnsafeSkipIdentityChecks disables capability verification and the
	// identity comparison, routing by the E2b-Sandbox-Id header instead.
	// It exists only as the baseline of the on/off benchmark; nothing that
	// serves users sets it.
	UnsafeSkipIdentityChecks bool
	// Volumes resolves the team volumes an install mounts to host
	// directories (nil: installs with volumes are refused).
	Volumes VolumeSource
	// Registerer receives the manager's metrics (nil: not registered).
	Registerer prometheus.Registerer

	// Metrics over time (sampler.go). SampleInterval is how often every
	// execution's usage is sampled (default DefaultSampleInterval, 5 s;
	// negative: never, MetricsRange then samples on demand);
	// SampleRetention how long an execution's samples are kept (default
	// DefaultSampleRetention, 1 h).
	SampleInterval  time.Duration
	SampleRetention time.Duration
	// Logger receives the manager's logs (default slog.Default()).
	Logger *slog.Logger
}

// withDefaults returns c with its unset fields set to the documented
// defaults (a negative StartTimeout or SnapshotLimits.MaxBytes counts as
// unset).
func (c Config) withDefaults() Config {
	if c.NetgtwPath == "" && c.SpacedHostPath != "" {
		c.NetgtwPath = filepath.Join(filepath.Dir(c.SpacedHostPath), "netgtw")
	}
	if c.StartTimeout <= 0 {
		c.StartTimeout = 30 * time.Second
	}
	if c.PauseStreamGrace == 0 {
		c.PauseStreamGrace = 2 * time.Second
	}
	if c.SnapshotLimits.MaxBytes <= 0 {
		c.SnapshotLimits.MaxBytes = 10 << 30
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.SampleInterval == 0 {
		c.SampleInterval = DefaultSampleInterval
	}
	if c.SampleRetention <= 0 {
		c.SampleRetention = DefaultSampleRetention
	}
	return c
}

// Validate checks c; fields left zero take their defaults in New.
func (c Config) Validate() error {
	if c.WorkerID == "" || c.StateDir == "" {
		return fmt.Errorf("sbxmanager: %w: worker id and state dir are required", errdefs.ErrInvalid)
	}
	if c.SpacedHostPath == "" || c.AgentPath == "" {
		return fmt.Errorf("sbxmanager: %w: spaced-host and agent paths are required", errdefs.ErrInvalid)
	}
	return nil
}

// Deps are the manager's collaborators.
type Deps struct {
	// Substrates run sandboxes (e.g. ns and microvm on one worker).
	// Routes pick one by name; at least one is required.
	Substrates []substrate.Substrate
	Verifier   *capability.Verifier
	// Snapshots stores writable-layer snapshots (nil: Snapshot and
	// installs with RestoreSnapshot fail as unavailable).
	Snapshots SnapshotStore
	// WriteError answers a request the manager refuses with a classed
	// error (errdefs) before forwarding it. Required: node-api's
	// (nodeapi.WriteError), the one place on a worker that turns error
	// classes into HTTP statuses.
	WriteError ErrorWriter
	// OnLost, when set, is called (from the manager's own goroutine) with
	// the route of an execution whose init exited while it was being
	// served: its processes are gone, its record and files stay, and the
	// control plane recovers it as a new execution.
	OnLost func(identity.Route)
	// Egress gives executions installed with a network their link and
	// policy; nil: loopback only for every execution.
	Egress Egress
	// Images resolves an execution's OCI image into layers on this
	// worker; nil: installs naming an image are refused as invalid.
	Images ImageResolver
}

// ImageResolver makes an OCI image's layers available on the worker
// (pulled once per layer) and describes them for the substrate.
type ImageResolver interface {
	Resolve(ctx context.Context, src spacev1.ImageSource) (*substrate.Image, error)
}

// ErrorWriter writes err as the answer to a request.
type ErrorWriter func(w http.ResponseWriter, err error)

// Manager serves the executions installed on one worker.
type Manager struct {
	// watchers are the goroutines that wait for an activation's init to
	// exit on its own (watchExit); Close waits for them.
	watchers sync.WaitGroup
	onLost   func(identity.Route)
	egress   Egress
	images   ImageResolver
	// startReport is what adoptAll found at start.
	startReport StartReport
	// unreclaimed holds the sandboxes whose leftovers adoptAll could
	// not end at start: something may still write their files, so they
	// are neither reported lost nor snapshotted. Written only in New.
	unreclaimed map[string]bool
	cfg         Config
	subs        map[string]substrate.Substrate
	ver         *capability.Verifier
	snaps       SnapshotStore
	store       *recordStore
	audit       *auditLog
	metrics     *metrics
	log         *slog.Logger
	// writeError is Deps.WriteError.
	writeError ErrorWriter
	// lock is the state directory's flock (lockStateDir).
	lock *os.File

	// fence is the serving epoch (fence.go).
	fence *fence

	mu      sync.RWMutex
	records map[string]record
	active  map[string]*activation
	// installing serializes lifecycle operations per sandbox.
	installing map[string]*sync.Mutex
	closed     bool

	// samples are the executions' usage samples (sampler.go), by
	// sandbox id; sampleStop ends the sampler.
	sampleMu   sync.Mutex
	samples    map[string]*sampleRing
	sampleStop chan struct{}

	// testHookAdmitted, when set (tests only), runs after a guest request
	// has been admitted and before it is forwarded.
	testHookAdmitted func()
}

// activation is one running activation with its bridge.
type activation struct {
	route identity.Route
	inst  substrate.Instance
	// host is the spaced-host (a pidfd), hostProc its recorded identity.
	host     *procid.Handle
	hostProc procid.Process
	hostSock string
	proxy    *httputil.ReverseProxy
	tr       *http.Transport
	// ctx ends every stream of this activation (its lease) when the
	// execution is replaced, retired or torn down.
	ctx    context.Context
	cancel context.CancelFunc
	// hostDone is closed when the bridge process has exited (reaped, for
	// one this manager launched).
	hostDone <-chan struct{}
	// paused is set while the sandbox is frozen (lifecycle.go).
	paused atomic.Bool
	// awaitingView is set on an activation adopted at start until the
	// worker has the control plane's view (ConfirmAdopted): a sandbox
	// killed or moved while the worker was down is retired then, before
	// any request reaches it.
	awaitingView atomic.Bool
	// gwState is the activation's service-port gateway, started on the
	// first service-port request (nil: none, the substrate gives no
	// network namespace).
	gwState *gatewayState
	// link is the execution's egress link (nil: none); released when the
	// activation stops, kept when the worker detaches.
	link *Link
	// gate is held shared by every unary request in flight; Pause takes it
	// exclusively (bounded) after refusing new requests, so a freeze does
	// not strand a request inside the guest.
	gate sync.RWMutex
	// starts counts process.Process/Start streams in flight; Pause gives
	// them PauseStreamGrace to finish.
	starts atomic.Int64
	// use counts the activation's data-plane traffic (observe.go).
	use usage
}

// New opens the runtime records and loads them before returning: a
// manager serves nothing until it knows what it may serve.
func New(cfg Config, deps Deps) (*Manager, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	subs := map[string]substrate.Substrate{}
	for _, s := range deps.Substrates {
		if s != nil {
			subs[s.Name()] = s
		}
	}
	if len(subs) == 0 || (deps.Verifier == nil && !cfg.UnsafeSkipIdentityChecks) || deps.WriteError == nil {
		return nil, fmt.Errorf("sbxmanager: %w: substrate, verifier and error writer are required", errdefs.ErrInvalid)
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("sbxmanager: %w", err)
	}
	// One manager per state directory: two would take each other's
	// bridges and end each other's sandboxes as unrecorded.
	lock, err := lockStateDir(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	st, err := openRecords(filepath.Join(cfg.StateDir, "records.db"))
	if err != nil {
		lock.Close()
		return nil, fmt.Errorf("sbxmanager: %w", err)
	}
	recs, err := st.loadAll()
	if err != nil {
		st.close()
		lock.Close()
		return nil, fmt.Errorf("sbxmanager: load runtime records: %w", err)
	}
	audit, err := openAudit(filepath.Join(cfg.StateDir, "audit.log"), cfg.WorkerID)
	if err != nil {
		st.close()
		lock.Close()
		return nil, fmt.Errorf("sbxmanager: %w", err)
	}
	m := &Manager{
		cfg: cfg, subs: subs, ver: deps.Verifier, snaps: deps.Snapshots, store: st, audit: audit,
		metrics: newMetrics(cfg.Registerer), log: cfg.Logger.With("worker", cfg.WorkerID),
		records: recs, active: map[string]*activation{}, installing: map[string]*sync.Mutex{}, fence: newFence(),
		writeError: deps.WriteError, onLost: deps.OnLost, lock: lock, egress: deps.Egress, images: deps.Images,
	}
	if cfg.Registerer != nil {
		cfg.Registerer.MustRegister(sandboxCollector{m})
	}
	// The running bridges accept this process once the manager file
	// names it; without that every adoption would fail and end live
	// sandboxes, so the start fails instead and they run on unserved.
	if err := bridge.WriteManagerFile(m.managerFile()); err != nil {
		m.closeFiles()
		return nil, fmt.Errorf("sbxmanager: %w", err)
	}
	m.adoptAll()
	m.removeUnrecorded()
	m.samples, m.sampleStop = map[string]*sampleRing{}, make(chan struct{})
	if cfg.SampleInterval > 0 {
		m.watchers.Add(1)
		go m.runSampler(m.sampleStop)
	}
	return m, nil
}

func (m *Manager) lockSandbox(id string) func() {
	m.mu.Lock()
	l, ok := m.installing[id]
	if !ok {
		l = &sync.Mutex{}
		m.installing[id] = l
	}
	m.mu.Unlock()
	l.Lock()
	return l.Unlock
}

// caps are the capabilities of the substrate r names (Install checked
// that this worker runs it).
func (m *Manager) caps(r identity.Route) substrate.Capabilities {
	if sub := m.subs[r.Substrate]; sub != nil {
		return sub.Capabilities()
	}
	return substrate.Capabilities{}
}

// Substrates names the substrates this manager runs, sorted.
func (m *Manager) Substrates() []string {
	out := make([]string, 0, len(m.subs))
	for name, sub := range m.subs {
		if a, ok := sub.(substrate.Availability); ok && a.Unavailable() != "" {
			continue
		}
		out = append(out, name)
	}
	sort.Strings(out)
	return out
}

// SubstrateStatus reports, for the substrates that cannot start
// instances here, why (substrate name -> reason), and the accelerators of
// the others that have one (substrate name -> accelerator).
func (m *Manager) SubstrateStatus() (unavailable, accel map[string]string) {
	for name, sub := range m.subs {
		a, ok := sub.(substrate.Availability)
		if !ok {
			continue
		}
		if why := a.Unavailable(); why != "" {
			if unavailable == nil {
				unavailable = map[string]string{}
			}
			unavailable[name] = why
		} else if acc := a.Accel(); acc != "" {
			if accel == nil {
				accel = map[string]string{}
			}
			accel[name] = acc
		}
	}
	return unavailable, accel
}

// Records returns a copy of the installed runtime records.
func (m *Manager) Records() []identity.Record {
	m.mu.RLock()
	defer m.mu.RUnlock()
	out := make([]identity.Record, 0, len(m.records))
	for _, r := range m.records {
		out = append(out, r.Record)
	}
	return out
}

// Lost returns the routes of installed, not retired executions that have
// no running activation and can be recovered from their files: after a
// restart of the worker, executions whose processes died with it (their
// records and files are on disk). An instance whose files lived in its
// memory (a microVM without a layer disk: see recoverable) left nothing
// to recover from; it is logged and audited, not returned.
func (m *Manager) Lost() []identity.Route {
	m.mu.RLock()
	defer m.mu.RUnlock()
	var out []identity.Route
	for id, r := range m.records {
		if r.Retired || m.active[id] != nil || m.unreclaimed[id] {
			continue
		}
		if !m.recoverable(r.Route, r.Dir) {
			m.unrecoverable(r.Route)
			continue
		}
		out = append(out, r.Route)
	}
	return out
}

// Active reports how many activations are running.
func (m *Manager) Active() int {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return len(m.active)
}

// BridgePID returns the pid of the sandbox's spaced-host and agent (for
// measurements and tests).
func (m *Manager) BridgePID(sandbox string) (host, guest int, ok bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	a := m.active[sandbox]
	if a == nil {
		return 0, 0, false
	}
	return a.hostProc.PID, a.inst.InitPID(), true
}

// CloseIdleBridgeConns drops the pooled idle connections to a sandbox's
// spaced-host, so that its next requests open (and verify) new ones.
func (m *Manager) CloseIdleBridgeConns(sandbox string) {
	m.mu.RLock()
	a := m.active[sandbox]
	m.mu.RUnlock()
	if a != nil {
		a.tr.CloseIdleConnections()
	}
}

// Close stops every activation (records are kept) and closes the store.
func (m *Manager) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	close(m.sampleStop)
	acts := maps.Clone(m.active)
	clear(m.active)
	m.mu.Unlock()
	var wg sync.WaitGroup
	for _, a := range acts {
		wg.Add(1)
		go func() { defer wg.Done(); m.stopActivation(a, "shutdown") }()
	}
	wg.Wait()
	m.watchers.Wait()
	return m.closeFiles()
}

// closeFiles closes the records, the audit log and the state dir's lock.
func (m *Manager) closeFiles() error {
	return errors.Join(m.store.close(), m.audit.close(), m.lock.Close())
}

// lockStateDir takes the state directory's lock (an flock on dir/lock,
// held for the manager's life), or says that another manager holds it.
func lockStateDir(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_CREATE|os.O_RDWR|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("sbxmanager: state dir lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("sbxmanager: %w: another worker process runs on %s", errdefs.ErrConflict, dir)
		}
		return nil, fmt.Errorf("sbxmanager: state dir lock: %w", err)
	}
	return f, nil
}
