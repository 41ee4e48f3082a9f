package cli

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
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

// A create slower than the progress delay draws a spinner on a terminal's
// stderr, and nothing with --json or without a terminal.
func TestProgressOnSlowCreate(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(progressDelay + 300*time.Millisecond)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"sandboxID":"slow1","templateID":"base","clientID":"c","envdVersion":"0.5.7"}`)
	}))
	defer srv.Close()
	for _, c := range []struct {
		tty, asJSON, spinner bool
	}{{true, false, true}, {true, true, false}, {false, false, false}} {
		var stdout bytes.Buffer
		var stderr syncBuffer
		args := []string{"sandbox", "create"}
		if c.asJSON {
			args = append(args, "--json")
		}
		code := run(t.Context(), args, &env{stdin: strings.NewReader(""), stdout: &stdout, stderr: &stderr, stderrTTY: c.tty,
			getenv: func(k string) string { return map[string]string{"SPACE_API_URL": srv.URL, "SPACE_API_KEY": "k"}[k] }})
		if code != 0 || !strings.Contains(stdout.String(), "slow1") {
			t.Fatalf("%+v: exit %d, stdout %q, stderr %q", c, code, stdout.String(), stderr.String())
		}
		got := stderr.String()
		if c.spinner != strings.Contains(got, "creating a sandbox from base") {
			t.Errorf("%+v: stderr %q", c, got)
		}
		if c.spinner && !strings.HasSuffix(got, "\r\x1b[K") {
			t.Errorf("spinner line not erased: %q", got)
		}
		if !c.spinner && got != "" {
			t.Errorf("%+v: stderr %q, want nothing", c, got)
		}
	}
}
