package edge

// processStream: the client-facing body of a process Start/Connect stream
// and its incremental envelope tracking. Headers are parsed by
// internal/envelope; envelope.Splitter does not serve here because the
// edge must hold or capture the payloads of some messages (the first, the
// end-of-stream) and decide per message. What it does on an "execution
// replaced" end is in reattach.go.

import (
	"context"
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/spacesbx/space/internal/envelope"
	"github.com/spacesbx/space/internal/identity"
)

// msgMode says what happens to the bytes of the message being parsed.
type msgMode int

const (
	modeForward msgMode = iota // to the client
	modeCapture                // to the client and kept for inspection
	modeHold                   // kept; the decision comes when it is complete
)

// processStream is the client-facing body of a process stream. It is used
// by the proxy's body copy only (one goroutine).
type processStream struct {
	e       *Edge
	ctx     context.Context // the client's request
	out     *http.Request   // the forwarded request (headers for a reattach)
	st      *reqState
	codec   codec
	started time.Time
	timeout time.Duration // Connect-Timeout-Ms of the client's call; 0 = none

	// gone is set when the control plane answered that the sandbox is
	// gone (killed or timed out) while reattaching: finish then ends the
	// stream as E2B's dropped connection does (reattach.go killedEnd).
	gone bool

	ent    *entry        // route of cur
	cur    io.ReadCloser // upstream body
	curEnc string        // its Connect-Content-Encoding
	cancel context.CancelFunc
	timer  *time.Timer // bounds a reattached stream until its StartEvent

	pid     uint32
	havePid bool
	// clientStarted: the client has received a message (the StartEvent
	// comes first), so a reattached stream's StartEvent is dropped.
	clientStarted bool

	// Envelope parser state for cur.
	hdr   [envelope.HeaderLen]byte
	hdrN  int
	flags byte
	left  uint32
	msgs  int
	mode  msgMode
	held  []byte
	raw   bool // not an envelope stream the edge understands: bytes pass

	// Reattach state of the current replacement.
	pendingAttach bool   // cur is a reattached stream before its StartEvent
	replacedEnd   []byte // the end-of-stream frame being replaced
	fromRoute     identity.Route
	deadline      time.Time
	attempts      int
	backoff       *backoff.ExponentialBackOff
	lastFailure   string

	pending  []byte
	buf      []byte
	switched bool // cur changed or the stream ended: drop the rest of a chunk
	// reattachDue: the old stream ended with "execution replaced"; Read
	// reattaches once the client has what was queued before that end.
	reattachDue bool
	err         error
}

func (s *processStream) Read(p []byte) (int, error) {
	for {
		if len(s.pending) > 0 {
			n := copy(p, s.pending)
			s.pending = s.pending[n:]
			return n, nil
		}
		if s.reattachDue {
			s.reattachDue = false
			s.runReattach()
			continue
		}
		if s.err != nil {
			return 0, s.err
		}
		n, err := s.cur.Read(s.buf)
		s.switched = false
		if n > 0 {
			s.feed(s.buf[:n])
		}
		if err != nil && !s.switched && s.err == nil {
			s.upstreamEnded(err)
		}
	}
}

func (s *processStream) Close() error {
	s.closeCur()
	if s.err == nil {
		s.err = errors.New("process stream closed")
	}
	return nil
}

func (s *processStream) closeCur() {
	if s.timer != nil {
		s.timer.Stop()
		s.timer = nil
	}
	if s.cur != nil {
		s.cur.Close()
		s.cur = nil
	}
	if s.cancel != nil {
		s.cancel()
		s.cancel = nil
	}
}

// upstreamEnded handles the end of cur that was not an end-of-stream
// message the edge acted on.
func (s *processStream) upstreamEnded(err error) {
	switch {
	case s.ctx.Err() != nil:
		s.abandon()
	case s.pendingAttach:
		s.lastFailure = "stream ended before its StartEvent: " + err.Error()
		s.reattach()
	case errors.Is(err, io.EOF) && (s.hdrN > 0 || s.left > 0):
		s.err = io.ErrUnexpectedEOF // cut inside a message
	default:
		s.err = err
	}
}

// feed parses a chunk of cur and queues what goes to the client.
func (s *processStream) feed(p []byte) {
	for len(p) > 0 && !s.switched && s.err == nil {
		if s.raw {
			s.pending = append(s.pending, p...)
			return
		}
		if s.hdrN < envelope.HeaderLen {
			k := copy(s.hdr[s.hdrN:], p)
			s.hdrN += k
			p = p[k:]
			if s.hdrN == envelope.HeaderLen {
				s.begin()
			}
			continue
		}
		k := len(p)
		if uint64(k) > uint64(s.left) {
			k = int(s.left)
		}
		part := p[:k]
		p = p[k:]
		s.left -= uint32(k)
		switch s.mode {
		case modeForward:
			s.pending = append(s.pending, part...)
		case modeCapture:
			s.pending = append(s.pending, part...)
			s.held = append(s.held, part...)
		case modeHold:
			s.held = append(s.held, part...)
		}
		if s.left == 0 {
			s.complete()
		}
	}
}

// begin starts a message whose header is complete.
func (s *processStream) begin() {
	h, err := envelope.ParseHeader(s.hdr[:])
	if err != nil {
		// Not a Connect envelope: stop parsing, pass everything.
		s.raw = true
		s.pending = append(s.pending, s.hdr[:]...)
		return
	}
	n := h.Len
	s.flags, s.left, s.held = h.Flags, n, s.held[:0]
	s.msgs++
	first := s.msgs == 1
	switch {
	case n > maxInspect && s.pendingAttach:
		s.lastFailure = "oversized first message"
		s.finish(reattachFailed)
		return
	case n > maxInspect:
		s.mode = modeForward
	case h.EndStream(), first && s.pendingAttach:
		s.mode = modeHold
	case first && !s.havePid:
		s.mode = modeCapture
	default:
		s.mode = modeForward
	}
	if s.mode != modeHold {
		s.pending = append(s.pending, s.hdr[:]...)
		s.clientStarted = true
	}
	if s.left == 0 {
		s.complete()
	}
}

// complete acts on a message that is complete.
func (s *processStream) complete() {
	s.hdrN = 0
	switch {
	case s.mode != modeForward && s.flags&envelope.FlagEndStream != 0:
		s.onEnd()
	case s.pendingAttach && s.msgs == 1:
		s.onReattachStart()
	case s.mode == modeCapture:
		if pl, ok := payloadOf(s.flags, s.held, s.curEnc); ok {
			s.pid, s.havePid = startPid(s.codec, pl)
		}
	}
}
