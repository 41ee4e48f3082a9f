// Package bridge is spaced-host, the per-activation host bridge between
// sbx-manager and the agent inside a sandbox.
//
// At start the bridge records the agent process (pid, start time,
// executable device+inode and SHA-256, a pidfd), the inode of the guest
// socket's path, and the listening socket bound there (found with
// sock_diag by the path's inode, and required to be among the agent's file
// descriptors). Every connection from sbx-manager then gets its own
// dedicated guest connection, admitted only after these checks, in order:
//
//  1. path-inode: the socket path still has the recorded inode (an
//     unlinked and re-bound path has another);
//  2. listener: the recorded listening socket is still among the agent's
//     fds (/proc/<pid>/fd), so it was not handed to another process;
//  3. peer-socket: sock_diag (UNIX_DIAG) shows that this connection went
//     through that listener: our socket waits in its accept queue, or our
//     peer is an accepted socket bound at the recorded path inode that
//     names our socket back;
//  4. peer-process: SO_PEERCRED and SO_PEERPIDFD name the recorded agent,
//     still alive (pidfd) with the same start time and executable;
//  5. guest-identity: the agent reports, on that very connection, the
//     execution identity this bridge was started for.
//
// A failed check closes the connection with a *VerifyError naming it. A
// dropped guest connection fails the operations on it and the manager
// connection with it; the bridge never reconnects transparently.
//
// VM channel (Config.Channel = ChannelVM, e.g. QEMU microvm): the recorded
// process is the VMM and the socket its virtio-serial chardev, which
// serves one client. The bridge makes ONE connection, runs checks 1-4 on
// it, then the vmchan handshake (HELLO, ACTIVATE with Config.Activation,
// ACK carrying the identity the guest now holds, compared with the
// expected one), resending HELLO until the guest has booted (bounded by
// Config.BootTimeout). Each manager connection then gets its own stream:
// checks 1-4 run again on the channel's connection and check 5 on the
// stream. If the channel's connection drops, every stream fails and Serve
// returns ErrChannelLost (spaced-host exits 1); sbx-manager must start a
// new spaced-host, which verifies everything again.
package bridge

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/procid"
	"github.com/spacesbx/space/internal/telemetry"
	"github.com/spacesbx/space/internal/vmchan"
)

// IdentityPath is where the agent reports the identity it was activated with.
const IdentityPath = "/_space/identity"

// Errors of the guest connection checks; a *VerifyError wraps one of them
// (or procid.ErrMismatch for the peer-process check).
var (
	// ErrGuestIdentity means the agent reported another execution.
	ErrGuestIdentity = errors.New("guest reported another identity")
	// ErrSocketPath means the guest socket path no longer has the inode
	// it had when the bridge started (unlinked and re-bound).
	ErrSocketPath = errors.New("guest socket path replaced")
	// ErrListener means the listening socket is no longer the agent's, or
	// the connection did not go through it.
	ErrListener = errors.New("guest listener is not the agent's")
)

// Names of the checks a guest connection passes, in order.
const (
	CheckPathInode     = "path-inode"
	CheckListener      = "listener"
	CheckPeerSocket    = "peer-socket"
	CheckPeerProcess   = "peer-process"
	CheckGuestIdentity = "guest-identity"
)

// VerifyError is a failed check of a guest connection.
type VerifyError struct {
	Check string
	Err   error
}

func (e *VerifyError) Error() string { return "bridge: " + e.Check + " check failed: " + e.Err.Error() }
func (e *VerifyError) Unwrap() error { return e.Err }

func verr(check string, format string, a ...any) error {
	return &VerifyError{Check: check, Err: fmt.Errorf(format, a...)}
}

// Config configures a bridge.
type Config struct {
	// GuestSocket is the host path of the agent's Unix listening socket.
	GuestSocket string
	// GuestPID is the host pid of the process that owns the listener.
	GuestPID int
	// Expected is the execution identity this activation must serve.
	Expected identity.Route
	// ManagerPID, when non-zero, is the only process allowed to connect.
	ManagerPID int
	// ManagerFile, when set, names the manager process as sbx-manager
	// wrote it ("<pid> <start time>", WriteManagerFile). A bridge outlives
	// the manager that launched it (a worker restart or upgrade leaves
	// sandboxes running), so a connection from another pid than the
	// current manager's re-reads the file, and the process it names (the
	// same start time, so not a reused pid) becomes the manager.
	ManagerFile string
	// DialTimeout bounds connecting to and verifying the guest. Default 5s.
	DialTimeout time.Duration
	Logger      *slog.Logger

	// Channel is how the guest is reached: ChannelUnix ("" too) dials
	// the guest socket once per manager connection (ns substrate);
	// ChannelVM makes ONE connection to the socket (a VMM's chardev,
	// e.g. QEMU's virtio-serial backend, which serves one client),
	// verifies it like a guest connection, runs the vmchan handshake and
	// gives each manager connection its own stream on it.
	Channel string
	// Activation is the ACTIVATE payload of ChannelVM: the JSON of the
	// guest's configuration (guest.Config). Its "identity" must equal
	// Expected.
	Activation []byte
	// BootTimeout bounds the wait for the guest's ACK in ChannelVM (the
	// VMM accepts at once, the agent answers once the VM booted).
	// Default 60s.
	BootTimeout time.Duration

	// noSockDiag skips the sock_diag peer-socket check (benchmarks only).
	noSockDiag bool
}

// withDefaults returns a copy of c with unset fields replaced by the
// documented defaults (a non-positive timeout is unset).
func (c Config) withDefaults() Config {
	if c.DialTimeout <= 0 {
		c.DialTimeout = 5 * time.Second
	}
	if c.Channel == "" {
		c.Channel = ChannelUnix
	}
	if c.BootTimeout <= 0 {
		c.BootTimeout = 60 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate checks the configuration; it fills nothing (New applies the
// defaults first).
func (c Config) Validate() error {
	if c.GuestSocket == "" || c.GuestPID <= 0 {
		return errors.New("bridge: guest socket and pid are required")
	}
	if err := c.Expected.Validate(); err != nil {
		return fmt.Errorf("bridge: expected identity: %w", err)
	}
	switch c.Channel {
	case "", ChannelUnix:
		if len(c.Activation) > 0 {
			return errors.New("bridge: an activation is only sent over a vm channel")
		}
	case ChannelVM:
		var act struct {
			Identity identity.Route `json:"identity"`
		}
		if err := json.Unmarshal(c.Activation, &act); err != nil {
			return fmt.Errorf("bridge: activation: %w", err)
		}
		if d := identity.Diff(act.Identity, c.Expected); len(d) > 0 {
			return fmt.Errorf("bridge: activation identity differs from the expected one in %s", strings.Join(d, ","))
		}
	default:
		return fmt.Errorf("bridge: unknown channel %q (want %s or %s)", c.Channel, ChannelUnix, ChannelVM)
	}
	return nil
}

// Channels (Config.Channel).
const (
	ChannelUnix = "unix"
	ChannelVM   = "vmchan"
)

// ErrChannelLost means the single connection of a vm channel failed: every
// stream on it failed and the bridge stops (no transparent reconnect).
var ErrChannelLost = errors.New("bridge: vm channel lost")

// Bridge forwards HTTP between sbx-manager and one activation's agent.
type Bridge struct {
	cfg   Config
	guest *procid.Handle
	srv   *http.Server
	label string
	// spanAttrs name this execution on every span (from Expected: the
	// bridge's own knowledge, never a request's).
	spanAttrs []attribute.KeyValue

	// The guest socket path's inode and the listener bound there, as
	// recorded at start.
	pathDev, pathIno uint64
	listener         uint32
	listenerFD       atomic.Int32 // where the listener was last seen among the agent's fds
	// diagGuest answers in the agent's network namespace, diagSelf in
	// ours (the same socket when they are one namespace).
	diagGuest, diagSelf *procid.Diag

	// vm is the vm channel (ChannelVM) and chanConn its one connection.
	vm       *vmchan.Client
	chanConn net.Conn
	closing  atomic.Bool

	closeOnce sync.Once
	// manager is the one process allowed to connect (nil: any).
	manager atomic.Pointer[managerProc]
	// verified counts guest connections that passed every check.
	verified atomic.Uint64
}

type connKey struct{}

// guestConn is the dedicated guest connection of one manager connection.
type guestConn struct {
	mu     sync.Mutex
	conn   net.Conn
	br     *bufio.Reader
	broken error
}

// New records the agent process identity and verifies one guest
// connection, so a bridge that starts is known to reach the right agent.
func New(cfg Config) (*Bridge, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	b := &Bridge{cfg: cfg, label: cfg.Expected.ExecutionLabel(), spanAttrs: []attribute.KeyValue{
		telemetry.AttrSandbox.String(cfg.Expected.SandboxID), telemetry.AttrGeneration.Int64(int64(cfg.Expected.Generation)),
		telemetry.AttrWorker.String(cfg.Expected.WorkerID)}}
	if cfg.ManagerPID > 0 {
		// Pid and start time: a manager that dies must not be succeeded
		// by whatever process gets its pid next.
		st, err := procid.StartTime(cfg.ManagerPID)
		if err != nil {
			return nil, fmt.Errorf("bridge: manager %d: %w", cfg.ManagerPID, err)
		}
		b.manager.Store(&managerProc{pid: cfg.ManagerPID, start: st})
	}
	if err := b.record(); err != nil {
		b.release()
		return nil, err
	}
	if cfg.Channel == ChannelVM {
		if err := b.openChannel(); err != nil {
			b.release()
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.DialTimeout)
	defer cancel()
	gc, err := b.dialGuest(ctx)
	if err != nil {
		b.release()
		return nil, err
	}
	gc.conn.Close()
	b.srv = &http.Server{
		Handler:           b,
		ReadHeaderTimeout: 30 * time.Second,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, connKey{}, &guestConn{})
		},
		ConnState: func(c net.Conn, s http.ConnState) {
			if s == http.StateNew && !b.fromManager(c) {
				cfg.Logger.Warn("bridge: rejecting connection from unexpected peer")
				c.Close()
			}
		},
	}
	return b, nil
}

// managerProc names the manager process: pid and start time.
type managerProc struct {
	pid   int
	start uint64
}

// fromManager reports whether c's peer is the manager: the current one
// (same pid and start time, checked on every connection), or the one
// ManagerFile names now (a restarted manager), which then becomes the
// current one.
func (b *Bridge) fromManager(c net.Conn) bool {
	cur := b.manager.Load()
	if cur == nil && b.cfg.ManagerPID == 0 {
		return true
	}
	cred, err := procid.PeerCred(c)
	if err != nil {
		return false
	}
	pid := int(cred.Pid)
	if cur != nil && pid == cur.pid {
		if st, err := procid.StartTime(pid); err == nil && st == cur.start {
			return true
		}
	}
	if b.cfg.ManagerFile == "" {
		return false
	}
	fpid, err := ReadManagerFile(b.cfg.ManagerFile)
	if err != nil || fpid != pid {
		return false
	}
	st, err := procid.StartTime(pid)
	if err != nil {
		return false
	}
	b.manager.Store(&managerProc{pid: pid, start: st})
	b.cfg.Logger.Info("bridge: a new manager took over", "manager_pid", pid)
	return true
}

// GuestExited returns a channel closed when the recorded agent (or VMM)
// process has exited: a bridge outlives its manager, but never its
// sandbox.
func (b *Bridge) GuestExited() (<-chan struct{}, error) { return b.guest.Exited() }

// Serve serves manager connections on l until Close. With a vm channel
// it also ends, with ErrChannelLost, when the channel's connection fails.
func (b *Bridge) Serve(l net.Listener) error {
	if b.vm == nil {
		err := b.srv.Serve(l)
		if errors.Is(err, http.ErrServerClosed) {
			return nil
		}
		return err
	}
	served := make(chan error, 1)
	go func() { served <- b.srv.Serve(l) }()
	select {
	case err := <-served:
		if errors.Is(err, http.ErrServerClosed) {
			return nil
		}
		return err
	case <-b.vm.Done():
		if b.closing.Load() {
			<-served
			return nil
		}
		cause := b.vm.Err()
		b.cfg.Logger.Error("bridge: vm channel lost: failing every stream and stopping", "err", cause)
		b.srv.Close()
		<-served
		return fmt.Errorf("%w: %w", ErrChannelLost, cause)
	}
}

// Close stops the bridge; open streams are cut.
func (b *Bridge) Close() error {
	b.closing.Store(true)
	var err error
	if b.srv != nil {
		err = b.srv.Close()
	}
	b.release()
	return err
}

// release frees the pidfd and sock_diag sockets; later checks fail.
func (b *Bridge) release() {
	b.closeOnce.Do(func() {
		if b.vm != nil {
			b.vm.Close()
		}
		if b.guest != nil {
			b.guest.Close()
		}
		if b.diagSelf != nil && b.diagSelf != b.diagGuest {
			b.diagSelf.Close()
		}
		if b.diagGuest != nil {
			b.diagGuest.Close()
		}
	})
}

// Shutdown stops accepting and waits for in-flight requests until ctx ends.
func (b *Bridge) Shutdown(ctx context.Context) error { return b.srv.Shutdown(ctx) }

// openChannel (ChannelVM) makes the one connection to the VMM's socket,
// verifies it like a guest connection (the VMM is the recorded process),
// runs the vmchan handshake within BootTimeout and compares the identity
// the guest ACKs with the expected one.
func (b *Bridge) openChannel() error {
	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.DialTimeout)
	c, err := b.dialVerified(ctx)
	cancel()
	if err != nil {
		return err
	}
	bctx, cancel := context.WithTimeout(context.Background(), b.cfg.BootTimeout)
	defer cancel()
	act, err := withEntropy(b.cfg.Activation)
	if err != nil {
		c.Close()
		return fmt.Errorf("bridge: activation: %w", err)
	}
	vm, err := vmchan.NewClient(bctx, c, vmchan.ClientConfig{
		Activation: act, BootTimeout: b.cfg.BootTimeout, Logger: b.cfg.Logger,
	})
	if err != nil {
		return fmt.Errorf("bridge: vm channel: %w", err)
	}
	var got identity.Route
	if err := json.Unmarshal(vm.Ack(), &got); err != nil {
		vm.Close()
		return verr(CheckGuestIdentity, "%w: ACK: %v", ErrGuestIdentity, err)
	}
	if d := identity.Diff(got, b.cfg.Expected); len(d) > 0 {
		vm.Close()
		return verr(CheckGuestIdentity, "%w: ACK differs in %s", ErrGuestIdentity, strings.Join(d, ","))
	}
	b.vm, b.chanConn = vm, c
	b.cfg.Logger.Info("bridge: vm channel established", "session", vm.Session().String())
	return nil
}

// openGuest returns a new transport-verified guest connection: a new
// Unix connection (ChannelUnix), or a new stream on the vm channel after
// the transport checks were run again on the channel's connection.
func (b *Bridge) openGuest(ctx context.Context) (net.Conn, error) {
	if b.vm == nil {
		return b.dialVerified(ctx)
	}
	if err := b.vm.Err(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrChannelLost, err)
	}
	if err := b.checkPath(); err != nil {
		return nil, err
	}
	if err := b.verifyTransport(b.chanConn); err != nil {
		return nil, err
	}
	c, err := b.vm.Open(ctx)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrChannelLost, err)
	}
	return c, nil
}

// dialGuest opens and verifies a new guest connection: transport checks
// first, then the identity the agent reports on that very connection.
func (b *Bridge) dialGuest(ctx context.Context) (*guestConn, error) {
	c, err := b.openGuest(ctx)
	if err != nil {
		return nil, err
	}
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	gc := &guestConn{conn: c, br: bufio.NewReader(c)}
	req, _ := http.NewRequest(http.MethodGet, "http://guest"+IdentityPath, nil)
	if err := req.Write(c); err != nil {
		c.Close()
		return nil, fmt.Errorf("bridge: identity request: %w", err)
	}
	resp, err := http.ReadResponse(gc.br, req)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("bridge: identity response: %w", err)
	}
	var got identity.Route
	err = json.NewDecoder(io.LimitReader(resp.Body, 4096)).Decode(&got)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		c.Close()
		return nil, verr(CheckGuestIdentity, "%w: status %d: %v", ErrGuestIdentity, resp.StatusCode, err)
	}
	if d := identity.Diff(got, b.cfg.Expected); len(d) > 0 {
		c.Close()
		return nil, verr(CheckGuestIdentity, "%w: differs in %s", ErrGuestIdentity, strings.Join(d, ","))
	}
	c.SetDeadline(time.Time{})
	b.verified.Add(1)
	return gc, nil
}

// withEntropy returns the activation payload (a JSON object) with fresh
// random bytes from the host under "entropy". A guest restored from a
// snapshot, or cloned from a template's, resumes with the random state the
// snapshot holds, so two clones would draw the same numbers; the guest
// mixes these bytes into its kernel's pool and reseeds before it ACKs.
func withEntropy(payload []byte) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(payload, &m); err != nil {
		return nil, err
	}
	e := make([]byte, 64)
	if _, err := rand.Read(e); err != nil {
		return nil, err
	}
	raw, err := json.Marshal(e)
	if err != nil {
		return nil, err
	}
	m["entropy"] = raw
	return json.Marshal(m)
}
