package vmchan

// A Stream is one multiplexed connection of a session: a net.Conn with
// per-stream flow control (credit) and deadlines.

import (
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"
)

// Addr is the address of a stream.
type Addr struct {
	Session SessionID
	Stream  uint32
}

func (Addr) Network() string  { return "vmchan" }
func (a Addr) String() string { return fmt.Sprintf("%s/%d", a.Session, a.Stream) }

// deadline is a read or write deadline of a stream.
type deadline struct {
	t     time.Time
	timer *time.Timer
	ch    chan struct{} // closed when t passes
}

func (d *deadline) set(t time.Time) {
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
	d.t = t
	d.ch = make(chan struct{})
	if t.IsZero() {
		return
	}
	if dur := time.Until(t); dur <= 0 {
		close(d.ch)
	} else {
		ch := d.ch
		d.timer = time.AfterFunc(dur, func() { close(ch) })
	}
}

func (d *deadline) expired() bool {
	select {
	case <-d.ch:
		return true
	default:
		return false
	}
}

// Stream is one multiplexed stream; it implements net.Conn. Close sends
// FIN (and RESET when the peer may still send); CloseWrite half-closes.
type Stream struct {
	sess *session
	id   uint32

	mu       sync.Mutex
	changed  chan struct{} // closed and replaced on every state change
	rbuf     []byte        // received, unread (<= InitialWindow)
	recvLeft int           // window the peer may still use
	unacked  int           // read but not yet returned as WINDOW
	credit   int           // how much we may still send
	finRecv  bool
	finSent  bool
	closed   bool
	err      error // reset by the peer or session failure
	rdl, wdl deadline
}

func newStream(s *session, id uint32) *Stream {
	st := &Stream{sess: s, id: id, changed: make(chan struct{}), recvLeft: InitialWindow, credit: InitialWindow}
	st.rdl.set(time.Time{})
	st.wdl.set(time.Time{})
	return st
}

// notify wakes every waiter; mu must be held.
func (st *Stream) notify() {
	close(st.changed)
	st.changed = make(chan struct{})
}

func (st *Stream) receive(p []byte) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if len(p) > st.recvLeft {
		return &ProtocolError{Reason: fmt.Sprintf("stream %d: %d bytes beyond the window (%d left)", st.id, len(p), st.recvLeft)}
	}
	if st.finRecv {
		return &ProtocolError{Reason: fmt.Sprintf("stream %d: DATA after FIN", st.id)}
	}
	st.recvLeft -= len(p)
	if st.closed || st.err != nil {
		return nil // nobody reads any more
	}
	st.rbuf = append(st.rbuf, p...)
	st.notify()
	return nil
}

func (st *Stream) addCredit(n uint32) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if n == 0 || uint64(st.credit)+uint64(n) > maxCredit {
		return &ProtocolError{Reason: fmt.Sprintf("stream %d: window increment %d beyond the limit", st.id, n)}
	}
	st.credit += int(n)
	st.notify()
	return nil
}

func (st *Stream) finReceived() {
	st.mu.Lock()
	st.finRecv = true
	st.notify()
	done := st.finSent && st.closed
	st.mu.Unlock()
	if done {
		st.sess.forget(st.id)
	}
}

// abort fails the stream with err (peer reset or session failure).
func (st *Stream) abort(err error) {
	st.mu.Lock()
	if st.err == nil {
		st.err = err
	}
	st.notify()
	st.mu.Unlock()
}

// Read reads received data; io.EOF after the peer's FIN.
func (st *Stream) Read(p []byte) (int, error) {
	st.mu.Lock()
	for {
		switch {
		case len(st.rbuf) > 0:
			n := copy(p, st.rbuf)
			st.rbuf = st.rbuf[n:]
			if len(st.rbuf) == 0 {
				st.rbuf = nil
			}
			st.unacked += n
			var ack int
			if st.unacked >= InitialWindow/4 && !st.finRecv && st.err == nil {
				ack, st.unacked = st.unacked, 0
				st.recvLeft += ack
			}
			st.mu.Unlock()
			if ack > 0 {
				st.sess.queueWindow(st.id, uint32(ack))
			}
			return n, nil
		case len(p) == 0:
			st.mu.Unlock()
			return 0, nil
		case st.closed:
			st.mu.Unlock()
			return 0, net.ErrClosed
		case st.finRecv:
			st.mu.Unlock()
			return 0, io.EOF
		case st.err != nil:
			err := st.err
			st.mu.Unlock()
			return 0, err
		case st.rdl.expired():
			st.mu.Unlock()
			return 0, os.ErrDeadlineExceeded
		}
		changed, dl := st.changed, st.rdl.ch
		st.mu.Unlock()
		select {
		case <-changed:
		case <-dl:
		}
		st.mu.Lock()
	}
}

// Write sends p, waiting for window credit as needed.
func (st *Stream) Write(p []byte) (int, error) {
	written := 0
	for written < len(p) {
		st.mu.Lock()
		for {
			if st.closed || st.finSent {
				st.mu.Unlock()
				return written, ErrWriteClosed
			}
			if st.err != nil {
				err := st.err
				st.mu.Unlock()
				return written, err
			}
			if st.wdl.expired() {
				st.mu.Unlock()
				return written, os.ErrDeadlineExceeded
			}
			if st.credit > 0 {
				break
			}
			changed, dl := st.changed, st.wdl.ch
			st.mu.Unlock()
			select {
			case <-changed:
			case <-dl:
			}
			st.mu.Lock()
		}
		n := min(len(p)-written, st.credit, MaxDataPayload)
		st.credit -= n
		st.mu.Unlock()
		if err := st.sess.writeData(st.id, p[written:written+n]); err != nil {
			return written, err
		}
		written += n
	}
	return written, nil
}

// CloseWrite sends FIN: the peer reads io.EOF after the data sent so far.
func (st *Stream) CloseWrite() error {
	st.mu.Lock()
	if st.closed || st.finSent {
		st.mu.Unlock()
		return nil
	}
	if st.err != nil {
		err := st.err
		st.mu.Unlock()
		return err
	}
	st.finSent = true
	st.notify()
	st.mu.Unlock()
	st.sess.queueCtrl(FrameFin, st.id)
	return nil
}

// Close closes both halves: FIN if not yet sent, and RESET when the peer
// has not finished sending (its further writes fail with *ResetError).
func (st *Stream) Close() error {
	st.mu.Lock()
	if st.closed {
		st.mu.Unlock()
		return nil
	}
	st.closed = true
	live := st.err == nil
	sendFin := live && !st.finSent
	sendRst := live && !st.finRecv
	st.finSent = true
	st.rbuf = nil
	st.rdl.set(time.Time{})
	st.wdl.set(time.Time{})
	st.notify()
	st.mu.Unlock()
	if sendFin {
		st.sess.queueCtrl(FrameFin, st.id)
	}
	if sendRst {
		st.sess.queueCtrl(FrameReset, st.id, be32(CodeClosed), []byte("closed"))
	}
	st.sess.forget(st.id)
	return nil
}

// ID is the stream's id within its session.
func (st *Stream) ID() uint32 { return st.id }

func (st *Stream) LocalAddr() net.Addr  { return Addr{Session: st.sess.id, Stream: st.id} }
func (st *Stream) RemoteAddr() net.Addr { return Addr{Session: st.sess.id, Stream: st.id} }

func (st *Stream) SetDeadline(t time.Time) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.rdl.set(t)
	st.wdl.set(t)
	st.notify()
	return nil
}

func (st *Stream) SetReadDeadline(t time.Time) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.rdl.set(t)
	st.notify()
	return nil
}

func (st *Stream) SetWriteDeadline(t time.Time) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.wdl.set(t)
	st.notify()
	return nil
}

var _ net.Conn = (*Stream)(nil)
