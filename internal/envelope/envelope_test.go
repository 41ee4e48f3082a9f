package envelope

import (
	"bytes"
	"errors"
	"testing"
)

func TestSplitterFollowsBoundariesInAnyPieces(t *testing.T) {
	stream := append(append(Frame(0, []byte("hello")), Frame(FlagCompressed, bytes.Repeat([]byte{7}, 300))...), EndStreamFrame("unavailable", "execution replaced: x")...)
	for piece := 1; piece <= len(stream); piece++ {
		var s Splitter
		var heads []Header
		for i := 0; i < len(stream); i += piece {
			s.Feed(stream[i:min(i+piece, len(stream))], func(h Header) { heads = append(heads, h) })
			if s.Ended() && i+piece < len(stream)-1 && s.AtBoundary() {
				t.Fatalf("piece %d: ended and at boundary before the end", piece)
			}
		}
		if !s.AtBoundary() || !s.Ended() || s.Err() != nil || len(heads) != 3 || !heads[1].Compressed() || heads[1].Len != 300 {
			t.Fatalf("piece %d: boundary %v ended %v err %v heads %+v", piece, s.AtBoundary(), s.Ended(), s.Err(), heads)
		}
	}
	var s Splitter
	s.Feed(stream[:7], nil)
	if s.AtBoundary() {
		t.Fatal("inside a message reported as a boundary")
	}
}

func TestRejectsMalformed(t *testing.T) {
	var s Splitter
	s.Feed([]byte{0x80, 0, 0, 0, 1, 'x'}, nil)
	if !errors.Is(s.Err(), ErrMalformed) || s.AtBoundary() {
		t.Fatalf("unknown flag accepted: %v", s.Err())
	}
	if _, _, err := Single([]byte{0, 0, 0, 0, 9, 'a'}, 64); !errors.Is(err, ErrMalformed) {
		t.Fatalf("short body accepted: %v", err)
	}
	if _, _, err := Single(Frame(0, make([]byte, 100)), 64); !errors.Is(err, ErrMalformed) {
		t.Fatalf("oversized payload accepted: %v", err)
	}
	if _, err := ParseEnd([]byte(`{"error":{"message":"x"}}`)); !errors.Is(err, ErrMalformed) {
		t.Fatalf("end without code accepted: %v", err)
	}
	if _, err := ParseEnd([]byte(`{`)); !errors.Is(err, ErrMalformed) {
		t.Fatalf("bad json accepted: %v", err)
	}
}

func TestEndStreamRoundTrip(t *testing.T) {
	h, p, err := Single(EndStreamFrame("unavailable", "gone"), 1<<10)
	if err != nil || !h.EndStream() {
		t.Fatal(h, err)
	}
	e, err := ParseEnd(p)
	if err != nil || e.Code != "unavailable" || e.Message != "gone" {
		t.Fatal(e, err)
	}
	if e, err := ParseEnd([]byte(`{}`)); err != nil || e.Code != "" {
		t.Fatal(e, err)
	}
}

func FuzzSplitter(f *testing.F) {
	f.Add(Frame(0, []byte("abc")), 2)
	f.Add(EndStreamFrame("x", "y"), 1)
	f.Fuzz(func(t *testing.T, b []byte, piece int) {
		if piece <= 0 {
			piece = 1
		}
		var s Splitter
		for i := 0; i < len(b); i += piece {
			s.Feed(b[i:min(i+piece, len(b))], nil)
		}
		_, _, _ = Single(b, 1<<16)
		_, _ = ParseEnd(b)
	})
}
