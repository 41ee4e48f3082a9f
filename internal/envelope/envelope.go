// Package envelope is the one parser of Connect streaming envelopes
// (connectrpc.com/docs/protocol): 1 flag byte, 4 bytes big-endian payload
// length, payload. Flag 0x01 marks a compressed payload, 0x02 the
// end-of-stream message, whose payload is JSON ({"error":{...}} or {}).
// The edge (following process streams to reattach them) and sbx-manager
// (ending a stream at a message boundary when its execution is replaced)
// both read envelopes through it.
package envelope

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
)

// Envelope flags and header size.
const (
	FlagCompressed = 0x01
	FlagEndStream  = 0x02
	HeaderLen      = 5
)

// ErrMalformed reports bytes that are not a well-formed envelope.
var ErrMalformed = errors.New("malformed connect envelope")

// Header is an envelope's header.
type Header struct {
	Flags byte
	Len   uint32
}

// ParseHeader reads the header at the start of b (at least HeaderLen
// bytes). Unknown flag bits are an error: a stream carrying them is not
// one this package understands.
func ParseHeader(b []byte) (Header, error) {
	if len(b) < HeaderLen {
		return Header{}, fmt.Errorf("%w: %d header bytes", ErrMalformed, len(b))
	}
	h := Header{Flags: b[0], Len: binary.BigEndian.Uint32(b[1:HeaderLen])}
	if h.Flags&^(FlagCompressed|FlagEndStream) != 0 {
		return h, fmt.Errorf("%w: flags %#x", ErrMalformed, h.Flags)
	}
	return h, nil
}

// EndStream reports whether h is the end-of-stream message.
func (h Header) EndStream() bool { return h.Flags&FlagEndStream != 0 }

// Compressed reports whether h's payload is compressed.
func (h Header) Compressed() bool { return h.Flags&FlagCompressed != 0 }

// Frame returns payload framed as one envelope with flags.
func Frame(flags byte, payload []byte) []byte {
	b := make([]byte, HeaderLen+len(payload))
	b[0] = flags
	binary.BigEndian.PutUint32(b[1:HeaderLen], uint32(len(payload)))
	copy(b[HeaderLen:], payload)
	return b
}

// Single returns the payload of body when body is exactly one envelope
// whose payload is at most max bytes.
func Single(body []byte, max uint32) (Header, []byte, error) {
	h, err := ParseHeader(body)
	if err != nil {
		return h, nil, err
	}
	if uint64(len(body)-HeaderLen) != uint64(h.Len) {
		return h, nil, fmt.Errorf("%w: length %d, %d bytes follow", ErrMalformed, h.Len, len(body)-HeaderLen)
	}
	if h.Len > max {
		return h, nil, fmt.Errorf("%w: payload of %d bytes over %d", ErrMalformed, h.Len, max)
	}
	return h, body[HeaderLen:], nil
}

// EndError is the error of an end-of-stream message; Code is empty for a
// stream that ended without error.
type EndError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// ParseEnd decodes an end-of-stream payload.
func ParseEnd(payload []byte) (EndError, error) {
	var m struct {
		Error *EndError `json:"error"`
	}
	if err := json.Unmarshal(payload, &m); err != nil {
		return EndError{}, fmt.Errorf("%w: end-of-stream payload: %v", ErrMalformed, err)
	}
	if m.Error == nil {
		return EndError{}, nil
	}
	if m.Error.Code == "" {
		return EndError{}, fmt.Errorf("%w: end-of-stream error without code", ErrMalformed)
	}
	return *m.Error, nil
}

// EndStreamFrame is an end-of-stream envelope carrying the error
// {code, message}.
func EndStreamFrame(code, message string) []byte {
	body, _ := json.Marshal(map[string]any{"error": EndError{Code: code, Message: message}})
	return Frame(FlagEndStream, body)
}

// Splitter follows the envelope boundaries of a stream fed to it in
// arbitrary pieces, without holding payloads.
type Splitter struct {
	hdr   [HeaderLen]byte
	hdrN  int
	left  uint64
	ended bool
	err   error
}

// Feed consumes p, calling onHeader (if not nil) for each header it
// completes. It stops at the first malformed header; Err returns it.
func (s *Splitter) Feed(p []byte, onHeader func(Header)) {
	for len(p) > 0 && s.err == nil {
		if s.left > 0 {
			n := min(uint64(len(p)), s.left)
			s.left -= n
			p = p[n:]
			continue
		}
		n := copy(s.hdr[s.hdrN:], p)
		s.hdrN += n
		p = p[n:]
		if s.hdrN < HeaderLen {
			return
		}
		s.hdrN = 0
		h, err := ParseHeader(s.hdr[:])
		if err != nil {
			s.err = err
			return
		}
		s.left = uint64(h.Len)
		if h.EndStream() {
			s.ended = true
		}
		if onHeader != nil {
			onHeader(h)
		}
	}
}

// AtBoundary reports whether everything fed so far ends on an envelope
// boundary (a message may be appended without corrupting the stream).
func (s *Splitter) AtBoundary() bool { return s.err == nil && s.left == 0 && s.hdrN == 0 }

// Ended reports whether an end-of-stream header went by.
func (s *Splitter) Ended() bool { return s.ended }

// Err is the first malformed header seen, if any.
func (s *Splitter) Err() error { return s.err }
