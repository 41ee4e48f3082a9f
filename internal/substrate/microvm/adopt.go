//go:build linux

package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/substrate/uidlease"
)

// Adoption: a sandbox's QEMU outlives the worker process that started it
// (no parent-death signal, a session of its own), and the next worker
// takes it over (substrate.Adopter). What it needs is the adoption state
// (AdoptState, which the caller persists; a copy is RecordName in the
// activation directory for Reclaim): QEMU's pid, start time, executable
// and uid, the QMP and agent sockets, and the machine (accelerator, image,
// shape) SaveState and Stats describe. QMP is reached again through its
// listening socket in the activation directory (see openLaunchFiles); the
// agent channel's connection belongs to spaced-host, which outlives the
// worker too.

// RecordName is the adoption state's copy in the activation directory
// (mode 0600, removed by Stop).
const RecordName = "vm.json"

// adoptVersion is the adoption state's format.
const adoptVersion = 1

// adoptTimeout bounds Adopt's QMP connection and query: a QEMU whose QMP
// is held by another client (or a listener that is not QEMU's) never
// greets.
const adoptTimeout = 10 * time.Second

// adoptState is AdoptState's JSON.
type adoptState struct {
	Version int `json:"version"`
	procID
	QMPSocket   string         `json:"qmp_socket"`
	GuestSocket string         `json:"guest_socket"`
	Accel       string         `json:"accel"`
	ImageID     string         `json:"image_id"`
	Shape       machineShape   `json:"shape"`
	Route       identity.Route `json:"route"`
	// An image VM's disks (QEMU holds them open; SaveState needs to know
	// them): the flattened image and the writable layer disk.
	RootDisk     *rootDiskRef `json:"root_disk,omitempty"`
	RootDiskPath string       `json:"root_disk_path,omitempty"`
	LayerDisk    string       `json:"layer_disk,omitempty"`
}

func parseAdoptState(b []byte) (adoptState, error) {
	var st adoptState
	if err := json.Unmarshal(b, &st); err != nil {
		return st, fmt.Errorf("malformed state: %w", err)
	}
	switch {
	case st.Version != adoptVersion:
		return st, fmt.Errorf("state format version %d, this substrate reads %d", st.Version, adoptVersion)
	case st.PID <= 0 || st.Start == 0 || st.Boot == "" || st.ExeIno == 0:
		return st, errors.New("malformed state: no qemu process")
	case st.Accel != "kvm" && st.Accel != "tcg":
		return st, fmt.Errorf("malformed state: accelerator %q", st.Accel)
	case st.Shape.VCPUs < 1 || st.Shape.VCPUs > MaxVCPUs || st.Shape.MemoryMiB < MinMemoryBytes>>20:
		return st, fmt.Errorf("malformed state: shape %+v", st.Shape)
	}
	return st, nil
}

// record fixes the instance's adoption state once QEMU runs, as id names
// it, and writes its copy to RecordName.
func (i *instance) record(id procID) error {
	st := adoptState{
		Version: adoptVersion, procID: id, QMPSocket: i.qmpPath, GuestSocket: i.socket,
		Accel: i.accel, ImageID: i.imageID, Shape: i.shape, Route: i.route,
	}
	if i.root != nil {
		st.RootDisk = &rootDiskRef{ImageID: i.root.ImageID, SHA256: i.root.SHA256}
		st.RootDiskPath, st.LayerDisk = i.root.path, i.layerPath
	}
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	i.state = b
	if err := os.WriteFile(filepath.Join(i.dir, RecordName), b, 0o600); err != nil {
		return fmt.Errorf("adoption record: %w", err)
	}
	return nil
}

// AdoptState returns the instance's adoption state (adoptState's JSON).
func (i *instance) AdoptState() []byte { return append([]byte(nil), i.state...) }

// Detach lets go of the instance and leaves QEMU running: the QMP
// connection (QEMU's listener takes the next worker's), the pidfd and its
// watch, the console copy (QEMU's console output is dropped from now on,
// as when this process dies) and the uid lease's lock (its owner tag keeps
// the uid QEMU's). A QEMU this process started stays its child and is
// reaped when it exits. Done is not closed.
func (i *instance) Detach() {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.stopped || i.detached.Swap(true) {
		return
	}
	if i.qmp != nil {
		_ = i.qmp.Close()
	}
	if i.console != nil {
		_ = i.console.Close()
		<-i.copied
	}
	if i.cmd == nil && i.pidfd != nil {
		_ = i.pidfd.Close() // ends the watch
		i.wg.Wait()
	}
	if i.uid != nil {
		i.uid.l.Detach()
	}
	if i.log != nil {
		_ = i.log.Close()
	}
}

// Adopt takes over the running VM of spec that an earlier process started
// and described with state (AdoptState), once it has verified it: QEMU,
// pinned by a pidfd, has the recorded start time (this boot), runs the
// recorded QEMU binary (device and inode) as the recorded uid and gid
// alone; its uid lease is taken back for it; its QMP listener answers as
// that process (SO_PEERCRED) with a run state of a started VM (paused is
// learnt); the agent channel's socket is where spec's directory puts it.
// Any failure returns an error wrapping substrate.ErrNotAdoptable (or
// ctx's) and leaves QEMU, its uid and its files as they were.
func (s *Substrate) Adopt(ctx context.Context, spec substrate.Spec, state []byte) (substrate.Instance, error) {
	inst, err := s.adopt(ctx, spec, state)
	if err != nil {
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return nil, fmt.Errorf("microvm: adopt %s: %w", spec.Route.SandboxID, err)
		}
		return nil, fmt.Errorf("microvm: adopt %s: %w: %w", spec.Route.SandboxID, substrate.ErrNotAdoptable, err)
	}
	return inst, nil
}

var _ substrate.Reclaimer = (*Substrate)(nil)
var _ substrate.Adopter = (*Substrate)(nil)

func (s *Substrate) adopt(ctx context.Context, spec substrate.Spec, state []byte) (_ *instance, err error) {
	spec = s.templateImage(spec)
	if err := spec.Validate(identity.SubstrateMicroVM, SocketName); err != nil {
		return nil, err
	}
	st, err := parseAdoptState(state)
	if err != nil {
		return nil, err
	}
	inst := &instance{
		s: s, route: spec.Route, dir: spec.Dir, socket: filepath.Join(spec.Dir, SocketName),
		qmpPath: filepath.Join(spec.Dir, QMPSocketName), imageID: st.ImageID, shape: st.Shape,
		accel: st.Accel, pid: st.PID, state: append([]byte(nil), state...), done: make(chan struct{}),
	}
	if st.GuestSocket != inst.socket || st.QMPSocket != inst.qmpPath {
		return nil, fmt.Errorf("state names sockets %s and %s, the activation directory is %s", st.GuestSocket, st.QMPSocket, spec.Dir)
	}
	if st.Route != spec.Route {
		return nil, fmt.Errorf("state is of activation %s, not %s", st.Route, spec.Route)
	}
	switch {
	case spec.Image == nil && st.RootDisk != nil:
		return nil, fmt.Errorf("state is of a VM of image %s, the spec names none", st.RootDisk.ImageID)
	case spec.Image != nil && st.RootDisk == nil:
		return nil, fmt.Errorf("state is of a VM without an image, the spec names %s", spec.Image.ID)
	case spec.Image != nil && st.RootDisk.ImageID != spec.Image.ID:
		return nil, fmt.Errorf("state is of a VM of image %s, the spec names %s", st.RootDisk.ImageID, spec.Image.ID)
	case st.RootDisk != nil && st.LayerDisk != filepath.Join(spec.Dir, LayerDiskName):
		return nil, fmt.Errorf("state names layer disk %q, the activation directory is %s", st.LayerDisk, spec.Dir)
	case st.RootDisk != nil:
		inst.root = &rootDisk{ImageID: st.RootDisk.ImageID, SHA256: st.RootDisk.SHA256, path: st.RootDiskPath}
		inst.layerPath = st.LayerDisk
	}
	if inst.pidfd, err = openPidfd(st.PID); err != nil {
		if errors.Is(err, syscall.ESRCH) {
			return nil, fmt.Errorf("qemu %d is gone", st.PID)
		}
		return nil, err
	}
	defer func() {
		if err != nil {
			inst.pidfd.Close()
			if inst.uid != nil {
				inst.uid.l.Detach() // the owner tag stays: nothing changed
			}
			if inst.qmp != nil {
				_ = inst.qmp.Close()
			}
		}
	}()
	if err := st.verify(inst.pidfd); err != nil {
		return nil, err
	}
	if fi, err := os.Lstat(inst.socket); err != nil {
		return nil, fmt.Errorf("agent channel: %w", err)
	} else if fi.Mode().Type() != os.ModeSocket {
		return nil, fmt.Errorf("agent channel: %s is not a socket", inst.socket)
	}
	if st.Leased {
		l, err := uidlease.Adopt(s.cfg.UIDLockDir, st.UID, st.PID)
		if err != nil {
			return nil, err
		}
		inst.uid = &uidLease{uid: st.UID, l: l}
	}
	// Bounded whatever ctx allows: a QEMU whose QMP does not answer in
	// time is not adoptable (Adopt tells that from ctx's own end).
	ctx, cancel := context.WithTimeout(ctx, adoptTimeout)
	defer cancel()
	conn, err := dialQMP(ctx, inst.qmpPath, &st.procID)
	if err != nil {
		return nil, err
	}
	if inst.qmp, err = newQMP(ctx, conn); err != nil {
		return nil, err
	}
	run, err := inst.qmp.status(ctx)
	if err != nil {
		return nil, err
	}
	switch run {
	case "running":
	case "paused", "postmigrate":
		inst.paused.Store(true)
	default:
		// A VM still loading its state (its start was cut short) or one
		// that has failed is no activation to serve.
		return nil, fmt.Errorf("qemu %d is in state %q", st.PID, run)
	}
	inst.wg.Add(1)
	go inst.watch()
	s.cfg.Logger.Debug("microvm: adopted", "route", spec.Route.String(), "pid", st.PID, "paused", inst.Paused())
	return inst, nil
}

// Reclaim ends what is left of route's activation in dir
// (substrate.Reclaimer): the QEMU that RecordName names, only once it is
// verified to be that QEMU (pid, start time, executable, uid), is killed
// through its pidfd and awaited; its uid is free once it is gone. The
// sockets and the record are removed; console.log is kept. Nothing left
// is not an error.
func (s *Substrate) Reclaim(ctx context.Context, route identity.Route, dir string) error {
	rec := filepath.Join(dir, RecordName)
	b, err := os.ReadFile(rec)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("microvm: reclaim: %w", err)
	}
	st, err := parseAdoptState(b)
	if err != nil {
		return fmt.Errorf("microvm: reclaim %s: %w", rec, err)
	}
	if st.Route != route {
		return fmt.Errorf("microvm: reclaim: %s is of activation %s, not %s", rec, st.Route, route)
	}
	f, err := openPidfd(st.PID)
	if err != nil && !errors.Is(err, syscall.ESRCH) {
		// Not known to be gone: the record stays, and nothing of the
		// activation is read as ended (its layer disk is not saved).
		return fmt.Errorf("microvm: reclaim: qemu %d: %w", st.PID, err)
	}
	if err == nil {
		defer f.Close()
		if st.verify(f) == nil {
			// Anything else under that pid is not ours to kill.
			if err := signalPidfd(f, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
				return fmt.Errorf("microvm: reclaim: kill qemu %d: %w", st.PID, err)
			}
			gone := make(chan error, 1)
			go func() { gone <- waitExit(f) }() // ends when f is closed, too
			select {
			case <-gone:
			case <-ctx.Done():
				f.Close()
				<-gone
				return fmt.Errorf("microvm: reclaim: qemu %d did not exit: %w", st.PID, ctx.Err())
			}
		}
	}
	for _, p := range []string{filepath.Join(dir, SocketName), filepath.Join(dir, QMPSocketName), rec} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("microvm: reclaim: %w", err)
		}
	}
	return nil
}
