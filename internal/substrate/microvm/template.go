//go:build linux

package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/vmchan"
)

// Template snapshots and copy-on-write clones.
//
// A cold boot under TCG takes seconds. So, once per image, machine shape
// and accelerator, the substrate boots a template VM whose guest RAM is a
// memfd (memory-backend-file, share=on), activates its agent with the
// template's own identity (so the agent's server exists and a clone's
// activation is only an identity swap), pauses it and saves its
// state with migration's x-ignore-shared: the stream holds devices and
// CPUs but none of the RAM, which stays in the memfd. QEMU then quits and
// the memfd is sealed (no write, grow, shrink or new seals): no process,
// QEMU or root, can change a template afterwards.
//
// A new sandbox is a clone: a QEMU with the same command line, guest RAM
// mapped privately from the sealed memfd (share=off: copy-on-write, so
// idle clones share the template's unchanged pages in the host's page
// cache) and the saved stream loaded with -incoming and x-ignore-shared.
// The guest continues where the template stopped: an agent holding the
// template's identity (which matches no sandbox), which spaced-host
// re-activates over the verified channel with the
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
	templateRetry       = 30 * time.Second
	templateBootTimeout = 2 * time.Minute
)

// vmTemplate is a saved template: RAM and state, both sealed memfds.
type vmTemplate struct {
	key   string
	ram   *os.File
	state *os.File
	// layer is an image template's writable layer disk as the template
	// left it (read-only; each clone gets a copy), nil for a busybox one.
	layer *os.File
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
func (s *Substrate) templateKey(imgID string, shape machineShape, root *rootSpec) (string, error) {
	qsum, err := s.fileSum(s.cfg.QEMUPath)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "%s|%d|%d|%s|%s|%x", imgID, shape.MemoryMiB, shape.VCPUs, s.accel, machineFor(s.accel, s.tscKHz).appendExtra, qsum)
	if root != nil {
		fmt.Fprintf(h, "|root:%s|%d", root.disk.SHA256, root.layerSize)
	}
	return hex.EncodeToString(h.Sum(nil))[:32], nil
}

// templateFor returns the template for the image and shape, building it
// first if needed (concurrent callers wait for one build). It returns nil
// when no template can be had now (the caller boots cold); the reason is
// logged.
func (s *Substrate) templateFor(ctx context.Context, imgID, imgPath string, shape machineShape, agent string, root *rootSpec) *vmTemplate {
	key, err := s.templateKey(imgID, shape, root)
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
			t, err := s.buildTemplate(key, imgID, shape, agent, root)
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
func (s *Substrate) buildTemplate(key, imgID string, shape machineShape, agent string, root *rootSpec) (tmpl *vmTemplate, err error) {
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
	// Short: the agent socket's path must fit a sockaddr_un (108 bytes).
	dir := filepath.Join(s.cfg.StateDir, "tpl", key[:12])
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	spec := substrate.Spec{
		Route: identity.Route{SandboxID: "template", Generation: 1, ExecutionID: "template", WorkerID: "template",
			Substrate: identity.SubstrateMicroVM, ActivationID: "template"},
		Dir: dir, AgentPath: agent,
		Limits: substrate.Limits{MemoryBytes: size, CPUMillis: int64(shape.VCPUs) * 1000},
	}
	if root != nil {
		spec.Image, spec.Limits.DiskBytes = root.img, root.layerSize
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
		if err == nil && root != nil {
			// QEMU is gone: the disk is as the saved state expects it.
			tmpl.layer, err = os.Open(filepath.Join(dir, LayerDiskName))
		}
	}()
	if err := activateTemplate(ctx, inst, spec.Route); err != nil {
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
	if _, err := inst.saveState(ctx, state, false); err != nil {
		return nil, fmt.Errorf("template save: %w", err)
	}
	return &vmTemplate{key: key, ram: ram, state: state, took: time.Since(t0)}, nil
}

// activateTemplate activates the template's agent with the template's
// own identity and closes the session: the agent has then built its
// server, so a clone's activation only swaps the identity in (the
// template's identity never matches a sandbox's, and a clone serves
// nothing before spaced-host has activated it and checked the ACK).
func activateTemplate(ctx context.Context, inst *instance, r identity.Route) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", inst.socket)
	if err != nil {
		return err
	}
	act, err := json.Marshal(map[string]any{"identity": r, "default_user": "user"})
	if err != nil {
		conn.Close()
		return err
	}
	c, err := vmchan.NewClient(ctx, conn, vmchan.ClientConfig{
		Activation: act, BootTimeout: templateBootTimeout, ResendInterval: 500 * time.Millisecond,
		Logger: inst.s.cfg.Logger,
	})
	if err != nil {
		return fmt.Errorf("activate: %w; console tail: %s", err, inst.consoleTail(1024))
	}
	var got identity.Route
	err = json.Unmarshal(c.Ack(), &got)
	c.Close()
	if err != nil || got != r {
		return fmt.Errorf("activate: the agent ACKed %q, want the template's identity", c.Ack())
	}
	return nil
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
			if slot.t.layer != nil {
				slot.t.layer.Close()
			}
		}
		delete(s.templates, k)
	}
}
