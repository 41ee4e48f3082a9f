//go:build linux

package ns

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/substrate/uidlease"
)

// A running ns sandbox: its lifecycle (pause by the freezer, resume,
// stop) and its capped console log.

// instance is one running ns sandbox.
type instance struct {
	s      *Substrate
	route  identity.Route
	dir    string
	socket string
	cg     *cgroup
	// cgName names the groups (<parent>/<cgName>, warm.go renames them).
	cgName string
	pid    int
	// The init is watched through cmd (a child this process started; its
	// exit seen by procwait, stopWatch unregisters it) or, adopted, through
	// pidfd (adopt.go).
	cmd       *exec.Cmd
	stopWatch func()
	pidfd     *os.File
	// log caps the init's output, which reaches it through the pipe logR
	// (copied until copied is closed).
	log    *cappedWriter
	logR   *os.File
	copied chan struct{}
	// logPipe is the pipe's identity (the next worker opens it again).
	logPipe fileID
	// detach ends the watchers (Detach).
	detach chan struct{}
	// state is AdoptState's (adopt.go), set once Start or Adopt returns.
	state []byte

	wg   sync.WaitGroup
	done chan struct{}

	mu      sync.Mutex // serializes Pause, Resume and Stop
	stopped bool

	// lim are the effective limits; statsMu guards lastCPU (stats.go) and
	// keeps Stats out of the cgroup while Stop removes it.
	lim substrate.Limits
	// uids is the host uid range of the sandbox's user namespace (nil
	// without one); released once the init is gone.
	uids *uidlease.Lease
	// releaseLayer lets go of the writable layer (layer.go) once the
	// init is gone.
	releaseLayer func() error
	statsMu      sync.Mutex
	lastCPU      cpuReading
}

var _ substrate.Instance = (*instance)(nil)

func (i *instance) Route() identity.Route { return i.route }

func (i *instance) GuestSocket() string { return i.socket }

func (i *instance) InitPID() int { return i.pid }

func (i *instance) Done() <-chan struct{} { return i.done }

// LayerDir is the host path of the writable layer, mounted while the
// instance runs.
func (i *instance) LayerDir() string { return i.s.LayerDir(i.dir) }

// wait closes done once the init (this process's child) has exited and
// is reaped; no thread is held per sandbox. Detach ends it early.
func (i *instance) wait(exited <-chan struct{}) {
	defer i.wg.Done()
	select {
	case <-exited:
		_ = i.cmd.Wait()
		close(i.done)
	case <-i.detach:
	}
}

// copyLog copies the init's output to its capped log until the pipe's
// writers are gone or logR is closed (Stop, Detach).
func (i *instance) copyLog() {
	defer i.wg.Done()
	defer close(i.copied)
	_, _ = io.Copy(i.log, i.logR)
}

// hasInit reports whether an init process belongs to the instance.
func (i *instance) hasInit() bool { return i.cmd != nil || i.pidfd != nil }

// kill sends SIGKILL to the init: through its pidfd when adopted (the
// init is not this process's child, so its pid could be reused once it
// is gone), else by pid (an unreaped child's pid is not reused).
func (i *instance) kill() {
	if i.pidfd != nil {
		if rc, err := i.pidfd.SyscallConn(); err == nil {
			_ = rc.Control(func(fd uintptr) { _ = unix.PidfdSendSignal(int(fd), unix.SIGKILL, nil, 0) })
		}
		return
	}
	if i.cmd != nil {
		_ = syscall.Kill(i.pid, syscall.SIGKILL)
	}
}

// endLog waits a little for the init's output to drain once its writers
// are gone, then stops copying.
func (i *instance) endLog() {
	if i.logR == nil {
		return
	}
	select {
	case <-i.copied:
	case <-time.After(logDrainWait):
	}
	_ = i.logR.Close()
	<-i.copied
}

// logDrainWait bounds how long Stop waits for the init's last output.
const logDrainWait = 2 * time.Second

// Pause freezes every process of the sandbox.
//
// A v1 freezer can stay FREEZING for good when a task waits
// uninterruptibly on one already frozen (a lock held by a frozen sibling,
// say). Such a stall depends on where each task happened to be, so Pause
// makes up to freezeAttempts attempts of FreezeAttemptTimeout each, thawing
// in between so the waiter gets its lock and moves on. A sandbox is never
// left half frozen: after the last failed attempt it is thawed and the
// pause reported as failed, naming the tasks that would not freeze.
func (i *instance) Pause(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.stopped {
		return errors.New("ns: sandbox stopped")
	}
	var err error
	for attempt := 1; attempt <= freezeAttempts; attempt++ {
		fctx, cancel := context.WithTimeout(ctx, FreezeAttemptTimeout)
		err = i.cg.freeze(fctx, true)
		cancel()
		if err == nil {
			return nil
		}
		stuck := i.cg.unfrozenTasks()
		tctx, tcancel := context.WithTimeout(context.Background(), FreezeAttemptTimeout)
		terr := i.cg.freeze(tctx, false)
		tcancel()
		if terr != nil {
			return fmt.Errorf("ns: pause: %w (and thawing failed: %v)", err, terr)
		}
		err = fmt.Errorf("did not freeze within %s (tasks not frozen: %s): %w", FreezeAttemptTimeout, stuck, err)
		if ctx.Err() != nil {
			break
		}
		// Let the tasks that were waiting on a frozen one run a little.
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(attempt) * 20 * time.Millisecond):
		}
	}
	return fmt.Errorf("ns: pause: thawed again after %d attempts: %w", freezeAttempts, err)
}

// FreezeAttemptTimeout bounds one attempt of Pause to freeze every task;
// Pause makes at most freezeAttempts of them.
const FreezeAttemptTimeout = 1500 * time.Millisecond

const freezeAttempts = 4

// Resume thaws the sandbox.
func (i *instance) Resume(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.stopped {
		return errors.New("ns: sandbox stopped")
	}
	if err := i.cg.freeze(ctx, false); err != nil {
		return fmt.Errorf("ns: resume: %w", err)
	}
	return nil
}

// Stop kills the sandbox (SIGKILL to its init tears the pid namespace
// down; the mount namespace and with it every mount goes away with the last
// process), waits for the init, removes the cgroups, the socket, the work
// dir and the rootfs mount point. Spec.Dir/upper and agent.log are kept.
// Idempotent; after an error it can be called again.
func (i *instance) Stop(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.stopped {
		return nil
	}
	if i.hasInit() {
		select {
		case <-i.done:
		default:
			i.kill()
		}
	}
	var errs []error
	if i.cg != nil {
		// Kills stragglers and thaws a paused sandbox so the kill lands.
		// Under statsMu: a concurrent Stats (the worker's sampler) reads
		// the group's directories that remove changes.
		i.statsMu.Lock()
		err := i.cg.remove(ctx)
		i.statsMu.Unlock()
		if err != nil {
			errs = append(errs, err)
		}
	}
	if i.hasInit() {
		select {
		case <-i.done:
		case <-ctx.Done():
			return errors.Join(append(errs, fmt.Errorf("ns: stop: init %d did not exit: %w", i.pid, ctx.Err()))...)
		}
	}
	i.endLog()
	i.wg.Wait()
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	if i.pidfd != nil {
		_ = i.pidfd.Close()
	}
	i.cleanupFiles()
	i.uids.Release() // the init and every process of the range are gone
	if i.releaseLayer != nil {
		if err := i.releaseLayer(); err != nil {
			return fmt.Errorf("ns: stop: %w", err)
		}
		i.releaseLayer = nil
	}
	if i.log != nil {
		_ = i.log.Close()
	}
	i.stopped = true
	i.s.setLive(i.cgName, false)
	return nil
}

// cleanupFiles removes the runtime bits of the activation directory.
func (i *instance) cleanupFiles() {
	if i.dir == "" {
		return // a warm init never claimed: no activation directory
	}
	_ = os.Remove(i.socket)
	_ = os.Remove(filepath.Join(i.dir, rootfsDir))
}

// cappedWriter writes at most left bytes to f and drops the rest. Until
// f is set (a warm init not yet claimed) it keeps up to left bytes.
type cappedWriter struct {
	mu      sync.Mutex
	f       *os.File
	left    int64
	pending []byte
}

func (w *cappedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.left > 0 {
		b := p
		if int64(len(b)) > w.left {
			b = b[:w.left]
		}
		if w.f == nil {
			w.pending = append(w.pending, b...)
			w.left -= int64(len(b))
			return len(p), nil
		}
		n, _ := w.f.Write(b)
		w.left -= int64(n)
	}
	return len(p), nil
}

// setFile directs the output to f, first what was kept.
func (w *cappedWriter) setFile(f *os.File) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.f = f
	if len(w.pending) > 0 {
		_, _ = f.Write(w.pending)
		w.pending = nil
	}
}

func (w *cappedWriter) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.f == nil {
		return nil
	}
	return w.f.Close()
}

// Stats samples the sandbox's usage:
//
//   - memory: the sum over the sandbox's groups (user and agent, where
//     they are separate in the memory hierarchy) of v1 memory.usage_in_bytes
//     / v2 memory.current; MemCache from memory.stat (v1 "cache", v2
//     "file"); MemTotal is the sandbox's memory limit;
//   - CPU: the groups' CPU time (v1 cpuacct.usage where cpuacct is mounted
//     with cpu, v2 cpu.stat usage_usec) over the sampling interval, in
//     percent of one core; CPUCount is the CPU limit rounded up to cores;
//   - disk: with a layer disk (the quota), its file system's used bytes
//     as df counts them (statfs) and DiskTotal its size; without one, the
//     bytes of the regular files and symlinks of the writable layer
//     (Spec.Dir/upper) and DiskTotal 0.
//
// It works on a paused sandbox too (CPU then reads 0).
func (i *instance) Stats(ctx context.Context) (substrate.Stats, error) {
	i.mu.Lock()
	stopped := i.stopped
	i.mu.Unlock()
	if stopped {
		return substrate.Stats{}, errors.New("ns: sandbox stopped")
	}
	i.statsMu.Lock()
	defer i.statsMu.Unlock()

	st := substrate.Stats{
		CPUCount: int((i.lim.CPUMillis + 999) / 1000),
		MemTotal: i.lim.MemoryBytes,
	}
	if st.CPUCount < 1 {
		st.CPUCount = 1
	}
	cur, ok := i.cg.cpuUsage()
	if ok {
		prev := i.lastCPU
		if age := cur.at.Sub(prev.at); prev.at.IsZero() || age < cpuSampleMin || age > cpuSampleMax {
			prev = cur
			t := time.NewTimer(cpuSampleMin)
			select {
			case <-ctx.Done():
				t.Stop()
				return substrate.Stats{}, ctx.Err()
			case <-t.C:
			}
			if cur, ok = i.cg.cpuUsage(); !ok {
				return substrate.Stats{}, errors.New("ns: cpu usage vanished (sandbox stopped?)")
			}
		}
		if dt := cur.at.Sub(prev.at); dt > 0 && cur.usage >= prev.usage {
			st.CPUUsedPct = 100 * float64(cur.usage-prev.usage) / float64(dt)
			if max := float64(100 * st.CPUCount); st.CPUUsedPct > max {
				st.CPUUsedPct = max
			}
		}
		i.lastCPU = cur
	}
	used, cache, err := i.cg.memoryUsage()
	if err != nil {
		return substrate.Stats{}, err
	}
	st.MemUsed, st.MemCache = used, cache
	if i.s.quota {
		// The layer disk is the sandbox's own file system: its statfs is
		// O(1), where a walk costs whatever number of files the sandbox
		// chose to make, every sampling interval.
		st.DiskTotal = diskSize(i.lim.DiskBytes)
		st.DiskUsed, err = fsUsed(i.LayerDir())
	} else {
		st.DiskUsed, err = dirBytes(ctx, i.LayerDir())
	}
	if err != nil {
		return substrate.Stats{}, err
	}
	st.Timestamp = time.Now()
	return st, nil
}
