package sbxmanager

// Install and teardown of an execution: activating it (substrate, bridge,
// gateway state), persisting its record, stopping the activation it
// replaces.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

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
		return spacev1.InstallResponse{Route: r, EnvdVersion: m.cfg.EnvdVersion, ProcessesKept: req.RestoreSnapshot != "" && m.caps(r).SavesState && processesKept(act.inst)}, nil // idempotent retry
	}
	if hasOld && old.Route.Generation > r.Generation {
		return spacev1.InstallResponse{}, fmt.Errorf("install: %w: generation %d is older than installed %d", errdefs.ErrConflict, r.Generation, old.Route.Generation)
	}
	// Refuse to revive a retired execution; restore the snapshot (if any)
	// before the running execution is touched (snapshot.go).
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
	rec := record{Record: identity.Record{Route: r}, Template: req.Template, EnvVars: req.EnvVars, Limits: limits, Dir: dir, Installed: time.Now().UTC(), Network: req.Network, Image: req.Image, Volumes: req.Volumes}
	if req.RestoreSnapshot != "" && m.caps(r).SavesState {
		rec.restoreState = filepath.Join(dir, stateFile) // prepareInstall fetched it
		defer os.Remove(rec.restoreState)                // loaded by now, or useless
	}

	sctx, cancel := context.WithTimeout(ctx, m.cfg.StartTimeout)
	defer cancel()
	var tm installTiming
	newAct, err := m.activate(sctx, &rec, &tm)
	if err != nil {
		log.Error("activation failed", "err", err)
		return spacev1.InstallResponse{}, fmt.Errorf("install %s: %w", r.SandboxID, err)
	}
	rec.Host = newAct.hostProc
	if ad, ok := newAct.inst.(substrate.Adoptable); ok {
		rec.Adopt = ad.AdoptState()
	}
	crashpoint.Hit(crashpoint.InstallActivated)
	t0 := time.Now()
	if err := m.store.put(rec); err != nil {
		m.stopActivation(newAct, "persist failed")
		return spacev1.InstallResponse{}, fmt.Errorf("install %s: persist record: %w", r.SandboxID, err)
	}
	tm.persist = time.Since(t0)
	crashpoint.Hit(crashpoint.InstallPersisted)
	log.Debug(InstallTimingMsg, "substrate", tm.substrate, "bridge", tm.bridge, "gateway", tm.gateway, "persist", tm.persist,
		"total", time.Since(tStart))
	m.mu.Lock()
	m.records[r.SandboxID] = rec
	m.active[r.SandboxID] = newAct
	m.watchers.Add(1)
	m.mu.Unlock()
	go m.watchExit(newAct)
	if hasOld && old.Dir != rec.Dir {
		os.RemoveAll(old.Dir) // the superseded execution's writable layer
	}
	m.metrics.activations.Inc()
	log.Info("execution installed", "execution", r.ExecutionID, "activation", r.ActivationID)
	return spacev1.InstallResponse{Route: r, EnvdVersion: m.cfg.EnvdVersion, ProcessesKept: rec.restoreState != "" && processesKept(newAct.inst)}, nil
}

// processesKept reports whether inst, started from a saved state, kept
// its processes (a state saved from a layer disk alone boots).
func processesKept(inst substrate.Instance) bool {
	if rr, ok := inst.(substrate.RestoreReporter); ok {
		return rr.ProcessesKept()
	}
	return true
}

// activationDir is short on purpose: the bridge and guest sockets live in
// it and a Unix socket path must fit in 108 bytes.
func activationDir(stateDir string, r identity.Route) string {
	sum := sha256.Sum256([]byte(fmt.Sprintf("%s/%d/%s/%s", r.SandboxID, r.Generation, r.ExecutionID, r.ActivationID)))
	return filepath.Join(stateDir, "act", hex.EncodeToString(sum[:8]))
}

// Files sbx-manager puts in an activation directory: the guest
// configuration spaced-host sends as the activation message
// (Capabilities.Activation), and an instance state being restored
// (Capabilities.SavesState; removed once loaded).
const (
	activationFile = "activation.json"
	stateFile      = "restore.state"
)

// guestConfig is what spaced-guest reads from SPACE_GUEST_CONFIG (or
// receives as its activation message).
type guestConfig struct {
	Identity    identity.Route      `json:"identity"`
	Env         map[string]string   `json:"env,omitempty"`
	DefaultUser string              `json:"default_user"`
	Network     *guestNetworkConfig `json:"network,omitempty"`
}

// InstallTimingMsg is the message of the debug record an install logs
// with its phases (substrate start, bridge start and verification, gateway
// start, record persisted) as durations; make bench aggregates them.
const InstallTimingMsg = "install timing"

// installTiming is how long each phase of an install took.
type installTiming struct {
	substrate, bridge, gateway, persist time.Duration
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

func (m *Manager) activate(ctx context.Context, rec *record, tm *installTiming) (_ *activation, err error) {
	r := rec.Route
	spec := substrate.Spec{
		Route: r, Template: rec.Template, Dir: rec.Dir, AgentPath: m.cfg.AgentPath,
		Limits:       substrateLimits(rec.Limits),
		RestoreState: rec.restoreState,
	}
	if rec.Image != nil {
		if m.images == nil {
			return nil, fmt.Errorf("%w: this worker does not run OCI images", errdefs.ErrInvalid)
		}
		img, err := m.images.Resolve(ctx, *rec.Image)
		if err != nil {
			return nil, fmt.Errorf("image of %s: %w", r.SandboxID, err)
		}
		spec.Image = img
	}
	caps := m.caps(r)
	releaseVolumes, err := m.acquireVolumes(ctx, rec.Volumes, &spec)
	if err != nil {
		return nil, err
	}
	// The sandbox holds its own mounts of them once it runs.
	defer releaseVolumes()
	// The egress link: a VMM's tap exists before the VM starts; an ns
	// sandbox's veth is attached once its init runs. Either way nothing
	// gets out until applyNetwork below put the policy in force.
	tap, err := m.linkBeforeStart(rec, caps, &spec)
	if err != nil {
		return nil, err
	}
	if tap != nil {
		defer tap.Close() // the VMM holds its own copy
	}
	defer func() {
		if err != nil {
			m.releaseLink(*rec)
			rec.Link = nil
		}
	}()
	gcfg, _ := json.Marshal(guestConfig{Identity: r, Env: rec.EnvVars, DefaultUser: "user", Network: m.guestNetwork(*rec, caps)})
	// An agent reads its configuration at start, or learns it (again,
	// after a restore) from spaced-host's activation message.
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
	if l.err == nil {
		l.err = m.linkAfterStart(rec, caps, inst)
	}
	if l.err != nil {
		if l.bp != nil {
			l.bp.kill()
		}
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
	if err := m.applyNetwork(*rec); err != nil {
		m.stopActivation(act, "egress policy failed") // the deferred release removes the link
		return nil, err
	}
	act.link = rec.Link // from now on stopActivation releases it
	if !caps.Netns {
		// No network namespace on the host to reach its ports from: a
		// microVM's are dialed on its link in the egress namespace;
		// without a link no service ports are served (never the host's).
		if caps.Tap {
			if act.gwState, err = m.recordTapGateway(inst, rec.Dir, rec.Link); err != nil {
				m.stopActivation(act, "gateway failed")
				return nil, err
			}
		}
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

// watchExit waits for a's init to exit while a is served (its lease, a.ctx,
// ends first whenever the manager stops it: a replacement, a retirement, a
// teardown, a shutdown). An init that exits on its own took the sandbox's
// processes with it: the activation is stopped, its record and files are
// kept, and OnLost reports the execution for recovery.
func (m *Manager) watchExit(a *activation) {
	defer m.watchers.Done()
	select {
	case <-a.ctx.Done():
		return
	case <-a.inst.Done():
	}
	unlock := m.lockSandbox(a.route.SandboxID)
	m.mu.Lock()
	cur := m.active[a.route.SandboxID]
	if cur != a || a.ctx.Err() != nil {
		m.mu.Unlock()
		unlock()
		return // being stopped by the manager: not lost
	}
	delete(m.active, a.route.SandboxID)
	m.mu.Unlock()
	m.log.Warn("sandbox init exited while served; its execution is lost", "sandbox", a.route.SandboxID, "generation", a.route.Generation)
	m.audit.lost("lost", a.route, nil)
	m.stopActivation(a, "its init exited")
	m.mu.RLock()
	dir := m.records[a.route.SandboxID].Dir
	m.mu.RUnlock()
	recovers := m.recoverable(a.route, dir)
	if !recovers {
		m.unrecoverable(a.route)
	}
	unlock()
	if m.onLost != nil && recovers {
		m.onLost(a.route)
	}
}

// recoverable reports whether the execution of route, whose activation
// directory is dir, comes back from its files once its processes are
// gone: always for a substrate whose snapshots are of its writable layer;
// for one whose snapshots are an instance's whole state (SavesState),
// only when the activation kept its files on a disk of its own
// (substrate.LayerSaver: a microVM booted from an image, not one whose
// files lived in its memory).
func (m *Manager) recoverable(route identity.Route, dir string) bool {
	if !m.caps(route).SavesState {
		return true
	}
	ls, ok := m.subs[route.Substrate].(substrate.LayerSaver)
	return ok && dir != "" && ls.HasLayer(dir)
}

// unrecoverable logs and audits an execution that nothing brings back
// (see recoverable): its files went with its memory.
func (m *Manager) unrecoverable(route identity.Route) {
	m.audit.lost("unrecoverable", route, nil)
	m.log.Error("lost execution not recoverable: its files lived in its memory", "sandbox", route.SandboxID,
		"generation", route.Generation, "execution", route.ExecutionID)
}

// stopActivation ends the activation's streams, stops its bridge and the
// sandbox. The caller has already removed it from the active map.
func (m *Manager) stopActivation(a *activation, why string) {
	a.cancel()
	a.stopGateway()
	a.tr.CloseIdleConnections()
	a.stopHost()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := a.inst.Stop(ctx); err != nil {
		m.log.Warn("sandbox stop", "sandbox", a.route.SandboxID, "err", err)
	}
	if a.link != nil && m.egress != nil {
		if err := m.egress.Release(*a.link); err != nil {
			m.log.Warn("releasing an egress link", "sandbox", a.route.SandboxID, "slot", a.link.Slot, "err", err)
		}
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
	crashpoint.Hit(crashpoint.TeardownStopped)
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
