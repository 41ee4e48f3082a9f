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
	"syscall"
	"time"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

// instance is one running VM.
type instance struct {
	s       *Substrate
	route   identity.Route
	dir     string
	socket  string
	imageID string
	shape   machineShape
	lim     substrate.Limits

	cmd *exec.Cmd
	pid int
	qmp *qmp
	uid *uidLease
	log *cappedWriter

	wg   sync.WaitGroup
	done chan struct{}

	mu      sync.Mutex // serializes Pause, Resume, SaveState and Stop
	stopped bool

	statsMu sync.Mutex
	lastCPU cpuReading
}

var (
	_ substrate.Instance      = (*instance)(nil)
	_ substrate.StateSaver    = (*instance)(nil)
	_ substrate.StatsReporter = (*instance)(nil)
)

func (i *instance) Route() identity.Route { return i.route }
func (i *instance) GuestSocket() string   { return i.socket }

// InitPID is QEMU's pid: the process holding the agent channel's listener.
func (i *instance) InitPID() int          { return i.pid }
func (i *instance) Done() <-chan struct{} { return i.done }

func (i *instance) wait() {
	defer i.wg.Done()
	_ = i.cmd.Wait()
	close(i.done)
}

// live returns an error when the instance cannot take commands.
func (i *instance) live() error {
	if i.stopped {
		return errors.New("microvm: instance stopped")
	}
	select {
	case <-i.done:
		return errors.New("microvm: qemu exited")
	default:
		return nil
	}
}

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
	return nil
}

// Stop asks QEMU to quit (QMP quit, bounded by Config.StopTimeout and
// ctx), kills it otherwise, waits for it, closes QMP, removes guest.sock
// and releases the uid. console.log is kept. Idempotent; after an error it
// can be called again.
func (i *instance) Stop(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.stopped {
		return nil
	}
	if i.cmd != nil {
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
				_ = syscall.Kill(i.pid, syscall.SIGKILL)
			}
		}
		select {
		case <-i.done:
		case <-ctx.Done():
			return fmt.Errorf("microvm: stop: qemu %d did not exit: %w", i.pid, ctx.Err())
		}
		i.wg.Wait()
	}
	if i.qmp != nil {
		_ = i.qmp.Close()
	}
	_ = os.Remove(i.socket)
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
