//go:build linux

package microvm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

// Template snapshots and copy-on-write clones.
//
// A cold boot under TCG takes seconds. So, once per image, machine shape
// and accelerator, the substrate boots a template VM whose guest RAM is a
// memfd (memory-backend-file, share=on), waits until its agent is up and
// waiting for an activation (it never gets one), pauses it and saves its
// state with migration's x-ignore-shared: the stream holds devices and
// CPUs but none of the RAM, which stays in the memfd. QEMU then quits and
// the memfd is sealed (no write, grow, shrink or new seals): no process,
// QEMU or root, can change a template afterwards.
//
// A new sandbox is a clone: a QEMU with the same command line, guest RAM
// mapped privately from the sealed memfd (share=off: copy-on-write, so
// idle clones share the template's unchanged pages in the host's page
// cache) and the saved stream loaded with -incoming and x-ignore-shared.
// The guest continues where the template stopped: an agent without an
// identity, which spaced-host activates over the verified channel with the
// clone's identity and fresh entropy (the kernel's random state would
// otherwise be the template's) before anything is served. The guest clock
// is stepped to the RTC at that activation.
//
// Templates live in memory for the life of the substrate and are rebuilt
// by a new process: their key covers the image (kernel, modules, busybox,
// agent), the shape, the accelerator and the QEMU binary, so a change of
// any of them builds a new one. A template that fails to build is retried
// after templateRetry; until then sandboxes boot cold.

const (
	templateRetry = 30 * time.Second
	// templateReadyMarker is what the agent logs (to the console) once it
	// serves the channel, waiting for an activation.
	templateReadyMarker = "vm mode: serving"
	templateBootTimeout = 2 * time.Minute
)

// vmTemplate is a saved template: RAM and state, both sealed memfds.
type vmTemplate struct {
	key   string
	ram   *os.File
	state *os.File
	took  time.Duration
}

// openState opens a new file description of the saved state (each clone
// reads the stream from its start) positioned after the header.
func (t *vmTemplate) openState() (*os.File, error) {
	f, _, err := openState(procSelfFD(t.state))
	if err != nil {
		return nil, fmt.Errorf("microvm: template state: %w", err)
	}
	return f, nil
}

func procSelfFD(f *os.File) string { return "/proc/self/fd/" + strconv.Itoa(int(f.Fd())) }

type templateSlot struct {
	done   chan struct{} // closed when the build ended
	t      *vmTemplate
	err    error
	failed time.Time
}

// templateKey names a template: everything its saved state depends on.
func (s *Substrate) templateKey(imgID string, shape machineShape) (string, error) {
	qsum, err := s.fileSum(s.cfg.QEMUPath)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "%s|%d|%d|%s|%s|%x", imgID, shape.MemoryMiB, shape.VCPUs, s.accel, machineFor(s.accel, s.tscKHz).appendExtra, qsum)
	return hex.EncodeToString(h.Sum(nil))[:32], nil
}

// templateFor returns the template for the image and shape, building it
// first if needed (concurrent callers wait for one build). It returns nil
// when no template can be had now (the caller boots cold); the reason is
// logged.
func (s *Substrate) templateFor(ctx context.Context, imgID, imgPath string, shape machineShape, agent string) *vmTemplate {
	key, err := s.templateKey(imgID, shape)
	if err != nil {
		s.cfg.Logger.Warn("microvm: template key", "err", err)
		return nil
	}
	s.tmplMu.Lock()
	slot := s.templates[key]
	if slot != nil {
		select {
		case <-slot.done:
			if slot.err != nil && time.Since(slot.failed) > templateRetry {
				slot = nil // retry
			}
		default:
		}
	}
	if slot == nil {
		if s.closed {
			s.tmplMu.Unlock()
			return nil
		}
		slot = &templateSlot{done: make(chan struct{})}
		s.templates[key] = slot
		s.tmplWG.Add(1)
		go func() { // owned by the substrate: Close waits for it
			defer s.tmplWG.Done()
			t, err := s.buildTemplate(key, imgID, shape, agent)
			s.tmplMu.Lock()
			slot.t, slot.err = t, err
			if err != nil {
				slot.failed = time.Now()
			}
			s.tmplMu.Unlock()
			close(slot.done)
			if err != nil {
				s.cfg.Logger.Warn("microvm: template build failed; sandboxes boot cold until a retry", "key", key, "err", err)
			} else {
				s.cfg.Logger.Info("microvm: template ready", "key", key, "memory_mib", shape.MemoryMiB, "vcpus", shape.VCPUs, "took", t.took)
			}
		}()
	}
	s.tmplMu.Unlock()
	select {
	case <-slot.done:
	case <-ctx.Done():
		return nil
	}
	return slot.t
}

// buildTemplate boots, readies and saves one template (see the top of
// this file).
func (s *Substrate) buildTemplate(key, imgID string, shape machineShape, agent string) (_ *vmTemplate, err error) {
	t0 := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), templateBootTimeout)
	defer cancel()
	go func() { // the substrate's Close cuts a build short
		select {
		case <-s.closing:
			cancel()
		case <-ctx.Done():
		}
	}()
	size := shape.MemoryMiB << 20
	ram, err := newMemfd("space-template-ram", size)
	if err != nil {
		return nil, err
	}
	state, err := newMemfd("space-template-state", 0)
	if err != nil {
		ram.Close()
		return nil, err
	}
	defer func() {
		if err != nil {
			ram.Close()
			state.Close()
		}
	}()
	dir := filepath.Join(s.cfg.StateDir, "templates", key)
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	spec := substrate.Spec{
		Route: identity.Route{SandboxID: "template", Generation: 1, ExecutionID: "template", WorkerID: "template",
			Substrate: identity.SubstrateMicroVM, ActivationID: "template"},
		Dir: dir, AgentPath: agent,
		Limits: substrate.Limits{MemoryBytes: size, CPUMillis: int64(shape.VCPUs) * 1000},
	}
	inst, err := s.start(ctx, spec, ram)
	if err != nil {
		return nil, fmt.Errorf("template boot: %w", err)
	}
	defer func() {
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer scancel()
		if serr := inst.Stop(sctx); serr != nil && err == nil {
			err = fmt.Errorf("template stop: %w", serr)
		}
		if err == nil {
			// Sealing needs QEMU's shared writable mapping gone.
			err = seal(ram)
		}
		if err == nil {
			err = seal(state)
		}
	}()
	if err := inst.waitConsole(ctx, templateReadyMarker); err != nil {
		return nil, fmt.Errorf("template boot: %w", err)
	}
	if err := inst.Pause(ctx); err != nil {
		return nil, err
	}
	if _, err := inst.qmp.execute(ctx, "migrate-set-capabilities", map[string]any{
		"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": true}},
	}, nil); err != nil {
		return nil, fmt.Errorf("template save: %w", err)
	}
	if _, err := inst.SaveState(ctx, state); err != nil {
		return nil, fmt.Errorf("template save: %w", err)
	}
	return &vmTemplate{key: key, ram: ram, state: state, took: time.Since(t0)}, nil
}

// waitConsole waits until console.log contains marker, the VM ends or
// ctx ends.
func (i *instance) waitConsole(ctx context.Context, marker string) error {
	path := filepath.Join(i.dir, ConsoleLog)
	for {
		if b, err := os.ReadFile(path); err == nil && bytes.Contains(b, []byte(marker)) {
			return nil
		}
		select {
		case <-i.done:
			return fmt.Errorf("qemu exited before %q; console tail: %s", marker, i.consoleTail(1024))
		case <-ctx.Done():
			return fmt.Errorf("no %q within the bound (%w); console tail: %s", marker, ctx.Err(), i.consoleTail(1024))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// newMemfd returns a sealable memfd of size bytes (sparse).
func newMemfd(name string, size int64) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("microvm: memfd: %w", err)
	}
	f := os.NewFile(uintptr(fd), name)
	if size > 0 {
		if err := f.Truncate(size); err != nil {
			f.Close()
			return nil, fmt.Errorf("microvm: memfd: %w", err)
		}
	}
	return f, nil
}

// seal forbids every further change of f's contents and size, and further
// seals.
func seal(f *os.File) error {
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_WRITE|unix.F_SEAL_GROW|unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL); err != nil {
		return fmt.Errorf("microvm: seal %s: %w", f.Name(), err)
	}
	return nil
}

// closeTemplates stops pending builds and frees every template.
func (s *Substrate) closeTemplates() {
	s.tmplMu.Lock()
	if !s.closed {
		s.closed = true
		close(s.closing)
	}
	s.tmplMu.Unlock()
	s.tmplWG.Wait()
	s.tmplMu.Lock()
	defer s.tmplMu.Unlock()
	for k, slot := range s.templates {
		if slot.t != nil {
			slot.t.ram.Close()
			slot.t.state.Close()
		}
		delete(s.templates, k)
	}
}
