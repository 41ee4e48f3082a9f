package guest

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/spacesbx/space/internal/vmchan"
)

// Defaults of VM mode.
const (
	DefaultVirtioPortsDir = "/sys/class/virtio-ports"
	DefaultDevDir         = "/dev"
	// DefaultPortWait bounds the wait for the port device to appear.
	DefaultPortWait = 30 * time.Second
)

// VMConfig configures VM mode: the agent inside a microVM, reached over
// one virtio-serial port multiplexed with vmchan, configured by the
// host's ACTIVATE message instead of SPACE_GUEST_CONFIG.
type VMConfig struct {
	// Port is the virtio-serial port name (e.g. "space.0"), resolved to
	// /dev/vportNpM through /sys/class/virtio-ports/*/name.
	Port string
	// Base supplies what the activation cannot: Logger (and tests may
	// set paths and limits; the activation's non-zero fields win).
	// DetachedOutputBytes defaults to DefaultDetachedOutputBytes.
	Base Config
	// PortsDir and DevDir default to /sys/class/virtio-ports and /dev.
	PortsDir, DevDir string
	// PortWait bounds the wait for the port to appear. Default 30s (also
	// for a negative value).
	PortWait time.Duration
}

// withDefaults returns a copy of vc with unset fields replaced by the
// documented defaults.
func (vc VMConfig) withDefaults() VMConfig {
	if vc.PortsDir == "" {
		vc.PortsDir = DefaultVirtioPortsDir
	}
	if vc.DevDir == "" {
		vc.DevDir = DefaultDevDir
	}
	if vc.PortWait <= 0 {
		vc.PortWait = DefaultPortWait
	}
	return vc
}

// Validate reports whether vc is usable; it only checks.
func (vc VMConfig) Validate() error {
	if vc.Port == "" {
		return errors.New("guest: vm mode: port name is required")
	}
	return nil
}

// ResolvePort returns the device path of the virtio-serial port named
// name, listed in portsDir (one directory per port with a "name" file).
func ResolvePort(portsDir, devDir, name string) (string, error) {
	ents, err := os.ReadDir(portsDir)
	if err != nil {
		return "", fmt.Errorf("virtio ports: %w", err)
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(portsDir, e.Name(), "name"))
		if err == nil && strings.TrimSpace(string(b)) == name {
			return filepath.Join(devDir, e.Name()), nil
		}
	}
	return "", fmt.Errorf("virtio port %q: %w", name, os.ErrNotExist)
}

// RunVM runs the agent in VM mode until ctx ends: it waits for the port,
// opens it and serves every session the host starts on it. The first
// activation creates the server, later ones (after a restore elsewhere)
// replace its identity, env and default user (Server.Reactivate) before
// the ACK; processes keep running across sessions.
func RunVM(ctx context.Context, vc VMConfig) error {
	vc = vc.withDefaults()
	if err := vc.Validate(); err != nil {
		return err
	}
	log := vc.Base.withDefaults().Logger
	var dev string
	deadline := time.Now().Add(vc.PortWait)
	for {
		var err error
		if dev, err = ResolvePort(vc.PortsDir, vc.DevDir, vc.Port); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("guest: vm mode: %w", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(100 * time.Millisecond):
		}
	}
	// O_NONBLOCK: the runtime poller then serves the port, so a write that
	// blocks while no host is connected can be cut by a deadline.
	f, err := os.OpenFile(dev, os.O_RDWR|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("guest: vm mode: open %s: %w", dev, err)
	}
	log.Info("vm mode: serving", "port", vc.Port, "device", dev)
	// The clock stops while the VM is paused or saved; keep it on the RTC.
	cctx, cancel := context.WithCancel(ctx)
	clockDone := make(chan struct{})
	go func() { defer close(clockDone); runClockSync(cctx, DefaultRTCPath, log) }()
	err = serveVM(ctx, f, vc.Base, func(cfg Config, entropy []byte) error {
		id := cfg.Identity
		// A restored or cloned VM resumes the snapshot's random state and
		// clock: reseed from the host's bytes, step the clock to the RTC
		// now rather than at the next tick.
		if len(entropy) > 0 {
			if err := reseedKernelRNG(entropy); err != nil {
				return err
			}
		}
		// A clone of a template booted with the template's hostname.
		if h := vmHostname(id.Sandbox); h != "" {
			if err := syscall.Sethostname([]byte(h)); err != nil {
				log.Warn("vm mode: sethostname", "err", err)
			} else {
				_ = os.WriteFile("/etc/hostname", []byte(h+"\n"), 0o644)
			}
		}
		if d, err := syncClock(DefaultRTCPath, time.Now, setSystemClock); err != nil {
			log.Warn("vm mode: clock sync at activation", "err", err)
		} else if d != 0 {
			log.Info("vm mode: clock stepped to the RTC at activation", "by", d)
		}
		// The NIC before the ACK: once the host has it, the guest's way
		// out is up. A failure leaves the sandbox without one (see
		// network.go), not without an agent.
		if n := cfg.Network; n != nil && n.Address != "" {
			if err := configureLink(n); err != nil {
				log.Error("vm mode: network not configured; the sandbox has no way out", "err", err)
			} else {
				log.Info("vm mode: network configured", "address", n.Address, "gateway", n.Gateway, "mac", n.MAC)
			}
		}
		return nil
	})
	cancel()
	<-clockDone
	return err
}

// ServeVM serves VM mode on an open port (which it owns) until ctx ends,
// then closes the server and the port.
func ServeVM(ctx context.Context, port io.ReadWriteCloser, base Config) error {
	return serveVM(ctx, port, base, nil)
}

// serveVM is ServeVM with a hook run on every activation, before the
// agent takes the new identity, with the activation's validated
// configuration and host entropy; an error refuses the activation.
func serveVM(ctx context.Context, port io.ReadWriteCloser, base Config, onActivate func(cfg Config, entropy []byte) error) error {
	if base.DetachedOutputBytes == 0 {
		base.DetachedOutputBytes = DefaultDetachedOutputBytes
	}
	a := &vmAgent{base: base, log: base.withDefaults().Logger, onActivate: onActivate}
	a.l = vmchan.NewListener(port, vmchan.ListenerConfig{Activate: a.activate, Logger: a.log})
	a.l.Start()
	<-ctx.Done()
	a.mu.Lock()
	a.closed = true
	srv := a.srv
	a.mu.Unlock()
	var serr error
	if srv != nil {
		serr = srv.Close() // kills processes, shuts the HTTP server down
	}
	_ = a.l.Close() // ends the session, the reader and the writer
	a.wg.Wait()
	return errors.Join(serr, a.serveErr)
}

// vmAgent holds the server of VM mode, created by the first activation.
type vmAgent struct {
	base       Config
	log        *slog.Logger
	l          *vmchan.Listener
	onActivate func(cfg Config, entropy []byte) error

	mu       sync.Mutex
	srv      *Server
	closed   bool
	wg       sync.WaitGroup // Serve
	serveErr error
}

// activate applies an ACTIVATE payload (the JSON of Config) and returns
// the identity the agent now holds, for the ACK.
func (a *vmAgent) activate(sid vmchan.SessionID, payload []byte) ([]byte, error) {
	cfg := a.base
	if err := json.Unmarshal(payload, &cfg); err != nil {
		return nil, fmt.Errorf("activation: %w", err)
	}
	cfg.Logger, cfg.UserCgroupProcs = a.base.Logger, nil // the VM is the limit
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("activation: %w", err)
	}
	if a.onActivate != nil {
		var extra struct {
			Entropy []byte `json:"entropy"`
		}
		if err := json.Unmarshal(payload, &extra); err != nil {
			return nil, fmt.Errorf("activation: %w", err)
		}
		if err := a.onActivate(cfg, extra.Entropy); err != nil {
			return nil, fmt.Errorf("activation: %w", err)
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil, errors.New("agent is shutting down")
	}
	if a.srv == nil {
		srv, err := New(cfg)
		if err != nil {
			return nil, err
		}
		a.srv = srv
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			if err := srv.Serve(a.l); err != nil && !errors.Is(err, net.ErrClosed) {
				a.serveErr = err
			}
		}()
		a.log.Info("vm mode: activated", "session", sid.String(), "sandbox", cfg.Identity.Sandbox,
			"execution", cfg.Identity.Execution, "activation", cfg.Identity.Activation)
	} else if err := a.srv.Reactivate(cfg); err != nil {
		return nil, err
	}
	return json.Marshal(a.srv.Identity())
}

// Linux random ioctls (include/uapi/linux/random.h).
const (
	ioctlRNDADDENTROPY  = 0x40085203 // _IOW('R', 0x03, int[2])
	ioctlRNDRESEEDCRNG  = 0x5207     // _IO('R', 0x07)
	maxActivationRandom = 512
)

// reseedKernelRNG mixes b into the kernel's entropy pool, credited, and
// makes the CRNG reseed from it at once, so what the guest draws after an
// activation differs from every other clone of the same snapshot.
func reseedKernelRNG(b []byte) error {
	if len(b) > maxActivationRandom {
		b = b[:maxActivationRandom]
	}
	f, err := os.OpenFile("/dev/random", os.O_WRONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("reseed: %w", err)
	}
	defer f.Close()
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	info := make([]byte, 8+len(b))
	binary.NativeEndian.PutUint32(info[0:], uint32(8*len(b)))
	binary.NativeEndian.PutUint32(info[4:], uint32(len(b)))
	copy(info[8:], b)
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), ioctlRNDADDENTROPY, uintptr(unsafe.Pointer(&info[0]))); errno != 0 {
		return fmt.Errorf("reseed: RNDADDENTROPY: %w", errno)
	}
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), ioctlRNDRESEEDCRNG, 0); errno != 0 {
		return fmt.Errorf("reseed: RNDRESEEDCRNG: %w", errno)
	}
	return nil
}

// vmHostname is the hostname for a sandbox id: lower case letters, digits
// and dashes, at most 63 characters ("" when none remain).
func vmHostname(id string) string {
	var b strings.Builder
	for _, c := range strings.ToLower(id) {
		if (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' {
			b.WriteRune(c)
		}
		if b.Len() == 63 {
			break
		}
	}
	return b.String()
}
