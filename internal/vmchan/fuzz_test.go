package vmchan

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"testing"
)

func seeds(f *testing.F) {
	var sid SessionID
	f.Add(appendFrame(nil, FrameHello, 0, helloPayload(sid)))
	f.Add(appendFrame(appendFrame(nil, FrameOpen, 1), FrameData, 1, []byte("hello")))
	f.Add(appendFrame(appendFrame(appendFrame(nil, FrameOpen, 1), FrameWindow, 1, be32(5)), FrameReset, 1, be32(1), []byte("x")))
	f.Add(appendFrame(nil, FrameAck, 0, sid[:], []byte{0}, []byte("{}")))
	f.Add([]byte("\xA5SX\x06\x00\x00\x00\x01\xff\xff\xff\xff"))
	f.Add([]byte("garbage\xA5SX\x01\x00\x00\x00\x00\x00\x00\x00\x11"))
}

// FuzzFrames feeds arbitrary bytes to the in-sync parser and the
// resync scanner: typed errors, no panics, payloads within limits.
func FuzzFrames(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		br := bufio.NewReader(bytes.NewReader(b))
		for {
			fr, err := readFrame(br)
			if err != nil {
				var fe *FrameError
				if !errors.As(err, &fe) && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
					t.Fatalf("untyped error %v", err)
				}
				if fe == nil {
					break
				}
				continue
			}
			if lo, hi, _, ok := payloadLimits(fr.Type); !ok || len(fr.Payload) < lo || len(fr.Payload) > hi {
				t.Fatalf("%s with %d bytes accepted", fr.Type, len(fr.Payload))
			}
		}
		for _, ft := range []FrameType{FrameHello, FrameAck} {
			br := bufio.NewReader(bytes.NewReader(b))
			for {
				fr, err := scanFor(br, ft)
				if err != nil {
					break
				}
				if fr.Type != ft {
					t.Fatalf("scan for %s returned %s", ft, fr.Type)
				}
				parseHello(fr.Payload)
				parseAck(fr.Payload)
			}
		}
	})
}

// FuzzSession feeds arbitrary in-sync frames to a guest session and a
// host session: protocol errors are typed, nothing panics, buffered data
// stays within the window.
func FuzzSession(f *testing.F) {
	seeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, host := range []bool{false, true} {
			var accepted []*Stream
			s := newSession(SessionID{}, io.Discard, host, 8, func(st *Stream) bool {
				accepted = append(accepted, st)
				return len(accepted) < 4
			})
			if host {
				for range 3 {
					s.open()
				}
			}
			br := bufio.NewReader(bytes.NewReader(b))
			for {
				fr, err := readFrame(br)
				if err != nil {
					break
				}
				if fr.Stream == 0 {
					continue
				}
				if err := s.handle(fr); err != nil {
					var pe *ProtocolError
					if !errors.As(err, &pe) {
						t.Fatalf("untyped error %v", err)
					}
					break
				}
			}
			s.mu.Lock()
			for _, st := range s.streams {
				st.mu.Lock()
				if len(st.rbuf) > InitialWindow || st.credit > maxCredit {
					t.Fatalf("stream %d: %d buffered, credit %d", st.id, len(st.rbuf), st.credit)
				}
				st.mu.Unlock()
			}
			s.mu.Unlock()
			s.close(ErrClosed)
		}
	})
}
