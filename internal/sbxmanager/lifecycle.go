package sbxmanager

// Lifecycle of an installed execution on this worker: pause, resume,
// snapshot, retire and restore-on-install (DESIGN.md sections 5, 7, 10).
//
// Every operation names the execution by its route and acts only when the
// installed record has the same identity epoch (a late call for an older
// execution never touches a newer one). Operations on one sandbox are
// serialized with Install and Teardown by the per-sandbox lock.
//
//   - Pause freezes the sandbox (substrate Instance.Pause: the cgroup
//     freezer on ns). The execution, its processes, capabilities and open
//     streams stay; the streams simply see no traffic until Resume. New
//     requests for a paused execution are admitted as usual (so a stale or
//     forged capability still gets RefreshRoute/Deny) and then answered
//     409 Conflict with a JSON error of reason "paused" instead of being
//     forwarded into a frozen guest where they would hang. The control
//     plane resumes (or the edge gets a new route) and the client retries.
//   - Resume thaws it. Both are idempotent.
//   - Snapshot archives the writable layer (<activation dir>/upper) into
//     the snapshot store. The execution must be paused (or not running:
//     after a retire or a worker restart) so the layer is quiescent; the
//     per-sandbox lock keeps it paused until the archive is stored.
//   - Retire persists Retired=true in the runtime record first (bbolt,
//     fsync), then the in-memory record (from then on Admit answers
//     RefreshRoute for the execution, even for unexpired capabilities),
//     then ends the activation's lease (streams end at once with "execution
//     replaced") and stops the activation. The record and the activation
//     directory stay until Teardown. Idempotent; retiring a route older
//     than the installed one, or one this worker has no record of, is a
//     no-op success.
//   - Install with RestoreSnapshot restores the archive into the new
//     activation's (empty) upper dir before the substrate starts, and
//     before a replaced execution is stopped, so a missing or hostile
//     snapshot fails the install without touching what runs.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/envelope"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/snapshot"
	"github.com/spacesbx/space/internal/substrate"
)

// noHostLayer names no file: WritableLayer's answer, in the activation
// directory, for a substrate without a host-side writable layer.
const noHostLayer = "no-host-layer"

// SnapshotStore is where Snapshot archives writable layers and installs
// restore them from (snapshot.Local, or an object store).
type SnapshotStore = snapshot.Store

// ReasonPaused is the JSON error reason of a request for a paused execution.
const ReasonPaused = spacev1.ReasonPaused

// lookup returns the installed record for route's sandbox and its
// activation, checking that the record is route's execution.
func (m *Manager) lookup(op string, route identity.Route) (record, *activation, error) {
	m.mu.RLock()
	rec, ok := m.records[route.SandboxID]
	act := m.active[route.SandboxID]
	closed := m.closed
	m.mu.RUnlock()
	switch {
	case closed:
		return rec, nil, fmt.Errorf("%s %s: %w: manager closed", op, route.SandboxID, errdefs.ErrUnavailable)
	case !ok:
		return rec, nil, fmt.Errorf("%s %s: %w: no execution installed on this worker", op, route.SandboxID, errdefs.ErrNotFound)
	case rec.Route.Epoch() != route.Epoch():
		return rec, nil, fmt.Errorf("%s %s: %w: installed execution is %s", op, route.SandboxID, errdefs.ErrConflict, rec.Route)
	}
	return rec, act, nil
}

func validRoute(op string, route identity.Route) error {
	if err := route.Validate(); err != nil {
		return fmt.Errorf("%s: %w: %v", op, errdefs.ErrInvalid, err)
	}
	return nil
}

// liveActivation is lookup for operations that need a running, not retired
// activation.
func (m *Manager) liveActivation(op string, route identity.Route) (*activation, error) {
	rec, act, err := m.lookup(op, route)
	if err != nil {
		return nil, err
	}
	if rec.Retired {
		return nil, fmt.Errorf("%s %s: %w: execution %s is retired", op, route.SandboxID, errdefs.ErrConflict, rec.Route)
	}
	if act == nil {
		return nil, fmt.Errorf("%s %s: %w: execution %s is not running on this worker (restarted?)", op, route.SandboxID, errdefs.ErrConflict, rec.Route)
	}
	return act, nil
}

// Pause freezes the execution named by route. Idempotent.
func (m *Manager) Pause(ctx context.Context, route identity.Route) error {
	if err := validRoute("pause", route); err != nil {
		return err
	}
	unlock := m.lockSandbox(route.SandboxID)
	defer unlock()
	act, err := m.liveActivation("pause", route)
	if err != nil {
		return err
	}
	if act.paused.Load() {
		return nil
	}
	// New requests stop before the freeze begins, and unary requests
	// already inside the guest get to finish (bounded) rather than fail.
	act.paused.Store(true)
	m.drainUnary(act, pauseDrain)
	if !m.caps(route).SavesState { // a move would restart the processes
		m.drainStarts(act, m.cfg.PauseStreamGrace)
	}
	if err := act.inst.Pause(ctx); err != nil {
		act.paused.Store(false)
		return fmt.Errorf("pause %s: %w", route.SandboxID, lifecycleErr(ctx, err))
	}
	m.log.Info("execution paused", "sandbox", route.SandboxID, "generation", route.Generation)
	return nil
}

// pauseDrain bounds how long Pause waits for unary requests in flight.
const pauseDrain = 5 * time.Second

// drainUnary waits until no unary request holds act's gate, or until max.
// TryLock, not Lock: a request that never ends must not block a pause.
func (m *Manager) drainUnary(act *activation, max time.Duration) {
	deadline := time.Now().Add(max)
	for !act.gate.TryLock() {
		if time.Now().After(deadline) {
			m.log.Warn("pausing with requests still in flight", "sandbox", act.route.SandboxID)
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	act.gate.Unlock()
}

// drainStarts waits until no command started through this worker is still
// running in act, or until max. A command's stream is not cut: the freeze
// holds it, and Resume continues it.
func (m *Manager) drainStarts(act *activation, max time.Duration) {
	if max <= 0 || act.starts.Load() == 0 {
		return
	}
	deadline := time.Now().Add(max)
	for act.starts.Load() > 0 {
		if time.Now().After(deadline) {
			m.log.Info("pausing with commands still running", "sandbox", act.route.SandboxID, "commands", act.starts.Load())
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Resume thaws the execution named by route. Idempotent.
func (m *Manager) Resume(ctx context.Context, route identity.Route) error {
	if err := validRoute("resume", route); err != nil {
		return err
	}
	unlock := m.lockSandbox(route.SandboxID)
	defer unlock()
	act, err := m.liveActivation("resume", route)
	if err != nil {
		return err
	}
	if !act.paused.Load() {
		return nil
	}
	if err := act.inst.Resume(ctx); err != nil {
		return fmt.Errorf("resume %s: %w", route.SandboxID, lifecycleErr(ctx, err))
	}
	act.paused.Store(false)
	m.log.Info("execution resumed", "sandbox", route.SandboxID, "generation", route.Generation)
	return nil
}

func lifecycleErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
	}
	return err
}

// Paused reports whether the sandbox's running activation is paused.
func (m *Manager) Paused(sandbox string) bool {
	m.mu.RLock()
	act := m.active[sandbox]
	m.mu.RUnlock()
	return act != nil && act.paused.Load()
}

// Snapshot archives the writable layer of the execution named by route
// into the snapshot store under id. The execution must be paused (or not
// running). A retried snapshot with the same id replaces the object.
func (m *Manager) Snapshot(ctx context.Context, route identity.Route, id string) (spacev1.SnapshotResponse, error) {
	if err := validRoute("snapshot", route); err != nil {
		return spacev1.SnapshotResponse{}, err
	}
	if err := snapshot.ValidateID(id); err != nil {
		return spacev1.SnapshotResponse{}, err
	}
	if m.snaps == nil {
		return spacev1.SnapshotResponse{}, fmt.Errorf("snapshot: %w: no snapshot store configured on worker %s", errdefs.ErrUnavailable, m.cfg.WorkerID)
	}
	unlock := m.lockSandbox(route.SandboxID)
	defer unlock()
	rec, act, err := m.lookup("snapshot", route)
	if err != nil {
		return spacev1.SnapshotResponse{}, err
	}
	if act != nil && !act.paused.Load() {
		return spacev1.SnapshotResponse{}, fmt.Errorf("snapshot %s: %w: execution must be paused first", route.SandboxID, errdefs.ErrConflict)
	}
	if m.caps(route).SavesState {
		return m.snapshotState(ctx, route, act, id)
	}
	if _, err := os.Stat(rec.Dir); err != nil {
		return spacev1.SnapshotResponse{}, fmt.Errorf("snapshot %s: %w: activation dir %s missing", route.SandboxID, errdefs.ErrNotFound, rec.Dir)
	}
	upper, release, err := m.writableLayer(ctx, route, rec.Dir, rec.Limits)
	if err != nil {
		return spacev1.SnapshotResponse{}, fmt.Errorf("snapshot %s: %w", route.SandboxID, err)
	}
	defer release()
	if fi, err := os.Lstat(upper); err != nil || !fi.IsDir() {
		return spacev1.SnapshotResponse{}, fmt.Errorf("snapshot %s: %w: writable layer %s missing", route.SandboxID, errdefs.ErrNotFound, upper)
	}
	opts := snapshot.ArchiveOptions{Limits: m.cfg.SnapshotLimits}
	// A store on a local file system (snapshot.Local) names its directory:
	// the archive's free-space checks watch that file system.
	if d, ok := m.snaps.(interface{ Dir() string }); ok {
		opts.SpaceDir = d.Dir()
	}
	var st snapshot.Stats
	n, err := m.putStream(ctx, id, func(w io.Writer) (err error) {
		st, err = snapshot.Archive(ctx, upper, w, opts)
		return err
	})
	if err != nil {
		return spacev1.SnapshotResponse{}, fmt.Errorf("snapshot %s: %w", route.SandboxID, lifecycleErr(ctx, err))
	}
	m.log.Info("snapshot stored", "sandbox", route.SandboxID, "generation", route.Generation, "snapshot", id,
		"bytes", n, "entries", st.Entries, "content", st.Bytes, "logical", st.Logical, "skipped", st.Skipped)
	return spacev1.SnapshotResponse{SnapshotID: id, SizeBytes: n}, nil
}

// snapshotState stores a paused instance's whole state (memory, devices;
// its files live in memory) under id. Runs under the sandbox lock.
func (m *Manager) snapshotState(ctx context.Context, route identity.Route, act *activation, id string) (spacev1.SnapshotResponse, error) {
	var saver substrate.StateSaver
	if act != nil {
		saver, _ = act.inst.(substrate.StateSaver)
	}
	if saver == nil {
		return spacev1.SnapshotResponse{}, fmt.Errorf("snapshot %s: %w: the VM is not running on this worker, its state cannot be saved", route.SandboxID, errdefs.ErrConflict)
	}
	var saved int64
	n, err := m.putStream(ctx, id, func(w io.Writer) (err error) {
		saved, err = saver.SaveState(ctx, w)
		return err
	})
	if err != nil {
		return spacev1.SnapshotResponse{}, fmt.Errorf("snapshot %s: %w", route.SandboxID, lifecycleErr(ctx, err))
	}
	m.log.Info("VM state stored", "sandbox", route.SandboxID, "generation", route.Generation, "snapshot", id, "bytes", n, "saved", saved)
	return spacev1.SnapshotResponse{SnapshotID: id, SizeBytes: n}, nil
}

// putStream stores under id what produce writes, streamed through a pipe
// (produce runs in its own goroutine, waited for here). A producer error
// fails the store's read; a store that stops reading fails the producer.
func (m *Manager) putStream(ctx context.Context, id string, produce func(io.Writer) error) (int64, error) {
	pr, pw := io.Pipe()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		pw.CloseWithError(produce(pw))
	}()
	n, err := m.snaps.Put(ctx, id, pr)
	pr.CloseWithError(errors.New("snapshot store stopped reading"))
	wg.Wait()
	return n, err
}

// Retire marks the execution named by route retired (durably, first),
// ends its streams and stops it. See the file comment.
func (m *Manager) Retire(ctx context.Context, route identity.Route) error {
	if err := validRoute("retire", route); err != nil {
		return err
	}
	unlock := m.lockSandbox(route.SandboxID)
	defer unlock()
	_, err := m.retireLocked(route)
	return err
}

// retireLocked runs under the sandbox lock. It reports whether it retired
// anything.
func (m *Manager) retireLocked(route identity.Route) (bool, error) {
	m.mu.RLock()
	rec, ok := m.records[route.SandboxID]
	act := m.active[route.SandboxID]
	m.mu.RUnlock()
	if !ok {
		return false, nil // nothing served for it here
	}
	if rec.Route.Epoch() != route.Epoch() {
		if rec.Route.Generation > route.Generation {
			return false, nil // already superseded by a newer install
		}
		return false, fmt.Errorf("retire %s: %w: installed execution is %s, not %s", route.SandboxID, errdefs.ErrConflict, rec.Route, route)
	}
	retired := false
	if !rec.Retired {
		rec.Retired = true
		if err := m.store.put(rec); err != nil { // bbolt commit: fsynced
			return false, fmt.Errorf("retire %s: persist record: %w", route.SandboxID, err)
		}
		retired = true
	}
	m.mu.Lock()
	m.records[route.SandboxID] = rec
	if act != nil && m.active[route.SandboxID] == act {
		delete(m.active, route.SandboxID)
	}
	m.mu.Unlock()
	if act != nil {
		m.stopActivation(act, "retired")
	}
	if retired {
		m.log.Info("execution retired", "sandbox", route.SandboxID, "generation", route.Generation, "execution", route.ExecutionID)
	}
	return retired, nil
}

// Installed returns the installed runtime record of a sandbox.
func (m *Manager) Installed(sandbox string) (identity.Record, bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	rec, ok := m.records[sandbox]
	return rec.Record, ok
}

// WritableLayer returns the host path of the sandbox's writable layer
// (measurements and tests): valid while its execution runs here (a layer
// kept on a disk of its own is mounted only then). A substrate without a
// host-side layer (a VM's files live in guest memory) has none: the path
// is then one in the activation directory that names no file.
func (m *Manager) WritableLayer(sandbox string) (string, bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	rec, ok := m.records[sandbox]
	if !ok {
		return "", false
	}
	if p, isLayer := m.subs[rec.Route.Substrate].(substrate.LayerPreparer); isLayer {
		return p.LayerDir(rec.Dir), true
	}
	return filepath.Join(rec.Dir, noHostLayer), true
}

// writableLayer makes the writable layer of activation directory dir
// available on the host (a substrate that keeps it on a disk of its own
// mounts it, with the sandbox's quota when it makes it) and returns its
// path and the release to call when done.
func (m *Manager) writableLayer(ctx context.Context, r identity.Route, dir string, lim spacev1.Limits) (string, func() error, error) {
	p, ok := m.subs[r.Substrate].(substrate.LayerPreparer)
	if !ok {
		return "", nil, fmt.Errorf("%w: substrate %s keeps no writable layer on the host", errdefs.ErrUnavailable, r.Substrate)
	}
	return p.PrepareLayer(ctx, dir, substrateLimits(m.withDefaultLimits(lim)))
}

// prepareInstall runs under the sandbox lock before Install touches the
// running activation: it refuses to revive a retired execution and
// restores req.RestoreSnapshot into the new activation's upper dir.
func (m *Manager) prepareInstall(ctx context.Context, req spacev1.InstallRequest, old record, hasOld bool) error {
	r := req.Route
	if hasOld && old.Retired && r.Generation <= old.Route.Generation {
		return fmt.Errorf("install %s: %w: generation %d is retired on this worker", r.SandboxID, errdefs.ErrConflict, old.Route.Generation)
	}
	if req.RestoreSnapshot == "" {
		return nil
	}
	if err := snapshot.ValidateID(req.RestoreSnapshot); err != nil {
		return fmt.Errorf("install %s: %w", r.SandboxID, err)
	}
	if m.snaps == nil {
		return fmt.Errorf("install %s: %w: no snapshot store configured on worker %s", r.SandboxID, errdefs.ErrUnavailable, m.cfg.WorkerID)
	}
	dir := activationDir(m.cfg.StateDir, r)
	if m.caps(r).SavesState {
		return m.fetchState(ctx, r, req.RestoreSnapshot, dir)
	}
	upper, release, err := m.writableLayer(ctx, r, dir, req.Limits)
	if err != nil {
		return fmt.Errorf("install %s: writable layer: %w", r.SandboxID, err)
	}
	defer release()
	if err := os.RemoveAll(upper); err != nil {
		return fmt.Errorf("install %s: clear writable layer: %w", r.SandboxID, err)
	}
	if err := os.Mkdir(upper, 0o755); err != nil {
		return fmt.Errorf("install %s: %w", r.SandboxID, err)
	}
	rc, err := m.snaps.Open(ctx, req.RestoreSnapshot)
	if err != nil {
		os.RemoveAll(upper)
		return fmt.Errorf("install %s: restore: %w", r.SandboxID, err)
	}
	defer rc.Close()
	ropts := snapshot.RestoreOptions{Limits: m.cfg.SnapshotLimits}
	// A layer on a disk of its own is bounded by that disk: the host's
	// free-space reserve does not apply to it.
	ropts.Space.Off = ownFileSystem(upper, dir)
	st, err := snapshot.Restore(ctx, rc, upper, ropts)
	if err != nil {
		os.RemoveAll(upper)
		return fmt.Errorf("install %s: restore snapshot %s: %w", r.SandboxID, req.RestoreSnapshot, lifecycleErr(ctx, err))
	}
	m.log.Info("snapshot restored", "sandbox", r.SandboxID, "generation", r.Generation, "snapshot", req.RestoreSnapshot,
		"entries", st.Entries, "bytes", st.Bytes, "logical", st.Logical)
	return nil
}

// ownFileSystem reports whether path is on another file system than dir
// (a layer disk mounted in the activation directory).
func ownFileSystem(path, dir string) bool {
	var a, b unix.Stat_t
	return unix.Stat(path, &a) == nil && unix.Stat(dir, &b) == nil && a.Dev != b.Dev
}

// fetchState copies an instance state snapshot into the new activation's
// directory, where activate hands it to the substrate (which checks its
// header before loading it).
func (m *Manager) fetchState(ctx context.Context, r identity.Route, id, dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("install %s: %w", r.SandboxID, err)
	}
	rc, err := m.snaps.Open(ctx, id)
	if err != nil {
		return fmt.Errorf("install %s: restore: %w", r.SandboxID, err)
	}
	defer rc.Close()
	path := filepath.Join(dir, stateFile)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("install %s: %w", r.SandboxID, err)
	}
	n, err := io.Copy(f, snapshot.ContextReader(ctx, rc))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
		return fmt.Errorf("install %s: fetch VM state %s: %w", r.SandboxID, id, lifecycleErr(ctx, err))
	}
	m.log.Info("VM state fetched", "sandbox", r.SandboxID, "generation", r.Generation, "snapshot", id, "bytes", n)
	return nil
}

// pausedError answers a request for a paused execution.
func pausedError(w http.ResponseWriter, sandbox string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusConflict)
	json.NewEncoder(w).Encode(spacev1.Error{Code: http.StatusConflict,
		Message: fmt.Sprintf("sandbox %s is paused: resume it (or connect) and retry", sandbox), Reason: ReasonPaused})
}

// leaseWriter wraps the ResponseWriter of a forwarded request so that a
// lease that ends mid-response (the execution was replaced, retired or torn
// down) ends the response with a clear "execution replaced" status instead
// of a silently cut connection:
//
//   - Connect streams (application/connect+json or +proto) end with a
//     Connect end-of-stream message (flag 0x02) carrying
//     {"error":{"code":"unavailable","message":"execution replaced: ..."}},
//     written at a message boundary (the wrapper tracks the envelopes that
//     pass through). If the guest's own end-of-stream already went out the
//     stream is left as it is; if the cut falls inside a message the
//     connection is aborted (a partial message cannot be completed).
//   - A response whose headers had not gone out yet is replaced: Connect
//     streaming requests get HTTP 200 with just that end-of-stream message
//     (how a Connect server reports a stream error), others 503 with the
//     JSON error reason "execution replaced" (no Space-Route-Outcome: the
//     request may have reached the old guest, so it is not a pre-forward
//     rejection and the edge must not replay it blindly).
//   - Any other response that was already streaming is aborted (the
//     client sees the body end early, never a truncated body that looks
//     complete).
type leaseWriter struct {
	w          http.ResponseWriter
	lease      context.Context
	route      identity.Route
	reqConnect string // Content-Type of a Connect streaming request, else ""

	status    int
	swallowed bool // the answer was written after the lease ended: replaced
	connect   bool // the response is a Connect stream

	// env follows the envelopes of a Connect response that went out.
	env envelope.Splitter
}

func newLeaseWriter(w http.ResponseWriter, r *http.Request, act *activation) *leaseWriter {
	lw := &leaseWriter{w: w, lease: act.ctx, route: act.route}
	if ct := r.Header.Get("Content-Type"); strings.HasPrefix(ct, "application/connect+") {
		lw.reqConnect = ct
	}
	return lw
}

func (lw *leaseWriter) Header() http.Header { return lw.w.Header() }

func (lw *leaseWriter) WriteHeader(code int) {
	if lw.status != 0 {
		return
	}
	if code >= 100 && code < 200 {
		if lw.lease.Err() == nil {
			lw.w.WriteHeader(code)
		}
		return
	}
	lw.status = code
	if lw.lease.Err() != nil {
		lw.swallowed = true
		return
	}
	lw.connect = strings.HasPrefix(lw.w.Header().Get("Content-Type"), "application/connect+")
	lw.w.WriteHeader(code)
}

func (lw *leaseWriter) Write(p []byte) (int, error) {
	if lw.status == 0 {
		lw.WriteHeader(http.StatusOK)
	}
	if lw.swallowed {
		return len(p), nil
	}
	n, err := lw.w.Write(p)
	if lw.connect {
		lw.env.Feed(p[:n], nil)
	}
	return n, err
}

func (lw *leaseWriter) Flush() {
	if !lw.swallowed && lw.status != 0 {
		http.NewResponseController(lw.w).Flush()
	}
}

// Unwrap lets http.ResponseController reach the server's writer (full
// duplex, hijack for upgrades, deadlines).
func (lw *leaseWriter) Unwrap() http.ResponseWriter { return lw.w }

func (lw *leaseWriter) replacedMessage() string {
	return fmt.Sprintf("%s: sandbox %s execution %s (generation %d) is no longer served by worker %s; reconnect to the current execution",
		spacev1.ReasonExecutionReplaced, lw.route.SandboxID, lw.route.ExecutionID, lw.route.Generation, lw.route.WorkerID)
}

func (lw *leaseWriter) endStreamFrame() []byte {
	return envelope.EndStreamFrame("unavailable", lw.replacedMessage())
}

// finish is deferred around the proxy: it recovers the proxy's
// http.ErrAbortHandler (a body copy cut by the lease) and ends the
// response as described on leaseWriter. Other panics propagate.
func (lw *leaseWriter) finish() {
	p := recover()
	if p != nil && p != http.ErrAbortHandler {
		panic(p)
	}
	if lw.lease.Err() == nil {
		if p != nil {
			panic(p)
		}
		return
	}
	switch {
	case lw.status == 0 || lw.swallowed:
		h := lw.w.Header()
		clear(h)
		if lw.reqConnect != "" {
			h.Set("Content-Type", lw.reqConnect)
			lw.w.WriteHeader(http.StatusOK)
			lw.w.Write(lw.endStreamFrame())
			return
		}
		h.Set("Content-Type", "application/json")
		lw.w.WriteHeader(http.StatusServiceUnavailable)
		json.NewEncoder(lw.w).Encode(spacev1.Error{Code: http.StatusServiceUnavailable, Message: lw.replacedMessage(), Reason: spacev1.ReasonExecutionReplaced})
	case lw.connect && lw.env.Ended():
		// The guest ended the stream itself.
		if p != nil && !lw.env.AtBoundary() {
			panic(p)
		}
	case lw.connect && lw.env.AtBoundary():
		if _, err := lw.w.Write(lw.endStreamFrame()); err == nil {
			http.NewResponseController(lw.w).Flush()
		}
	case lw.connect:
		panic(http.ErrAbortHandler) // cut inside a message: abort
	default:
		if p != nil {
			panic(p)
		}
	}
}

// Metrics samples the resource usage of the execution named by route
// (running or paused). Substrates whose instances do not implement
// substrate.StatsReporter answer ErrUnavailable.
func (m *Manager) Metrics(ctx context.Context, route identity.Route) (spacev1.MetricsResponse, error) {
	if err := validRoute("metrics", route); err != nil {
		return spacev1.MetricsResponse{}, err
	}
	act, err := m.liveActivation("metrics", route)
	if err != nil {
		return spacev1.MetricsResponse{}, err
	}
	sr, ok := act.inst.(substrate.StatsReporter)
	if !ok {
		return spacev1.MetricsResponse{}, fmt.Errorf("metrics %s: %w: substrate %s reports no metrics", route.SandboxID, errdefs.ErrUnavailable, route.Substrate)
	}
	st, err := sr.Stats(ctx)
	if err != nil {
		return spacev1.MetricsResponse{}, fmt.Errorf("metrics %s: %w: %v", route.SandboxID, errdefs.ErrUnavailable, err)
	}
	return spacev1.MetricsResponse{
		Timestamp: st.Timestamp.UTC(), CPUCount: st.CPUCount, CPUUsedPct: st.CPUUsedPct,
		MemUsed: st.MemUsed, MemTotal: st.MemTotal, MemCache: st.MemCache,
		DiskUsed: st.DiskUsed, DiskTotal: st.DiskTotal,
	}, nil
}
