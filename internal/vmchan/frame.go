// Package vmchan multiplexes many byte streams over one byte stream: the
// single virtio-serial port between spaced-host (the host side, Client)
// and spaced-guest inside a microVM (the guest side, Listener).
//
// Wire format. Every frame is a 12-byte header followed by its payload:
//
//	magic "\xA5SX" (3) | type (1) | stream id (4, big endian) | payload length (4, big endian)
//
// Frames (stream 0 = session level):
//
//	HELLO    host->guest  stream 0  version (1) | session id (16)
//	ACTIVATE host->guest  stream 0  activation payload (JSON, <= 64 KiB)
//	ACK      guest->host  stream 0  session id (16) | status (1: 0 ok, 1 error) | identity JSON or error text
//	GOAWAY   guest->host  stream 0  session id (16) | reason text (<= 256)
//	OPEN     host->guest  stream n  empty; n > every earlier id of the session
//	DATA     both         stream n  1..16 KiB; consumes the receiver's window
//	WINDOW   both         stream n  increment (4, big endian)
//	FIN      both         stream n  empty; the sender's half is closed
//	RESET    both         stream n  code (4) | reason text (<= 256)
//
// A session starts with HELLO (random session id) immediately followed by
// ACTIVATE; the guest applies the activation and answers ACK with the
// session id. Only then does the host open streams. Every stream starts
// with a 256 KiB window in each direction; a receiver returns credit with
// WINDOW as the application reads, and a sender never sends more than its
// credit, so a stalled reader stalls only its own stream.
//
// Resync. After a VM restore either direction may begin with stale bytes
// (a partial frame of an older session). The host precedes every HELLO
// with a padding of zero bytes longer than any frame, so a guest stuck in
// the middle of a stale frame reaches a header that fails validation. A
// side that is not in sync discards bytes until a valid HELLO (guest) or
// an ACK naming the current session id (host). A new HELLO at any time
// ends the guest's current session: its streams fail with ErrSessionReset.
package vmchan

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Wire constants.
const (
	// Version is the protocol version carried in HELLO.
	Version = 1
	// HeaderSize is the size of a frame header.
	HeaderSize = 12
	// SessionIDSize is the size of a session id.
	SessionIDSize = 16
	// MaxDataPayload bounds the payload of one DATA frame.
	MaxDataPayload = 16 << 10
	// MaxControlPayload bounds ACTIVATE and ACK payloads.
	MaxControlPayload = 64 << 10
	// MaxReasonLen bounds the reason text of RESET and GOAWAY.
	MaxReasonLen = 256
	// InitialWindow is the receive window of each direction of a stream.
	InitialWindow = 256 << 10
	// maxCredit bounds a sender's credit; more is a protocol violation.
	maxCredit = InitialWindow
	// PaddingSize is the zero padding sent before each HELLO: longer than
	// any frame a guest may be in the middle of.
	PaddingSize = MaxControlPayload + HeaderSize
)

var magic = [3]byte{0xA5, 'S', 'X'}

// FrameType is the type of a frame.
type FrameType uint8

// Frame types.
const (
	FrameHello    FrameType = 1
	FrameActivate FrameType = 2
	FrameAck      FrameType = 3
	FrameGoAway   FrameType = 4
	FrameOpen     FrameType = 5
	FrameData     FrameType = 6
	FrameWindow   FrameType = 7
	FrameFin      FrameType = 8
	FrameReset    FrameType = 9
)

func (t FrameType) String() string {
	switch t {
	case FrameHello:
		return "HELLO"
	case FrameActivate:
		return "ACTIVATE"
	case FrameAck:
		return "ACK"
	case FrameGoAway:
		return "GOAWAY"
	case FrameOpen:
		return "OPEN"
	case FrameData:
		return "DATA"
	case FrameWindow:
		return "WINDOW"
	case FrameFin:
		return "FIN"
	case FrameReset:
		return "RESET"
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

// Frame is one decoded frame.
type Frame struct {
	Type    FrameType
	Stream  uint32
	Payload []byte
}

// FrameError is a malformed frame header or payload: in sync it means the
// peer is broken or hostile (or the byte stream lost sync).
type FrameError struct{ Reason string }

func (e *FrameError) Error() string { return "vmchan: bad frame: " + e.Reason }

func frameErr(format string, a ...any) error { return &FrameError{Reason: fmt.Sprintf(format, a...)} }

// payloadLimits returns the allowed payload length range of t and whether
// t is a session-level (stream 0) frame; ok is false for unknown types.
func payloadLimits(t FrameType) (lo, hi int, session, ok bool) {
	switch t {
	case FrameHello:
		return 1 + SessionIDSize, 1 + SessionIDSize, true, true
	case FrameActivate:
		return 0, MaxControlPayload, true, true
	case FrameAck:
		return SessionIDSize + 1, SessionIDSize + 1 + MaxControlPayload, true, true
	case FrameGoAway:
		return SessionIDSize, SessionIDSize + MaxReasonLen, true, true
	case FrameOpen, FrameFin:
		return 0, 0, false, true
	case FrameData:
		return 1, MaxDataPayload, false, true
	case FrameWindow:
		return 4, 4, false, true
	case FrameReset:
		return 4, 4 + MaxReasonLen, false, true
	}
	return 0, 0, false, false
}

// parseHeader validates a frame header and returns its fields.
func parseHeader(h []byte) (FrameType, uint32, int, error) {
	if len(h) < HeaderSize {
		return 0, 0, 0, frameErr("short header (%d bytes)", len(h))
	}
	if h[0] != magic[0] || h[1] != magic[1] || h[2] != magic[2] {
		return 0, 0, 0, frameErr("bad magic %x", h[:3])
	}
	t := FrameType(h[3])
	id := binary.BigEndian.Uint32(h[4:8])
	n := binary.BigEndian.Uint32(h[8:12])
	lo, hi, session, ok := payloadLimits(t)
	if !ok {
		return 0, 0, 0, frameErr("unknown frame type %d", h[3])
	}
	if session != (id == 0) {
		return 0, 0, 0, frameErr("%s on stream %d", t, id)
	}
	if n < uint32(lo) || n > uint32(hi) {
		return 0, 0, 0, frameErr("%s payload of %d bytes (want %d..%d)", t, n, lo, hi)
	}
	return t, id, int(n), nil
}

// appendFrame appends the encoding of a frame to dst.
func appendFrame(dst []byte, t FrameType, id uint32, payload ...[]byte) []byte {
	n := 0
	for _, p := range payload {
		n += len(p)
	}
	dst = append(dst, magic[0], magic[1], magic[2], byte(t))
	dst = binary.BigEndian.AppendUint32(dst, id)
	dst = binary.BigEndian.AppendUint32(dst, uint32(n))
	for _, p := range payload {
		dst = append(dst, p...)
	}
	return dst
}

// readFrame reads one frame in sync. A *FrameError means the header is
// invalid (the header's bytes are consumed); io errors are returned as is.
func readFrame(br *bufio.Reader) (Frame, error) {
	var h [HeaderSize]byte
	if _, err := io.ReadFull(br, h[:]); err != nil {
		return Frame{}, err
	}
	t, id, n, err := parseHeader(h[:])
	if err != nil {
		return Frame{}, err
	}
	f := Frame{Type: t, Stream: id}
	if n > 0 {
		f.Payload = make([]byte, n)
		if _, err := io.ReadFull(br, f.Payload); err != nil {
			return Frame{}, err
		}
	}
	return f, nil
}

// scanFor discards bytes until a valid header of type t (a session-level
// type) and returns that frame. Bytes of a candidate header that fails
// validation are not consumed beyond its first byte, so overlapping
// candidates are found. An io error (e.g. io.EOF) is returned as is and
// leaves any partial candidate buffered for the next call.
func scanFor(br *bufio.Reader, t FrameType) (Frame, error) {
	for {
		b, err := br.ReadByte()
		if err != nil {
			return Frame{}, err
		}
		if b != magic[0] {
			continue
		}
		rest, err := br.Peek(HeaderSize - 1)
		if err != nil {
			if errors.Is(err, bufio.ErrBufferFull) {
				continue
			}
			_ = br.UnreadByte()
			return Frame{}, err
		}
		h := append([]byte{b}, rest...)
		ft, id, n, herr := parseHeader(h)
		if herr != nil || ft != t {
			continue
		}
		_, _ = br.Discard(HeaderSize - 1)
		f := Frame{Type: ft, Stream: id, Payload: make([]byte, n)}
		if _, err := io.ReadFull(br, f.Payload); err != nil {
			return Frame{}, err
		}
		return f, nil
	}
}

// helloPayload encodes a HELLO payload.
func helloPayload(sid SessionID) []byte {
	return append([]byte{Version}, sid[:]...)
}

// parseHello decodes a HELLO payload.
func parseHello(p []byte) (SessionID, error) {
	var sid SessionID
	if len(p) != 1+SessionIDSize {
		return sid, frameErr("HELLO of %d bytes", len(p))
	}
	if p[0] != Version {
		return sid, &VersionError{Got: p[0]}
	}
	copy(sid[:], p[1:])
	return sid, nil
}

// VersionError is a HELLO of a protocol version this side does not speak.
type VersionError struct{ Got byte }

func (e *VersionError) Error() string {
	return fmt.Sprintf("vmchan: protocol version %d, want %d", e.Got, Version)
}

// Ack status bytes.
const (
	ackOK    = 0
	ackError = 1
)

// parseAck decodes an ACK payload.
func parseAck(p []byte) (sid SessionID, ok bool, body []byte, err error) {
	if len(p) < SessionIDSize+1 {
		return sid, false, nil, frameErr("ACK of %d bytes", len(p))
	}
	copy(sid[:], p[:SessionIDSize])
	switch p[SessionIDSize] {
	case ackOK:
		ok = true
	case ackError:
	default:
		return sid, false, nil, frameErr("ACK status %d", p[SessionIDSize])
	}
	return sid, ok, p[SessionIDSize+1:], nil
}

// clip shortens a reason text to at most MaxReasonLen bytes.
func clip(s string) []byte {
	if len(s) > MaxReasonLen {
		s = s[:MaxReasonLen]
	}
	return []byte(s)
}
