//go:build linux

package microvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

// instance is one running VM: one this process started (cmd set, QEMU
// is its child) or one it adopted.
type instance struct {
	s       *Substrate
	route   identity.Route
	dir     string
	socket  string
	qmpPath string
	imageID string
	shape   machineShape
	accel   string
	// root is an image VM's flattened image and layerPath its writable
	// layer disk (nil and "" for a busybox VM).
	root      *rootDisk
	layerPath string

	cmd   *exec.Cmd // nil when adopted: QEMU is then not this process's child
	pid   int
	pidfd *os.File // QEMU's, watched for its exit
	state []byte   // AdoptState, fixed once Start or Adopt returned
	qmp   *qmp
	uid   *uidLease
	log   *cappedWriter
	// console is the read end of QEMU's stdout and stderr, copied into
	// log until copied closes (started instances only: the pipe breaks
	// with the process that started QEMU, and QEMU, ignoring SIGPIPE,
	// drops its console output from then on).
	console *os.File
	copied  chan struct{}

	// processesKept: the VM continued a saved state (Spec.RestoreState)
	// rather than booting (substrate.RestoreReporter).
	processesKept bool

	wg       sync.WaitGroup
	done     chan struct{}
	detached atomic.Bool
	paused   atomic.Bool

	mu      sync.Mutex // serializes Pause, Resume, SaveState, Stop and Detach
	stopped bool

	statsMu sync.Mutex
	lastCPU cpuReading
}

var (
	_ substrate.Instance      = (*instance)(nil)
	_ substrate.StateSaver    = (*instance)(nil)
	_ substrate.StatsReporter = (*instance)(nil)
	_ substrate.Adoptable     = (*instance)(nil)

	_ substrate.RestoreReporter = (*instance)(nil)
)

// ProcessesKept reports whether the VM continued a saved state: false for
// one that booted, from a layer state too.
func (i *instance) ProcessesKept() bool { return i.processesKept }

func (i *instance) Route() identity.Route { return i.route }
func (i *instance) GuestSocket() string   { return i.socket }

// InitPID is QEMU's pid: the process holding the agent channel's listener.
func (i *instance) InitPID() int          { return i.pid }
func (i *instance) Done() <-chan struct{} { return i.done }

// watch closes done when QEMU exits. It waits on QEMU's pidfd in the
// runtime's poller, so it takes no OS thread, and it works as well for a
// QEMU that is not this process's child (adopted). A child is reaped here
// once it has exited, also after Detach (as init would reap it once this
// process is gone); a detached instance's done stays open.
func (i *instance) watch() {
	defer i.wg.Done()
	if err := waitExit(i.pidfd); err != nil {
		return // the pidfd was closed: Detach of an adopted QEMU
	}
	if i.cmd != nil {
		_ = i.cmd.Wait()
	}
	if !i.detached.Load() {
		close(i.done)
	}
}

// copyConsole copies QEMU's console output into console.log.
func (i *instance) copyConsole() {
	defer close(i.copied)
	_, _ = io.Copy(i.log, i.console)
}

// live returns an error when the instance cannot take commands.
func (i *instance) live() error {
	if i.stopped {
		return errors.New("microvm: instance stopped")
	}
	if i.detached.Load() {
		return errors.New("microvm: instance detached")
	}
	select {
	case <-i.done:
		return errors.New("microvm: qemu exited")
	default:
		return nil
	}
}

// Paused reports whether the vCPUs are stopped (Pause, or SaveState after
// it), as this process last set or, for an adopted instance, found them.
func (i *instance) Paused() bool { return i.paused.Load() }

// Pause stops the vCPUs (QMP stop); QEMU, the channel and guest memory
// stay as they are.
func (i *instance) Pause(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if err := i.live(); err != nil {
		return err
	}
	if _, err := i.qmp.execute(ctx, "stop", nil, nil); err != nil {
		return fmt.Errorf("microvm: pause: %w", err)
	}
	i.paused.Store(true)
	return nil
}

// Resume continues the vCPUs (QMP cont), also after SaveState.
func (i *instance) Resume(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if err := i.live(); err != nil {
		return err
	}
	if _, err := i.qmp.execute(ctx, "cont", nil, nil); err != nil {
		return fmt.Errorf("microvm: resume: %w", err)
	}
	i.paused.Store(false)
	return nil
}

// Stop asks QEMU to quit (QMP quit, bounded by Config.StopTimeout and
// ctx), kills it through its pidfd otherwise, waits for it, closes QMP,
// removes the sockets and the adoption record and releases the uid.
// console.log is kept. Idempotent; after an error it can be called again.
func (i *instance) Stop(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.stopped {
		return nil
	}
	if i.detached.Load() {
		return errors.New("microvm: stop: instance detached")
	}
	if i.pidfd != nil {
		select {
		case <-i.done:
		default:
			if i.qmp != nil {
				qctx, cancel := context.WithTimeout(ctx, i.s.cfg.StopTimeout)
				_, _ = i.qmp.execute(qctx, "quit", nil, nil)
				select {
				case <-i.done:
				case <-qctx.Done():
				}
				cancel()
			}
			select {
			case <-i.done:
			default:
				_ = signalPidfd(i.pidfd, syscall.SIGKILL)
			}
		}
		select {
		case <-i.done:
		case <-ctx.Done():
			return fmt.Errorf("microvm: stop: qemu %d did not exit: %w", i.pid, ctx.Err())
		}
		i.wg.Wait()
		_ = i.pidfd.Close()
		i.pidfd = nil
	}
	if i.console != nil {
		// QEMU's end closed with QEMU: the copy ends at EOF.
		select {
		case <-i.copied:
		case <-ctx.Done():
		}
		_ = i.console.Close()
		<-i.copied
		i.console = nil
	}
	if i.qmp != nil {
		_ = i.qmp.Close()
	}
	_ = os.Remove(i.socket)
	_ = os.Remove(i.qmpPath)
	_ = os.Remove(filepath.Join(i.dir, RecordName))
	i.uid.release()
	if i.log != nil {
		_ = i.log.Close()
	}
	i.stopped = true
	return nil
}

// consoleTail returns the last n bytes of console.log.
func (i *instance) consoleTail(n int64) string {
	f, err := os.Open(filepath.Join(i.dir, ConsoleLog))
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	off := max(fi.Size()-n, 0)
	b, _ := io.ReadAll(io.NewSectionReader(f, off, n))
	return string(bytes.TrimSpace(b))
}

// pollMigration polls query-migrate until the migration completes, fails
// or ctx ends.
func (i *instance) pollMigration(ctx context.Context) (migrateStatus, error) {
	delay := 5 * time.Millisecond
	for {
		st, err := i.qmp.migrateStatus(ctx)
		if err != nil {
			return st, err
		}
		switch st.Status {
		case "completed":
			return st, nil
		case "failed", "cancelled":
			return st, fmt.Errorf("migration %s: %s", st.Status, st.Error)
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return st, ctx.Err()
		case <-i.done:
			t.Stop()
			return st, errors.New("qemu exited during migration")
		case <-t.C:
		}
		delay = min(delay*2, 50*time.Millisecond)
	}
}

// cappedWriter writes at most left bytes to f and drops the rest.
type cappedWriter struct {
	mu   sync.Mutex
	f    *os.File
	left int64
}

func (w *cappedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.left > 0 && w.f != nil {
		b := p
		if int64(len(b)) > w.left {
			b = b[:w.left]
		}
		n, _ := w.f.Write(b)
		w.left -= int64(n)
	}
	return len(p), nil
}

func (w *cappedWriter) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.f == nil {
		return nil
	}
	err := w.f.Close()
	w.f = nil
	return err
}
