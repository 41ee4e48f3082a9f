package vmchan

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"
)

// ActivateFunc applies an ACTIVATE payload. It returns what the ACK
// carries (the identity the guest now holds, JSON) or an error, whose text
// the ACK carries instead. Requests on streams opened after the ACK must
// see the new activation.
type ActivateFunc func(sid SessionID, payload []byte) ([]byte, error)

// ListenerConfig configures the guest side.
type ListenerConfig struct {
	// Activate applies ACTIVATE payloads. Required.
	Activate ActivateFunc
	// Logger receives session events. Default slog.Default().
	Logger *slog.Logger
	// PollInterval is how long to wait before reading again after the
	// port reported end of file (no host connected). Default 100ms.
	PollInterval time.Duration
	// Backlog bounds streams opened but not yet accepted. Default 128.
	Backlog int
	// MaxStreams bounds the open streams of a session. Default 1024.
	MaxStreams int
}

// withDefaults returns a copy of cfg with unset (zero or negative) fields
// replaced by the documented defaults. There is no Validate: NewListener
// returns no error, and a nil Activate is a programming error.
func (cfg ListenerConfig) withDefaults() ListenerConfig {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = 100 * time.Millisecond
	}
	if cfg.Backlog <= 0 {
		cfg.Backlog = 128
	}
	if cfg.MaxStreams <= 0 {
		cfg.MaxStreams = 1024
	}
	return cfg
}

// Listener is the guest side: it reads the port for the agent's whole
// life, across sessions, and yields the streams the host opens. It
// implements net.Listener (for http.Server); streams of every session
// arrive on the same Listener.
type Listener struct {
	port io.ReadWriteCloser
	cfg  ListenerConfig
	log  *slog.Logger

	accepted  chan *Stream
	closing   chan struct{}
	closeOnce sync.Once
	startOnce sync.Once
	wg        sync.WaitGroup

	mu   sync.Mutex
	sess *session // the current session, nil between sessions
}

// NewListener returns the guest side over port; it owns port (Close
// closes it). Call Start to begin reading. The port should support write
// deadlines (an *os.File opened O_NONBLOCK on a pollable device, a
// net.Conn) so a write that blocks while no host is connected can be cut
// when the session ends.
func NewListener(port io.ReadWriteCloser, cfg ListenerConfig) *Listener {
	cfg = cfg.withDefaults()
	return &Listener{
		port: port, cfg: cfg, log: cfg.Logger,
		accepted: make(chan *Stream, cfg.Backlog),
		closing:  make(chan struct{}),
	}
}

// Start starts reading the port (once).
func (l *Listener) Start() {
	l.startOnce.Do(func() {
		l.wg.Add(1)
		go func() { defer l.wg.Done(); l.run() }()
	})
}

// Accept returns the next stream the host opened.
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case st := <-l.accepted:
		return st, nil
	case <-l.closing:
		return nil, net.ErrClosed
	}
}

// Addr is the listener's (nominal) address.
func (l *Listener) Addr() net.Addr { return Addr{} }

// Close ends the current session, closes the port and waits for the
// reader and writer goroutines.
func (l *Listener) Close() error {
	var err error
	l.closeOnce.Do(func() {
		close(l.closing)
		l.endSession(ErrClosed)
		err = l.port.Close()
		l.wg.Wait()
		for {
			select {
			case st := <-l.accepted:
				st.Close()
				continue
			default:
			}
			break
		}
	})
	return err
}

// Session returns the current session id, if any.
func (l *Listener) Session() (SessionID, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.sess == nil {
		return SessionID{}, false
	}
	return l.sess.id, true
}

func (l *Listener) isClosing() bool {
	select {
	case <-l.closing:
		return true
	default:
		return false
	}
}

// endSession ends the current session (if any) with err.
func (l *Listener) endSession(err error) {
	l.mu.Lock()
	s := l.sess
	l.sess = nil
	l.mu.Unlock()
	if s != nil {
		s.close(err)
		l.log.Info("vmchan: session ended", "session", s.id.String(), "reason", err.Error())
	}
}

func (l *Listener) goAway(err error) {
	l.mu.Lock()
	s := l.sess
	l.sess = nil
	l.mu.Unlock()
	if s != nil {
		l.log.Warn("vmchan: ending session", "session", s.id.String(), "err", err)
		s.goAway(err, time.Second)
	}
}

func (l *Listener) offer(st *Stream) bool {
	select {
	case l.accepted <- st:
		return true
	default:
		return false
	}
}

// run reads the port until Close: scanning for HELLO while out of sync,
// dispatching frames to the current session while in sync.
func (l *Listener) run() {
	br := bufio.NewReaderSize(l.port, 64<<10)
	synced, activated := false, false
	for {
		var f Frame
		var err error
		if synced {
			f, err = readFrame(br)
		} else {
			f, err = scanFor(br, FrameHello)
		}
		if l.isClosing() {
			return
		}
		if err != nil {
			var fe *FrameError
			switch {
			case errors.As(err, &fe):
				// Out of sync (stale bytes or a broken host): the
				// session cannot continue.
				l.goAway(fmt.Errorf("%w: %w", ErrLostSync, err))
				synced = false
			default:
				// io.EOF: no host connected (virtio-serial). Other
				// errors: wait the same way rather than spin.
				if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
					l.log.Warn("vmchan: port read", "err", err)
				}
				l.endSession(ErrHostGone)
				synced = false
				select {
				case <-l.closing:
					return
				case <-time.After(l.cfg.PollInterval):
				}
			}
			continue
		}
		switch f.Type {
		case FrameHello:
			sid, err := parseHello(f.Payload)
			l.endSession(ErrSessionReset)
			if err != nil {
				l.log.Warn("vmchan: HELLO refused", "err", err)
				synced = false
				continue
			}
			s := newSession(sid, l.port, false, l.cfg.MaxStreams, l.offer)
			l.mu.Lock()
			l.sess = s
			l.mu.Unlock()
			synced, activated = true, false
			l.log.Info("vmchan: session started", "session", sid.String())
		case FrameActivate:
			l.mu.Lock()
			s := l.sess
			l.mu.Unlock()
			if s == nil || activated {
				l.goAway(&ProtocolError{Reason: "ACTIVATE out of order"})
				synced = false
				continue
			}
			activated = true
			body, aerr := l.cfg.Activate(s.id, f.Payload)
			if aerr != nil {
				l.log.Warn("vmchan: activation failed", "session", s.id.String(), "err", aerr)
				msg := aerr.Error()
				if len(msg) > MaxControlPayload {
					msg = msg[:MaxControlPayload]
				}
				s.queueCtrl(FrameAck, 0, s.id[:], []byte{ackError}, []byte(msg))
				continue
			}
			if len(body) > MaxControlPayload {
				body = body[:0]
			}
			s.queueCtrl(FrameAck, 0, s.id[:], []byte{ackOK}, body)
		default:
			l.mu.Lock()
			s := l.sess
			l.mu.Unlock()
			if s == nil || !activated || f.Stream == 0 {
				l.goAway(&ProtocolError{Reason: fmt.Sprintf("%s before activation", f.Type)})
				synced = false
				continue
			}
			if err := s.handle(f); err != nil {
				l.goAway(err)
				synced = false
			}
		}
	}
}
