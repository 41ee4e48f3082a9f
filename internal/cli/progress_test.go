package cli

import (
	"bytes"
	"strings"
	"sync"
	"testing"
	"time"
)

// syncBuffer is a bytes.Buffer safe for the spinner's goroutine.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestProgress(t *testing.T) {
	// Shown: a spinner with the label and the elapsed time, erased at the
	// end.
	var w syncBuffer
	p := startProgress(&w, true, "pausing sbx1")
	time.Sleep(progressDelay + 250*time.Millisecond)
	p.Done()
	p.Done() // idempotent
	out := w.String()
	if !strings.Contains(out, "pausing sbx1 0.") || !strings.HasSuffix(out, "\r\x1b[K") {
		t.Fatalf("spinner output %q", out)
	}
	// Quick operations draw nothing, and nothing is drawn when not shown.
	var quick, hidden syncBuffer
	startProgress(&quick, true, "quick").Done()
	p = startProgress(&hidden, false, "hidden")
	time.Sleep(progressDelay + 100*time.Millisecond)
	p.Done()
	if quick.String() != "" || hidden.String() != "" {
		t.Fatalf("quick %q hidden %q", quick.String(), hidden.String())
	}
}
