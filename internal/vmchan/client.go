package vmchan

import (
	"bufio"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// ClientConfig configures the host side.
type ClientConfig struct {
	// Activation is the ACTIVATE payload (<= MaxControlPayload).
	Activation []byte
	// BootTimeout bounds the wait for the guest's ACK (the port accepts
	// bytes long before the agent reads them). Default 60s.
	BootTimeout time.Duration
	// ResendInterval is how often HELLO and ACTIVATE are sent again,
	// under a new session id, until an ACK arrives: bytes sent before
	// the guest opened its port may be lost. Default 1s.
	ResendInterval time.Duration
	// MaxStreams bounds open streams. Default 1024.
	MaxStreams int
	// Logger receives session events. Default slog.Default().
	Logger *slog.Logger
}

// withDefaults returns a copy of cfg with unset (zero or negative) fields
// replaced by the documented defaults.
func (cfg ClientConfig) withDefaults() ClientConfig {
	if cfg.BootTimeout <= 0 {
		cfg.BootTimeout = 60 * time.Second
	}
	if cfg.ResendInterval <= 0 {
		cfg.ResendInterval = time.Second
	}
	if cfg.MaxStreams <= 0 {
		cfg.MaxStreams = 1024
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return cfg
}

// Validate checks cfg; it fills nothing.
func (cfg ClientConfig) Validate() error {
	if len(cfg.Activation) > MaxControlPayload {
		return fmt.Errorf("vmchan: activation of %d bytes exceeds %d", len(cfg.Activation), MaxControlPayload)
	}
	return nil
}

// ActivationError is an ACK in which the guest refused the activation.
type ActivationError struct{ Msg string }

func (e *ActivationError) Error() string { return "vmchan: guest refused activation: " + e.Msg }

// ErrBootTimeout: no ACK within ClientConfig.BootTimeout.
var ErrBootTimeout = errors.New("vmchan: no ACK from the guest within the boot timeout")

// Client is the host side of one session over one connection. It never
// reconnects: when the connection fails, every stream fails and Done is
// closed.
type Client struct {
	conn net.Conn
	log  *slog.Logger
	sess *session
	// Ack is the body of the guest's ACK: the identity it now holds.
	ack []byte

	closeOnce sync.Once
	wg        sync.WaitGroup // the reader

	// hsMu orders the handshake: a HELLO attempt is written, and the
	// wanted session id changed, only while no ACK has been accepted. An
	// attempt written after the guest's ACK was accepted would reach the
	// guest inside that session (its padding breaks it).
	hsMu       sync.Mutex
	hsAccepted bool
}

// ackResult is what the reader reports from the handshake.
type ackResult struct {
	sid  SessionID
	body []byte
	err  error
}

// NewClient runs the session handshake over conn (which it then owns):
// padding, HELLO and ACTIVATE, repeated under a new session id every
// ResendInterval until the guest ACKs the current one, within
// BootTimeout and ctx.
func NewClient(ctx context.Context, conn net.Conn, cfg ClientConfig) (*Client, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		conn.Close()
		return nil, err
	}
	c := &Client{conn: conn, log: cfg.Logger}
	var want atomic.Pointer[SessionID] // nil until the first HELLO
	acks := make(chan ackResult, 1)
	var sess atomic.Pointer[session]
	br := bufio.NewReaderSize(conn, 64<<10)
	c.wg.Add(1)
	go func() { defer c.wg.Done(); c.read(br, &want, acks, &sess, cfg.MaxStreams) }()

	ctx, cancel := context.WithTimeout(ctx, cfg.BootTimeout)
	defer cancel()
	pad := make([]byte, PaddingSize)
	tick := time.NewTicker(cfg.ResendInterval)
	defer tick.Stop()
	fail := func(err error) (*Client, error) {
		conn.Close()
		c.wg.Wait()
		if s := sess.Load(); s != nil {
			s.close(err)
		}
		return nil, err
	}
	for attempt := 1; ; attempt++ {
		c.hsMu.Lock()
		if !c.hsAccepted {
			var sid SessionID
			_, _ = rand.Read(sid[:])
			want.Store(&sid)
			msg := append([]byte(nil), pad...)
			msg = appendFrame(msg, FrameHello, 0, helloPayload(sid))
			msg = appendFrame(msg, FrameActivate, 0, cfg.Activation)
			// A write that cannot complete (nobody reads the port yet) is
			// cut at the next resend; the padding of the next attempt
			// covers the partial frame it may leave.
			_ = conn.SetWriteDeadline(time.Now().Add(cfg.ResendInterval))
			if _, err := conn.Write(msg); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
				c.hsMu.Unlock()
				return fail(fmt.Errorf("%w: write HELLO: %v", ErrChannelLost, err))
			}
		}
		c.hsMu.Unlock()
		select {
		case r := <-acks:
			_ = conn.SetWriteDeadline(time.Time{})
			if r.err != nil {
				return fail(r.err)
			}
			c.sess = sess.Load()
			c.ack = r.body
			c.log.Info("vmchan: session established", "session", r.sid.String(), "attempts", attempt)
			return c, nil
		case <-tick.C:
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return fail(fmt.Errorf("%w (%s, %d attempts)", ErrBootTimeout, cfg.BootTimeout, attempt))
			}
			return fail(ctx.Err())
		}
	}
}

// read is the reader goroutine: it scans for the ACK of the current
// session id, then dispatches in-sync frames to the session until the
// connection fails.
func (c *Client) read(br *bufio.Reader, want *atomic.Pointer[SessionID], acks chan<- ackResult, sessp *atomic.Pointer[session], maxStreams int) {
	for {
		f, err := scanFor(br, FrameAck)
		if err != nil {
			acks <- ackResult{err: fmt.Errorf("%w: read: %v", ErrChannelLost, err)}
			return
		}
		sid, ok, body, perr := parseAck(f.Payload)
		c.hsMu.Lock()
		if w := want.Load(); perr != nil || w == nil || sid != *w {
			c.hsMu.Unlock()
			continue // stale or of an earlier attempt
		}
		c.hsAccepted = true // no further attempt is written
		c.hsMu.Unlock()
		if !ok {
			acks <- ackResult{sid: sid, err: &ActivationError{Msg: string(body)}}
			return
		}
		s := newSession(sid, c.conn, true, maxStreams, nil)
		sessp.Store(s)
		acks <- ackResult{sid: sid, body: body}
		break
	}
	s := sessp.Load()
	for {
		f, err := readFrame(br)
		if err != nil {
			var fe *FrameError
			if errors.As(err, &fe) {
				err = &ProtocolError{Reason: fe.Reason}
				s.close(err)
			} else {
				s.close(fmt.Errorf("%w: read: %v", ErrChannelLost, err))
			}
			c.conn.Close()
			return
		}
		switch f.Type {
		case FrameAck:
			continue // a late ACK of this session
		case FrameGoAway:
			reason := string(f.Payload[SessionIDSize:])
			if SessionID(f.Payload[:SessionIDSize]) == s.id {
				s.close(&GoAwayError{Reason: reason})
				c.conn.Close()
				return
			}
			continue
		}
		if err := s.handle(f); err != nil {
			s.close(err)
			c.conn.Close()
			return
		}
	}
}

// Ack returns the body of the guest's ACK (the identity it now holds).
func (c *Client) Ack() []byte { return c.ack }

// Session returns the session id.
func (c *Client) Session() SessionID { return c.sess.id }

// Open opens a new stream. It does not wait for the guest: a guest that
// refuses the stream resets it.
func (c *Client) Open(ctx context.Context) (net.Conn, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	st, err := c.sess.open()
	if err != nil {
		return nil, err
	}
	return st, nil
}

// Done is closed when the session ended (connection lost, GOAWAY,
// protocol violation or Close).
func (c *Client) Done() <-chan struct{} { return c.sess.done }

// Err is why the session ended (nil while it runs).
func (c *Client) Err() error {
	select {
	case <-c.sess.done:
		return c.sess.failure()
	default:
		return nil
	}
}

// Close ends the session: every stream fails with ErrClosed; the
// connection is closed and the goroutines are waited for.
func (c *Client) Close() error {
	var err error
	c.closeOnce.Do(func() {
		c.sess.fail(ErrClosed)
		err = c.conn.Close()
		c.sess.close(ErrClosed)
		c.wg.Wait()
	})
	return err
}
