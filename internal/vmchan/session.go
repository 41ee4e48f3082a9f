package vmchan

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"
)

// Errors of streams and sessions.
var (
	// ErrSessionReset: the guest received a new HELLO; streams of the
	// previous session fail with it (the agent's processes keep running).
	ErrSessionReset = errors.New("vmchan: session reset by a new HELLO")
	// ErrLostSync: the guest read a malformed frame header in sync (stale
	// bytes after a restore, or the padding before a new HELLO); the
	// session ends.
	ErrLostSync = errors.New("vmchan: lost sync")
	// ErrHostGone: the guest's port reported that the host disconnected.
	ErrHostGone = errors.New("vmchan: host disconnected")
	// ErrChannelLost: the host's connection to the port failed; there
	// are no transparent reconnects.
	ErrChannelLost = errors.New("vmchan: channel lost")
	// ErrClosed: the session, client or listener was closed locally.
	ErrClosed = errors.New("vmchan: closed")
	// ErrTooManyStreams: the session's stream limit is reached.
	ErrTooManyStreams = errors.New("vmchan: too many streams")
	// ErrWriteClosed: Write after CloseWrite or Close.
	ErrWriteClosed = errors.New("vmchan: write on closed stream")
)

// Reset codes.
const (
	// CodeClosed: the peer closed the stream before reading all of it.
	CodeClosed uint32 = 1
	// CodeRefused: the guest refused the stream (backlog or limit).
	CodeRefused uint32 = 2
	// CodeProtocol: the peer violated flow control on the stream.
	CodeProtocol uint32 = 3
)

// ResetError is a stream reset by the peer.
type ResetError struct {
	Code   uint32
	Reason string
}

func (e *ResetError) Error() string {
	return fmt.Sprintf("vmchan: stream reset by peer (code %d: %s)", e.Code, e.Reason)
}

// ProtocolError is a peer that violated the protocol; the session ends.
type ProtocolError struct{ Reason string }

func (e *ProtocolError) Error() string { return "vmchan: protocol violation: " + e.Reason }

// GoAwayError is a session the guest ended with GOAWAY.
type GoAwayError struct{ Reason string }

func (e *GoAwayError) Error() string { return "vmchan: guest ended the session: " + e.Reason }

// SessionID is a session's random 128-bit id.
type SessionID [SessionIDSize]byte

func (s SessionID) String() string { return hex.EncodeToString(s[:]) }

// writeDeadliner is implemented by ports whose blocked writes can be cut.
type writeDeadliner interface{ SetWriteDeadline(time.Time) error }

// writeReq is one DATA frame waiting for the writer.
type writeReq struct {
	buf  []byte
	done chan error
}

// session is one session over the byte stream: its streams and its writer
// goroutine. Reading belongs to the owner (Client or Listener), which
// feeds frames to handle.
type session struct {
	id      SessionID
	w       io.Writer
	host    bool
	maxStrm int
	// accept receives streams the host opened (guest side only).
	accept func(*Stream) bool

	mu      sync.Mutex
	streams map[uint32]*Stream
	lastID  uint32
	err     error
	done    chan struct{}

	wmu     sync.Mutex
	ctrl    []byte            // encoded control frames to write
	windows map[uint32]uint32 // coalesced WINDOW increments
	data    []*writeReq
	drain   bool // write the pending control frames, then exit
	wake    chan struct{}
	wg      sync.WaitGroup // the writer
}

func newSession(id SessionID, w io.Writer, host bool, maxStreams int, accept func(*Stream) bool) *session {
	s := &session{
		id: id, w: w, host: host, maxStrm: maxStreams, accept: accept,
		streams: make(map[uint32]*Stream),
		done:    make(chan struct{}),
		windows: make(map[uint32]uint32),
		wake:    make(chan struct{}, 1),
	}
	s.wg.Add(1)
	go func() { defer s.wg.Done(); s.writeLoop() }()
	return s
}

func (s *session) kick() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// queueCtrl queues an encoded control frame (never blocks).
func (s *session) queueCtrl(t FrameType, id uint32, payload ...[]byte) {
	s.wmu.Lock()
	s.ctrl = appendFrame(s.ctrl, t, id, payload...)
	s.wmu.Unlock()
	s.kick()
}

func (s *session) queueWindow(id uint32, n uint32) {
	s.wmu.Lock()
	s.windows[id] += n
	s.wmu.Unlock()
	s.kick()
}

// writeData writes one DATA frame and waits until it was written.
func (s *session) writeData(id uint32, p []byte) error {
	req := &writeReq{buf: appendFrame(make([]byte, 0, HeaderSize+len(p)), FrameData, id, p), done: make(chan error, 1)}
	s.wmu.Lock()
	if s.drain {
		s.wmu.Unlock()
		return s.failure()
	}
	s.data = append(s.data, req)
	s.wmu.Unlock()
	s.kick()
	select {
	case err := <-req.done:
		return err
	case <-s.done:
		return s.failure()
	}
}

// writeLoop writes control frames first, then one queued DATA frame at a
// time, until the session ends.
func (s *session) writeLoop() {
	var buf []byte
	for {
		s.wmu.Lock()
		buf = append(buf[:0], s.ctrl...)
		s.ctrl = s.ctrl[:0]
		for id, n := range s.windows {
			var b [4]byte
			binary.BigEndian.PutUint32(b[:], n)
			buf = appendFrame(buf, FrameWindow, id, b[:])
			delete(s.windows, id)
		}
		var req *writeReq
		if len(s.data) > 0 && !s.drain {
			req = s.data[0]
			s.data = s.data[1:]
		}
		drain := s.drain
		s.wmu.Unlock()
		if req != nil {
			buf = append(buf, req.buf...)
		}
		if len(buf) > 0 {
			_, err := s.w.Write(buf)
			if req != nil {
				req.done <- err
			}
			if err != nil {
				s.fail(fmt.Errorf("%w: write: %v", ErrChannelLost, err))
				return
			}
			continue
		}
		if drain {
			return
		}
		select {
		case <-s.wake:
		case <-s.done:
			return
		}
	}
}

func (s *session) failure() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err == nil {
		return ErrClosed
	}
	return s.err
}

// fail ends the session with err: every stream fails with it. It does not
// wait for the writer (see close).
func (s *session) fail(err error) {
	s.mu.Lock()
	if s.err != nil {
		s.mu.Unlock()
		return
	}
	s.err = err
	close(s.done)
	streams := make([]*Stream, 0, len(s.streams))
	for _, st := range s.streams {
		streams = append(streams, st)
	}
	s.streams = map[uint32]*Stream{}
	s.mu.Unlock()
	for _, st := range streams {
		st.abort(err)
	}
}

// close ends the session and waits for its writer, cutting a blocked write
// through the port's write deadline when it has one (the host side closes
// its connection instead).
func (s *session) close(err error) {
	s.fail(err)
	if wd, ok := s.w.(writeDeadliner); ok {
		_ = wd.SetWriteDeadline(time.Unix(1, 0))
		s.wg.Wait()
		_ = wd.SetWriteDeadline(time.Time{})
		return
	}
	s.wg.Wait()
}

// goAway queues GOAWAY, lets the writer flush control frames for at most
// d, then closes the session with err.
func (s *session) goAway(err error, d time.Duration) {
	s.wmu.Lock()
	s.ctrl = appendFrame(s.ctrl, FrameGoAway, 0, s.id[:], clip(err.Error()))
	s.drain = true
	s.wmu.Unlock()
	s.kick()
	exited := make(chan struct{})
	go func() { s.wg.Wait(); close(exited) }()
	select {
	case <-exited:
	case <-time.After(d):
	}
	s.close(err)
	<-exited
}

// handle processes one in-sync stream frame. An error is a protocol
// violation that ends the session.
func (s *session) handle(f Frame) error {
	switch f.Type {
	case FrameOpen:
		if s.host {
			return &ProtocolError{Reason: "the guest opened a stream"}
		}
		return s.handleOpen(f.Stream)
	case FrameData, FrameWindow, FrameFin, FrameReset:
	default:
		return &ProtocolError{Reason: fmt.Sprintf("unexpected %s", f.Type)}
	}
	s.mu.Lock()
	st := s.streams[f.Stream]
	known := f.Stream <= s.lastID
	s.mu.Unlock()
	if st == nil {
		if !known {
			return &ProtocolError{Reason: fmt.Sprintf("%s for stream %d that was never opened", f.Type, f.Stream)}
		}
		return nil // a stream closed locally: late frames are dropped
	}
	switch f.Type {
	case FrameData:
		if err := st.receive(f.Payload); err != nil {
			return err
		}
	case FrameWindow:
		return st.addCredit(binary.BigEndian.Uint32(f.Payload))
	case FrameFin:
		st.finReceived()
	case FrameReset:
		st.abort(&ResetError{Code: binary.BigEndian.Uint32(f.Payload), Reason: string(f.Payload[4:])})
		s.forget(st.id)
	}
	return nil
}

func (s *session) handleOpen(id uint32) error {
	s.mu.Lock()
	if id <= s.lastID {
		s.mu.Unlock()
		return &ProtocolError{Reason: fmt.Sprintf("OPEN of stream %d not above %d", id, s.lastID)}
	}
	s.lastID = id
	if s.err != nil {
		s.mu.Unlock()
		return nil
	}
	if len(s.streams) >= s.maxStrm {
		s.mu.Unlock()
		s.queueCtrl(FrameReset, id, be32(CodeRefused), clip(ErrTooManyStreams.Error()))
		return nil
	}
	st := newStream(s, id)
	s.streams[id] = st
	s.mu.Unlock()
	if !s.accept(st) {
		s.forget(id)
		s.queueCtrl(FrameReset, id, be32(CodeRefused), []byte("accept backlog full"))
	}
	return nil
}

// open creates a stream on the host side and sends OPEN.
func (s *session) open() (*Stream, error) {
	s.mu.Lock()
	if s.err != nil {
		err := s.err
		s.mu.Unlock()
		return nil, err
	}
	if len(s.streams) >= s.maxStrm || s.lastID >= 1<<31 {
		s.mu.Unlock()
		return nil, ErrTooManyStreams
	}
	s.lastID++
	st := newStream(s, s.lastID)
	s.streams[st.id] = st
	// Queued under s.mu: OPENs must reach the guest in id order.
	s.queueCtrl(FrameOpen, st.id)
	s.mu.Unlock()
	return st, nil
}

func (s *session) forget(id uint32) {
	s.mu.Lock()
	delete(s.streams, id)
	s.mu.Unlock()
}

func be32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }
