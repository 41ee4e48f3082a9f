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
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/procid"
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
	b := &Bridge{cfg: cfg, label: cfg.Expected.ExecutionLabel()}
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
			if s == http.StateNew && cfg.ManagerPID > 0 {
				if cred, err := procid.PeerCred(c); err != nil || int(cred.Pid) != cfg.ManagerPID {
					cfg.Logger.Warn("bridge: rejecting connection from unexpected peer")
					c.Close()
				}
			}
		},
	}
	return b, nil
}

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

// record takes what later connections are compared with: the agent
// process, the path's inode and the listening socket bound at it.
func (b *Bridge) record() error {
	pid := b.cfg.GuestPID
	h, err := procid.Open(pid)
	if err != nil {
		return fmt.Errorf("bridge: guest process: %w", err)
	}
	b.guest = h
	var st unix.Stat_t
	if err := unix.Stat(b.cfg.GuestSocket, &st); err != nil {
		return fmt.Errorf("bridge: guest socket: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return fmt.Errorf("bridge: guest socket %s is not a socket", b.cfg.GuestSocket)
	}
	b.pathDev, b.pathIno = uint64(st.Dev), st.Ino
	if b.diagGuest, err = procid.NewDiagInNetns(pid); err != nil {
		return fmt.Errorf("bridge: sock_diag: %w", err)
	}
	if same, err := procid.SameNetns(pid); err != nil {
		return fmt.Errorf("bridge: %w", err)
	} else if same {
		b.diagSelf = b.diagGuest
	} else if b.diagSelf, err = procid.NewDiag(); err != nil {
		return fmt.Errorf("bridge: sock_diag: %w", err)
	}
	socks, err := b.diagGuest.Dump(1<<procid.StateListen, procid.UDiagShowVFS)
	if err != nil {
		return fmt.Errorf("bridge: sock_diag: %w", err)
	}
	for _, s := range socks {
		if b.boundAtPath(s) {
			if b.listener != 0 {
				return verr(CheckListener, "%w: two listeners at %s", ErrListener, b.cfg.GuestSocket)
			}
			b.listener = s.Ino
		}
	}
	if b.listener == 0 {
		return verr(CheckListener, "%w: no listener bound at %s in the agent's network namespace", ErrListener, b.cfg.GuestSocket)
	}
	fd, err := procid.FindSocketFD(pid, b.listener, -1)
	if err != nil {
		return verr(CheckListener, "%w: %v", ErrListener, err)
	}
	b.listenerFD.Store(int32(fd))
	// The fds read above were the recorded process's if it is alive now.
	if err := h.Check(); err != nil {
		return verr(CheckPeerProcess, "%w", err)
	}
	return nil
}

func (b *Bridge) boundAtPath(s procid.UnixSocket) bool {
	return s.HasVFS && s.VFSIno == uint32(b.pathIno) && s.VFSDev == procid.KernelDev(b.pathDev)
}

// verifyTransport runs the transport checks (1-4) on a new guest connection.
func (b *Bridge) verifyTransport(c net.Conn) error {
	pid := b.cfg.GuestPID
	fd, err := procid.FindSocketFD(pid, b.listener, int(b.listenerFD.Load()))
	if err != nil {
		return verr(CheckListener, "%w: %v", ErrListener, err)
	}
	b.listenerFD.Store(int32(fd))
	if !b.cfg.noSockDiag {
		if err := b.verifyPeerSocket(c); err != nil {
			return err
		}
	}
	if err := b.guest.VerifyPeer(c); err != nil {
		return &VerifyError{Check: CheckPeerProcess, Err: err}
	}
	return nil
}

// verifyPeerSocket asks sock_diag whether c went through the recorded
// listener: either our socket waits in its accept queue, or the agent has
// accepted it and our peer is bound at the recorded path inode and names
// our socket as its peer.
func (b *Bridge) verifyPeerSocket(c net.Conn) error {
	own, err := procid.ConnInode(c)
	if err != nil {
		return verr(CheckPeerSocket, "%w", err)
	}
	for attempt := 0; ; attempt++ {
		ls, err := b.diagGuest.Lookup(b.listener, procid.UDiagShowVFS|procid.UDiagShowIcons)
		if err != nil {
			return verr(CheckListener, "%w: listener %d: %v", ErrListener, b.listener, err)
		}
		if ls.State != procid.StateListen || !b.boundAtPath(ls) {
			return verr(CheckListener, "%w: socket %d no longer listens at the recorded path inode", ErrListener, b.listener)
		}
		if slices.Contains(ls.Icons, own) {
			return nil
		}
		me, err := b.diagSelf.Lookup(own, procid.UDiagShowPeer)
		if err != nil || !me.HasPeer {
			return verr(CheckPeerSocket, "%w: own socket %d: %v", ErrListener, own, err)
		}
		if me.Peer != 0 {
			// The kernel creates the server side of a Unix connection in
			// the connecting socket's network namespace (ours), not the
			// listener's; look there first.
			p, err := b.diagSelf.Lookup(me.Peer, procid.UDiagShowVFS|procid.UDiagShowPeer)
			if err != nil {
				p, err = b.diagGuest.Lookup(me.Peer, procid.UDiagShowVFS|procid.UDiagShowPeer)
			}
			if err != nil && attempt < 50 {
				// Between dequeue and graft by accept(2): not yet findable.
				time.Sleep(100 * time.Microsecond)
				continue
			}
			if err != nil {
				return verr(CheckPeerSocket, "%w: peer socket %d not found: %v", ErrListener, me.Peer, err)
			}
			if !b.boundAtPath(p) || p.Peer != own {
				return verr(CheckPeerSocket, "%w: peer socket %d is bound at %d:%d, not at the recorded path inode", ErrListener, me.Peer, p.VFSDev, p.VFSIno)
			}
			return nil
		}
		// Dequeued but not yet given an inode by accept(2): a moment.
		if attempt == 50 {
			return verr(CheckPeerSocket, "%w: connection neither queued nor accepted", ErrListener)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// Shutdown stops accepting and waits for in-flight requests until ctx ends.
func (b *Bridge) Shutdown(ctx context.Context) error { return b.srv.Shutdown(ctx) }

// checkPath is the path-inode check.
func (b *Bridge) checkPath() error {
	var st unix.Stat_t
	if err := unix.Stat(b.cfg.GuestSocket, &st); err != nil {
		return verr(CheckPathInode, "%w: %v", ErrSocketPath, err)
	}
	if uint64(st.Dev) != b.pathDev || st.Ino != b.pathIno {
		return verr(CheckPathInode, "%w: %s is inode %d:%d, recorded %d:%d",
			ErrSocketPath, b.cfg.GuestSocket, st.Dev, st.Ino, b.pathDev, b.pathIno)
	}
	return nil
}

// dialVerified dials the guest socket and runs the transport checks on
// the new connection.
func (b *Bridge) dialVerified(ctx context.Context) (net.Conn, error) {
	if err := b.checkPath(); err != nil {
		return nil, err
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", b.cfg.GuestSocket)
	if err != nil {
		return nil, fmt.Errorf("bridge: dial guest: %w", err)
	}
	if err := b.verifyTransport(c); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

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

var hopHeaders = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

func (b *Bridge) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	gc, _ := r.Context().Value(connKey{}).(*guestConn)
	if gc == nil {
		http.Error(w, "no connection state", http.StatusInternalServerError)
		return
	}
	// The guest may answer (and the stream's headers be flushed) before
	// the caller's body is fully sent; without full duplex the server
	// would close the unread body and cut the stream.
	_ = http.NewResponseController(w).EnableFullDuplex()
	// In full duplex the handler must close an unread body itself before
	// returning, or the server's next read panics (golang/go#68560).
	defer r.Body.Close()
	gc.mu.Lock()
	defer gc.mu.Unlock()
	if gc.broken != nil {
		b.fail(w, gc.broken)
		return
	}
	if gc.conn == nil {
		ctx, cancel := context.WithTimeout(r.Context(), b.cfg.DialTimeout)
		c, err := b.dialGuest(ctx)
		cancel()
		if err != nil {
			gc.broken = err
			b.cfg.Logger.Warn("bridge: guest connection refused", "sandbox", b.cfg.Expected.SandboxID, "err", err)
			b.fail(w, err)
			return
		}
		gc.conn, gc.br = c.conn, c.br
	}
	if err := b.forward(w, r, gc); err != nil {
		gc.broken = err
		gc.conn.Close()
		if b.vm != nil && errors.Is(err, errGuestBodyCut) {
			// The response's headers are out: abort the manager's
			// connection so the cut stream cannot look complete.
			panic(http.ErrAbortHandler)
		}
	}
}

// errGuestBodyCut: the guest's response body failed midway.
var errGuestBodyCut = errors.New("guest response cut")

func (b *Bridge) fail(w http.ResponseWriter, err error) {
	w.Header().Set("Connection", "close")
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusBadGateway)
	json.NewEncoder(w).Encode(spacev1.Error{Code: http.StatusBadGateway, Message: "sandbox bridge: " + err.Error(), Reason: "bridge"})
}

// forward sends r over the dedicated guest connection and streams the
// response back, flushing as bytes arrive. An error means the guest
// connection can no longer be trusted to be in sync and must be dropped.
func (b *Bridge) forward(w http.ResponseWriter, r *http.Request, gc *guestConn) error {
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.URL.Scheme, out.URL.Host = "http", "guest"
	out.Close = false
	for _, h := range hopHeaders {
		out.Header.Del(h)
	}
	out.Header.Del(spacev1.HeaderCapability)
	if r.ContentLength == 0 {
		out.Body = nil
	}
	writeErr := make(chan error, 1)
	go func() { writeErr <- out.Write(gc.conn) }()
	stop := context.AfterFunc(r.Context(), func() { gc.conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	resp, err := http.ReadResponse(gc.br, out)
	if err != nil {
		// The writer goroutine may still be blocked reading the caller's
		// body; it ends when the server closes that body after this
		// handler returns.
		gc.conn.Close()
		b.fail(w, fmt.Errorf("guest connection dropped: %w", err))
		return err
	}
	defer resp.Body.Close()
	for _, h := range hopHeaders {
		resp.Header.Del(h)
	}
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.Header().Set(spacev1.HeaderExecution, b.label)
	if resp.Close {
		// The guest ends this connection: end the manager's too, so the
		// next request arrives on a new connection that is checked anew.
		w.Header().Set("Connection", "close")
	}
	w.WriteHeader(resp.StatusCode)
	fl, _ := w.(http.Flusher)
	if fl != nil {
		fl.Flush() // a stream's headers must not wait for its first event
	}
	buf := make([]byte, 32*1024)
	var copyErr error
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				copyErr = werr
				break
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			copyErr = rerr
			if b.vm != nil {
				copyErr = fmt.Errorf("%w: %w", errGuestBodyCut, rerr)
			}
			break
		}
	}
	if werr := <-writeErr; werr != nil && copyErr == nil {
		copyErr = werr
	}
	if copyErr != nil {
		return copyErr
	}
	if resp.Close {
		return errors.New("guest closed the connection")
	}
	return nil
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
