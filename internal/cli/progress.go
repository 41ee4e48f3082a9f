package cli

import (
	"fmt"
	"io"
	"sync"
	"time"
)

// progressDelay is how long an operation runs before its spinner shows:
// quick ones print nothing.
const progressDelay = 300 * time.Millisecond

var spinFrames = []string{"⠋", "⠙", "⠹", "⠸", "⠼", "⠴", "⠦", "⠧", "⠇", "⠏"}

// progress draws "<spinner> label 1.2s" on a terminal's stderr while an
// operation runs and erases it after. It draws nothing when stderr is not
// a terminal or the command prints JSON, so scripts see only results.
type progress struct {
	w     io.Writer
	label string
	start time.Time
	stop  chan struct{}
	done  chan struct{}
	once  sync.Once
}

// startProgress starts a spinner for label; Done stops it. Safe to call
// with show false (it then does nothing).
func startProgress(w io.Writer, show bool, label string) *progress {
	p := &progress{w: w, label: label, start: time.Now(), stop: make(chan struct{}), done: make(chan struct{})}
	if !show {
		close(p.done)
		return p
	}
	go p.loop()
	return p
}

func (p *progress) loop() {
	defer close(p.done)
	t := time.NewTimer(progressDelay)
	defer t.Stop()
	select {
	case <-p.stop:
		return
	case <-t.C:
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for i := 0; ; i++ {
		fmt.Fprintf(p.w, "\r\x1b[K%s %s %.1fs", spinFrames[i%len(spinFrames)], p.label, time.Since(p.start).Seconds())
		select {
		case <-p.stop:
			fmt.Fprint(p.w, "\r\x1b[K")
			return
		case <-tick.C:
		}
	}
}

// Done stops the spinner, erases its line and waits for it.
func (p *progress) Done() {
	p.once.Do(func() {
		select {
		case <-p.done:
		default:
			close(p.stop)
		}
	})
	<-p.done
}

// spin runs f under a spinner for label unless quiet.
func spin[T any](g *globals, quiet bool, label string, f func() (T, error)) (T, error) {
	p := startProgress(g.e.stderr, g.e.stderrTTY && !quiet, label)
	defer p.Done()
	return f()
}
