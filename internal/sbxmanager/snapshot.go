package sbxmanager

// Snapshots (see lifecycle.go for the rules): an instance that saves its
// whole state (substrate.Capabilities.SavesState) is snapshotted and
// restored as that state; any other as an archive of its writable layer,
// which the substrate locates (substrate.LayerPreparer).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/api/spacev1"
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
	if act == nil && m.unreclaimed[route.SandboxID] {
		return spacev1.SnapshotResponse{}, fmt.Errorf("snapshot %s: %w: what is left of the execution could not be ended at the worker's start; its files are not read", route.SandboxID, errdefs.ErrUnavailable)
	}
	if m.caps(route).SavesState && act == nil {
		return m.snapshotLostLayer(ctx, rec, id)
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

// snapshotLostLayer stores, under id, the files of an instance of a
// substrate that saves whole states but whose instance is gone (its
// process died, its memory with it): the disk it kept them on
// (substrate.LayerSaver), from which the restoring install boots. The
// substrate refuses a disk a live instance may still write; an instance
// whose files lived in its memory left nothing. Runs under the sandbox
// lock; the caller checked that nothing is left unreclaimed.
func (m *Manager) snapshotLostLayer(ctx context.Context, rec record, id string) (spacev1.SnapshotResponse, error) {
	route := rec.Route
	ls, ok := m.subs[route.Substrate].(substrate.LayerSaver)
	if !ok || !ls.HasLayer(rec.Dir) {
		return spacev1.SnapshotResponse{}, fmt.Errorf("snapshot %s: %w: the VM is not running on this worker and its files lived in its memory; nothing to save", route.SandboxID, errdefs.ErrConflict)
	}
	var saved int64
	n, err := m.putStream(ctx, id, func(w io.Writer) (err error) {
		saved, err = ls.SaveLayer(ctx, rec.Dir, w)
		return err
	})
	m.audit.lost("layer-saved", route, err)
	if err != nil {
		return spacev1.SnapshotResponse{}, fmt.Errorf("snapshot %s: %w", route.SandboxID, lifecycleErr(ctx, err))
	}
	m.log.Info("layer disk of a lost VM stored", "sandbox", route.SandboxID, "generation", route.Generation, "snapshot", id, "bytes", n, "saved", saved)
	return spacev1.SnapshotResponse{SnapshotID: id, SizeBytes: n}, nil
}

// snapshotState stores a paused instance's whole state (memory, devices,
// files) under id. Runs under the sandbox lock.
func (m *Manager) snapshotState(ctx context.Context, route identity.Route, act *activation, id string) (spacev1.SnapshotResponse, error) {
	saver, _ := act.inst.(substrate.StateSaver)
	if saver == nil {
		return spacev1.SnapshotResponse{}, fmt.Errorf("snapshot %s: %w: the VM's state cannot be saved", route.SandboxID, errdefs.ErrConflict)
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
