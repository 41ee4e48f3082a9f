// Package sbxmanager is the sandbox manager of a worker: it persists the
// runtime records of the executions the worker serves, admits each request
// by verifying its capability and comparing the selected identity with the
// installed record (Allow, RefreshRoute or Deny), launches one spaced-host
// bridge per activation and forwards admitted requests to it over a Unix
// socket whose peer it verifies.
package sbxmanager

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/procid"
	"github.com/spacesbx/space/internal/procwait"
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
	// keep processes (microvm) do not wait. Default 2s; negative: no wait.
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
	// Registerer receives the manager's metrics (nil: not registered).
	Registerer prometheus.Registerer
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
}

// ErrorWriter writes err as the answer to a request.
type ErrorWriter func(w http.ResponseWriter, err error)

// Manager serves the executions installed on one worker.
type Manager struct {
	cfg     Config
	subs    map[string]substrate.Substrate
	ver     *capability.Verifier
	snaps   SnapshotStore
	store   *recordStore
	audit   *auditLog
	metrics *metrics
	log     *slog.Logger
	// writeError is Deps.WriteError.
	writeError ErrorWriter

	mu      sync.RWMutex
	records map[string]record
	active  map[string]*activation
	// installing serializes lifecycle operations per sandbox.
	installing map[string]*sync.Mutex
	closed     bool

	// testHookAdmitted, when set (tests only), runs after a guest request
	// has been admitted and before it is forwarded.
	testHookAdmitted func()
}

// activation is one running activation with its bridge.
type activation struct {
	route    identity.Route
	inst     substrate.Instance
	host     *exec.Cmd
	hostProc procid.Process
	hostSock string
	proxy    *httputil.ReverseProxy
	tr       *http.Transport
	// ctx ends every stream of this activation (its lease) when the
	// execution is replaced, retired or torn down.
	ctx    context.Context
	cancel context.CancelFunc
	// hostDone is closed when the bridge process has been reaped.
	hostDone chan struct{}
	// paused is set while the sandbox is frozen (lifecycle.go).
	paused atomic.Bool
	// gwState is the activation's service-port gateway, started on the
	// first service-port request (nil: none, e.g. a microVM).
	gwState *gatewayState
	// gate is held shared by every unary request in flight; Pause takes it
	// exclusively (bounded) after refusing new requests, so a freeze does
	// not strand a request inside the guest.
	gate sync.RWMutex
	// starts counts process.Process/Start streams in flight; Pause gives
	// them PauseStreamGrace to finish.
	starts atomic.Int64
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
	st, err := openRecords(filepath.Join(cfg.StateDir, "records.db"))
	if err != nil {
		return nil, fmt.Errorf("sbxmanager: %w", err)
	}
	recs, err := st.loadAll()
	if err != nil {
		st.close()
		return nil, fmt.Errorf("sbxmanager: load runtime records: %w", err)
	}
	audit, err := openAudit(filepath.Join(cfg.StateDir, "audit.log"), cfg.WorkerID)
	if err != nil {
		st.close()
		return nil, fmt.Errorf("sbxmanager: %w", err)
	}
	m := &Manager{
		cfg: cfg, subs: subs, ver: deps.Verifier, snaps: deps.Snapshots, store: st, audit: audit,
		metrics: newMetrics(cfg.Registerer), log: cfg.Logger.With("worker", cfg.WorkerID),
		records: recs, active: map[string]*activation{}, installing: map[string]*sync.Mutex{},
		writeError: deps.WriteError,
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

// Install persists and activates an execution. It returns once the record
// is durable and the bridge has verified the guest. Installing execution
// N+1 of a sandbox makes the manager reject execution N at once and ends
// N's streams.
func (m *Manager) Install(ctx context.Context, req spacev1.InstallRequest) (spacev1.InstallResponse, error) {
	tStart := time.Now()
	r := req.Route
	if err := r.Validate(); err != nil {
		return spacev1.InstallResponse{}, fmt.Errorf("install: %w: %v", errdefs.ErrInvalid, err)
	}
	if r.WorkerID != m.cfg.WorkerID {
		return spacev1.InstallResponse{}, fmt.Errorf("install: %w: route names worker %q, this is %q", errdefs.ErrInvalid, r.WorkerID, m.cfg.WorkerID)
	}
	if m.subs[r.Substrate] == nil {
		return spacev1.InstallResponse{}, fmt.Errorf("install: %w: substrate %q not served on worker %s", errdefs.ErrInvalid, r.Substrate, m.cfg.WorkerID)
	}
	unlock := m.lockSandbox(r.SandboxID)
	defer unlock()
	log := m.log.With("sandbox", r.SandboxID, "generation", r.Generation)

	m.mu.RLock()
	old, hasOld := m.records[r.SandboxID]
	act := m.active[r.SandboxID]
	closed := m.closed
	m.mu.RUnlock()
	if closed {
		return spacev1.InstallResponse{}, fmt.Errorf("install: %w: manager closed", errdefs.ErrUnavailable)
	}
	if hasOld && old.Route == r && !old.Retired && act != nil {
		return spacev1.InstallResponse{Route: r, EnvdVersion: m.cfg.EnvdVersion}, nil // idempotent retry
	}
	if hasOld && old.Route.Generation > r.Generation {
		return spacev1.InstallResponse{}, fmt.Errorf("install: %w: generation %d is older than installed %d", errdefs.ErrConflict, r.Generation, old.Route.Generation)
	}
	// Refuse to revive a retired execution; restore the snapshot (if any)
	// before the running execution is touched (lifecycle.go).
	if err := m.prepareInstall(ctx, req, old, hasOld); err != nil {
		return spacev1.InstallResponse{}, err
	}
	// A replacement: the old execution stops being served before anything
	// else. Until the new one is installed its capabilities get
	// RefreshRoute (the edge repairs them once the control plane publishes
	// the new route), not "installed but not active".
	if act != nil {
		m.mu.Lock()
		delete(m.active, r.SandboxID)
		if cur, ok := m.records[r.SandboxID]; ok && cur.Route == old.Route {
			cur.Retired = true // in memory only: the new record is persisted below
			m.records[r.SandboxID] = cur
		}
		m.mu.Unlock()
		m.stopActivation(act, "replaced")
	}

	limits := m.withDefaultLimits(req.Limits)
	dir := activationDir(m.cfg.StateDir, r)
	rec := record{Record: identity.Record{Route: r}, Template: req.Template, EnvVars: req.EnvVars, Limits: limits, Dir: dir, Installed: time.Now().UTC()}
	if req.RestoreSnapshot != "" && m.caps(r).SavesState {
		rec.restoreState = filepath.Join(dir, stateFile) // prepareInstall fetched it
		defer os.Remove(rec.restoreState)                // loaded by now, or useless
	}

	sctx, cancel := context.WithTimeout(ctx, m.cfg.StartTimeout)
	defer cancel()
	var tm installTiming
	newAct, err := m.activate(sctx, rec, &tm)
	if err != nil {
		log.Error("activation failed", "err", err)
		return spacev1.InstallResponse{}, fmt.Errorf("install %s: %w", r.SandboxID, err)
	}
	t0 := time.Now()
	if err := m.store.put(rec); err != nil {
		m.stopActivation(newAct, "persist failed")
		return spacev1.InstallResponse{}, fmt.Errorf("install %s: persist record: %w", r.SandboxID, err)
	}
	tm.persist = time.Since(t0)
	log.Debug(InstallTimingMsg, "substrate", tm.substrate, "bridge", tm.bridge, "gateway", tm.gateway, "persist", tm.persist,
		"total", time.Since(tStart))
	m.mu.Lock()
	m.records[r.SandboxID] = rec
	m.active[r.SandboxID] = newAct
	m.mu.Unlock()
	if hasOld && old.Dir != rec.Dir {
		os.RemoveAll(old.Dir) // the superseded execution's writable layer
	}
	m.metrics.activations.Inc()
	log.Info("execution installed", "execution", r.ExecutionID, "activation", r.ActivationID)
	return spacev1.InstallResponse{Route: r, EnvdVersion: m.cfg.EnvdVersion}, nil
}

// activationDir is short on purpose: the bridge and guest sockets live in
// it and a Unix socket path must fit in 108 bytes.
func activationDir(stateDir string, r identity.Route) string {
	sum := sha256.Sum256([]byte(fmt.Sprintf("%s/%d/%s/%s", r.SandboxID, r.Generation, r.ExecutionID, r.ActivationID)))
	return filepath.Join(stateDir, "act", hex.EncodeToString(sum[:8]))
}

// Files in the activation directory of a substrate with
// Capabilities.Activation and SavesState: the guest configuration that
// spaced-host sends as the activation message, and an instance state
// being restored (removed once loaded).
const (
	activationFile = "activation.json"
	stateFile      = "restore.state"
)

// guestConfig is what spaced-guest reads from SPACE_GUEST_CONFIG.
type guestConfig struct {
	Identity    identity.Route    `json:"identity"`
	Env         map[string]string `json:"env,omitempty"`
	DefaultUser string            `json:"default_user"`
}

// InstallTimingMsg is the message of the debug record an install logs
// with its phases (substrate start, bridge start and verification, gateway
// start, record persisted) as durations; make bench aggregates them.
const InstallTimingMsg = "install timing"

// installTiming is how long each phase of an install took.
type installTiming struct {
	substrate, bridge, gateway, persist time.Duration
}

// caps are the capabilities of the substrate r names (Install checked
// that this worker runs it).
func (m *Manager) caps(r identity.Route) substrate.Capabilities {
	if sub := m.subs[r.Substrate]; sub != nil {
		return sub.Capabilities()
	}
	return substrate.Capabilities{}
}

// withDefaultLimits fills l's zero fields from the worker's defaults.
func (m *Manager) withDefaultLimits(l spacev1.Limits) spacev1.Limits {
	d := m.cfg.DefaultLimits
	if l.MemoryBytes == 0 {
		l.MemoryBytes = d.MemoryBytes
	}
	if l.Pids == 0 {
		l.Pids = d.Pids
	}
	if l.CPUMillis == 0 {
		l.CPUMillis = d.CPUMillis
	}
	if l.DiskBytes == 0 {
		l.DiskBytes = d.DiskBytes
	}
	return l
}

func substrateLimits(l spacev1.Limits) substrate.Limits {
	return substrate.Limits{MemoryBytes: l.MemoryBytes, Pids: l.Pids, CPUMillis: l.CPUMillis, DiskBytes: l.DiskBytes}
}

func (m *Manager) activate(ctx context.Context, rec record, tm *installTiming) (*activation, error) {
	r := rec.Route
	gcfg, _ := json.Marshal(guestConfig{Identity: r, Env: rec.EnvVars, DefaultUser: "user"})
	spec := substrate.Spec{
		Route: r, Template: rec.Template, Dir: rec.Dir, AgentPath: m.cfg.AgentPath,
		Limits:       substrateLimits(rec.Limits),
		RestoreState: rec.restoreState,
	}
	// An agent reads its configuration at start, or learns it (again,
	// after a restore) from spaced-host's activation message.
	caps := m.caps(r)
	if !caps.Activation {
		spec.AgentEnv = []string{"SPACE_GUEST_CONFIG=" + string(gcfg)}
	} else if err := os.MkdirAll(rec.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("start sandbox: %w", err)
	} else if err := os.WriteFile(filepath.Join(rec.Dir, activationFile), gcfg, 0o600); err != nil {
		return nil, fmt.Errorf("start sandbox: activation: %w", err)
	}
	// spaced-host is launched (and recorded) while the sandbox starts: its
	// exec and runtime start overlap the sandbox's; it waits for its
	// arguments.
	type launched struct {
		bp  *bridgeProc
		err error
	}
	bpc := make(chan launched, 1)
	go func() {
		bp, err := m.launchBridge(rec.Dir)
		bpc <- launched{bp, err}
	}()
	t0 := time.Now()
	inst, err := m.subs[r.Substrate].Start(ctx, spec)
	tm.substrate = time.Since(t0)
	l := <-bpc
	if err != nil {
		if l.bp != nil {
			l.bp.kill()
		}
		return nil, fmt.Errorf("start sandbox: %w", err)
	}
	if l.err != nil {
		stopCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		inst.Stop(stopCtx)
		cancel()
		return nil, l.err
	}
	bp := l.bp
	t0 = time.Now()
	act, err := m.startBridge(ctx, bp, inst, rec.Dir, caps)
	tm.bridge = time.Since(t0)
	if err != nil {
		stopCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		inst.Stop(stopCtx)
		cancel()
		return nil, err
	}
	if !caps.Netns {
		// No network namespace on the host to reach its ports from:
		// service ports are not served for it (never the host's).
		return act, nil
	}
	t0 = time.Now()
	// netgtw itself starts on the first service-port request (gateway.go).
	if act.gwState, err = recordGateway(inst, rec.Dir); err != nil {
		m.stopActivation(act, "gateway failed")
		return nil, err
	}
	tm.gateway = time.Since(t0)
	return act, nil
}

// bridgeProc is a spaced-host launched ahead of its sandbox: recorded
// at launch, it waits for its arguments on stdin (--args-from-stdin).
type bridgeProc struct {
	cmd      *exec.Cmd
	hh       *procid.Handle
	stdin    io.WriteCloser
	ready    chan error
	hostDone chan struct{}
}

// launchBridge starts spaced-host for the activation in dir and records
// it; startBridge hands it its sandbox.
func (m *Manager) launchBridge(dir string) (*bridgeProc, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("bridge: %w", err)
	}
	logPath := filepath.Join(dir, "spaced-host.log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("bridge log: %w", err)
	}
	defer logf.Close()
	cmd := exec.Command(m.cfg.SpacedHostPath, "--args-from-stdin")
	cmd.Stderr = logf
	cmd.Env = []string{"GOMAXPROCS=1", "GOGC=50"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("bridge: %w", err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		stdin.Close()
		return nil, fmt.Errorf("bridge: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start spaced-host: %w", err)
	}
	// Record the bridge before anything can reap it, so its pid cannot have
	// been reused: pid, start time, executable (device+inode, SHA-256) and
	// a pidfd that keeps naming this very process.
	hh, err := procid.Open(cmd.Process.Pid)
	if err != nil {
		cmd.Process.Kill()
		stdin.Close()
		procwait.Wait(cmd)
		return nil, fmt.Errorf("spaced-host identity: %w", err)
	}
	bp := &bridgeProc{cmd: cmd, hh: hh, stdin: stdin, ready: make(chan error, 1), hostDone: make(chan struct{})}
	go func() { procwait.Wait(cmd); hh.Close(); close(bp.hostDone) }()
	go func() {
		line, err := bufio.NewReader(stdout).ReadString('\n')
		// spaced-host writes nothing after its ready line: one
		// descriptor less per sandbox held here (RLIMIT_NOFILE).
		stdout.Close()
		if err != nil || line != "spaced-host ready\n" {
			bp.ready <- fmt.Errorf("spaced-host did not become ready (see %s): %v", logPath, err)
			return
		}
		bp.ready <- nil
	}()
	return bp, nil
}

// kill stops a launched spaced-host and waits until it is reaped.
func (bp *bridgeProc) kill() {
	bp.cmd.Process.Kill()
	bp.stdin.Close()
	<-bp.hostDone
}

// startBridge hands inst to the spaced-host bp and waits until it has
// verified the guest and listens.
func (m *Manager) startBridge(ctx context.Context, bp *bridgeProc, inst substrate.Instance, dir string, caps substrate.Capabilities) (*activation, error) {
	r := inst.Route()
	sock := filepath.Join(dir, "host.sock")
	want, _ := json.Marshal(r)
	args := []string{"--guest-socket", inst.GuestSocket(), "--guest-pid", strconv.Itoa(inst.InitPID()),
		"--listen", sock, "--expected", string(want), "--manager-pid", strconv.Itoa(os.Getpid())}
	if !caps.Activation {
		// The agent's executable was hashed here before (once per binary):
		// spaced-host records the agent without reading it again, unless
		// the agent's executable is not exactly that file, unchanged.
		if stmt, err := procid.ExeHash(m.cfg.AgentPath); err == nil {
			args = append(args, "--guest-exe-hash", stmt)
		}
	} else {
		// One verified connection to QEMU's chardev socket, multiplexed;
		// the guest is (re)activated with the activation file first.
		args = append(args, "--channel", "vmchan", "--activation-file", filepath.Join(dir, activationFile),
			"--boot-timeout", m.cfg.StartTimeout.String())
	}
	fail := func(err error) (*activation, error) {
		bp.kill()
		return nil, err
	}
	line, _ := json.Marshal(args)
	_, err := bp.stdin.Write(append(line, '\n'))
	bp.stdin.Close()
	if err != nil {
		return fail(fmt.Errorf("spaced-host arguments: %w", err))
	}
	select {
	case err := <-bp.ready:
		if err != nil {
			return fail(err)
		}
	case <-ctx.Done():
		return fail(fmt.Errorf("spaced-host: %w", ctx.Err()))
	}
	cmd, hh, hostDone := bp.cmd, bp.hh, bp.hostDone
	if err := hh.Check(); err != nil {
		return fail(fmt.Errorf("spaced-host identity: %w", err))
	}
	hp := hh.Process()
	actx, cancel := context.WithCancel(context.Background())
	a := &activation{route: r, inst: inst, host: cmd, hostProc: hp, hostSock: sock, ctx: actx, cancel: cancel, hostDone: hostDone}
	// Per connection, never per request: the bridge must be the process
	// this manager launched, still alive and unchanged.
	tr, rt := newBridgeTransport(sock, func(c net.Conn) error {
		if err := hh.VerifyPeer(c); err != nil {
			m.metrics.bridgeRejects.Inc()
			m.log.Warn("bridge endpoint verification failed", "sandbox", r.SandboxID, "err", err)
			return err
		}
		return nil
	})
	a.tr = tr
	a.proxy = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme, pr.Out.URL.Host = "http", "spaced-host"
			pr.Out.Header.Del(spacev1.HeaderCapability)
		},
		Transport:     rt,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			m.writeError(w, fmt.Errorf("%w: sandbox bridge: %v", errdefs.ErrUnavailable, err))
		},
	}
	return a, nil
}

// ErrBridgeConnLost means a request's connection to spaced-host failed and
// the request was not retried on another connection. Its class is
// errdefs.ErrUnavailable; its text (quoted in the 503 a request gets) is
// its own.
var ErrBridgeConnLost error = &classedError{class: errdefs.ErrUnavailable, msg: "bridge connection lost; not retried"}

// classedError is an error of an errdefs class whose text does not repeat
// the class's name.
type classedError struct {
	class error
	msg   string
}

func (e *classedError) Error() string { return e.msg }
func (e *classedError) Unwrap() error { return e.class }

// newBridgeTransport returns the HTTP transport to one spaced-host: every
// new connection is verified by verify before use, and the RoundTripper to
// use refuses the transport's transparent retries: net/http re-sends an
// idempotent (or unsent, bodiless) request on another connection when a
// reused one turns out closed; a bridge connection that drops fails the
// operation on it instead.
func newBridgeTransport(sock string, verify func(net.Conn) error) (*http.Transport, http.RoundTripper) {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			c, err := d.DialContext(ctx, "unix", sock)
			if err != nil {
				return nil, err
			}
			if err := verify(c); err != nil {
				c.Close()
				return nil, fmt.Errorf("bridge endpoint verification: %w", err)
			}
			return c, nil
		},
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
	}
	return tr, noRetryTransport{tr}
}

// noRetryTransport lets a request use one connection only. The transport
// reports each connection it takes for a request (httptrace GotConn); a
// second one is a retry, and that connection is closed before the request
// is written to it, so the attempt fails and the error reaches the caller.
type noRetryTransport struct{ tr *http.Transport }

func (n noRetryTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	var conns atomic.Int32
	trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
		if conns.Add(1) > 1 {
			info.Conn.Close()
		}
	}}
	resp, err := n.tr.RoundTrip(req.WithContext(httptrace.WithClientTrace(req.Context(), trace)))
	if err != nil && conns.Load() > 1 {
		return nil, fmt.Errorf("%w: %v", ErrBridgeConnLost, err)
	}
	return resp, err
}

// stopActivation ends the activation's streams, stops its bridge and the
// sandbox. The caller has already removed it from the active map.
func (m *Manager) stopActivation(a *activation, why string) {
	a.cancel()
	a.stopGateway()
	a.tr.CloseIdleConnections()
	a.host.Process.Signal(syscall.SIGTERM)
	select {
	case <-a.hostDone:
	case <-time.After(3 * time.Second):
		a.host.Process.Kill()
		<-a.hostDone
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := a.inst.Stop(ctx); err != nil {
		m.log.Warn("sandbox stop", "sandbox", a.route.SandboxID, "err", err)
	}
	m.metrics.activations.Dec()
	m.log.Info("activation stopped", "sandbox", a.route.SandboxID, "generation", a.route.Generation, "why", why)
}

// Teardown stops the execution named by route and deletes its record.
// A route for another execution than the installed one is refused with
// a conflict, so a late teardown cannot kill a newer execution.
func (m *Manager) Teardown(ctx context.Context, route identity.Route) error {
	unlock := m.lockSandbox(route.SandboxID)
	defer unlock()
	m.mu.Lock()
	rec, ok := m.records[route.SandboxID]
	if !ok {
		m.mu.Unlock()
		return fmt.Errorf("teardown %s: %w", route.SandboxID, errdefs.ErrNotFound)
	}
	if rec.Route.Epoch() != route.Epoch() {
		m.mu.Unlock()
		return fmt.Errorf("teardown %s: %w: installed execution is %s", route.SandboxID, errdefs.ErrConflict, rec.Route)
	}
	act := m.active[route.SandboxID]
	delete(m.active, route.SandboxID)
	// Together with the activation: until the record is deleted below its
	// capabilities get RefreshRoute, not "installed but not active".
	gone := rec
	gone.Retired = true // in memory only; the record is deleted below
	m.records[route.SandboxID] = gone
	m.mu.Unlock()
	if act != nil {
		m.stopActivation(act, "teardown")
	}
	if err := m.store.delete(route.SandboxID); err != nil {
		m.mu.Lock()
		m.records[route.SandboxID] = rec // as persisted
		m.mu.Unlock()
		return fmt.Errorf("teardown %s: delete record: %w", route.SandboxID, err)
	}
	m.mu.Lock()
	delete(m.records, route.SandboxID)
	m.mu.Unlock()
	if err := os.RemoveAll(rec.Dir); err != nil {
		m.log.Warn("remove sandbox dir", "sandbox", route.SandboxID, "err", err)
	}
	return nil
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
	acts := maps.Clone(m.active)
	clear(m.active)
	m.mu.Unlock()
	var wg sync.WaitGroup
	for _, a := range acts {
		wg.Add(1)
		go func() { defer wg.Done(); m.stopActivation(a, "shutdown") }()
	}
	wg.Wait()
	return errors.Join(m.store.close(), m.audit.close())
}
