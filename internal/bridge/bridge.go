// Package bridge is spaced-host, the per-activation host bridge between
// sbx-manager and the agent inside a sandbox.
//
// Every connection from sbx-manager gets its own dedicated guest
// connection, and that guest connection is admitted only after three checks:
// the listener's peer credentials name the recorded agent process, that
// process still has the recorded start time and executable, and the agent
// reports the execution identity this bridge was started for. A dropped
// guest connection fails the operations on it and the manager connection
// with it; the bridge never reconnects transparently.
package bridge

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/procid"
)

// IdentityPath is where the agent reports the identity it was activated with.
const IdentityPath = "/_space/identity"

// ErrGuestIdentity means the agent reported another execution.
var ErrGuestIdentity = errors.New("guest reported another identity")

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
}

// Validate checks the configuration and fills defaults.
func (c *Config) Validate() error {
	if c.GuestSocket == "" || c.GuestPID <= 0 {
		return errors.New("bridge: guest socket and pid are required")
	}
	if err := c.Expected.Validate(); err != nil {
		return fmt.Errorf("bridge: expected identity: %w", err)
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout = 5 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Bridge forwards HTTP between sbx-manager and one activation's agent.
type Bridge struct {
	cfg   Config
	guest procid.Process
	srv   *http.Server
	label string
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
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	p, err := procid.Read(cfg.GuestPID)
	if err != nil {
		return nil, fmt.Errorf("bridge: guest process: %w", err)
	}
	b := &Bridge{cfg: cfg, guest: p, label: cfg.Expected.ExecutionLabel()}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.DialTimeout)
	defer cancel()
	gc, err := b.dialGuest(ctx)
	if err != nil {
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

// Serve serves manager connections on l until Close.
func (b *Bridge) Serve(l net.Listener) error {
	err := b.srv.Serve(l)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Close stops the bridge; open streams are cut.
func (b *Bridge) Close() error { return b.srv.Close() }

// Shutdown stops accepting and waits for in-flight requests until ctx ends.
func (b *Bridge) Shutdown(ctx context.Context) error { return b.srv.Shutdown(ctx) }

// dialGuest opens and verifies a new guest connection: transport checks
// first, then the identity the agent reports on that very connection.
func (b *Bridge) dialGuest(ctx context.Context) (*guestConn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", b.cfg.GuestSocket)
	if err != nil {
		return nil, fmt.Errorf("bridge: dial guest: %w", err)
	}
	if err := procid.VerifyPeer(c, b.guest); err != nil {
		c.Close()
		return nil, fmt.Errorf("bridge: guest listener: %w", err)
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
		return nil, fmt.Errorf("bridge: %w: status %d: %v", ErrGuestIdentity, resp.StatusCode, err)
	}
	if d := identity.Diff(got, b.cfg.Expected); len(d) > 0 {
		c.Close()
		return nil, fmt.Errorf("bridge: %w: differs in %s", ErrGuestIdentity, strings.Join(d, ","))
	}
	c.SetDeadline(time.Time{})
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
	}
}

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
