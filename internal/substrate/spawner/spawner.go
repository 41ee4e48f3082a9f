// Package spawner runs process starts on one dedicated, locked OS thread
// that lives until Close. A child's parent-death signal (Pdeathsig) fires
// when the thread that forked it exits, not the process; Go may retire
// ordinary threads (a goroutine that exits while locked kills its thread),
// which would kill unrelated sandboxes. Every substrate whose children rely
// on Pdeathsig (the ns init, QEMU) starts them through a Spawner.
package spawner

import (
	"runtime"
	"sync"

	"github.com/spacesbx/space/internal/errdefs"
)

// ErrClosed is returned by Do after Close. Its class is
// errdefs.ErrUnavailable; its text is its own.
var ErrClosed = errdefs.Message(errdefs.ErrUnavailable, "substrate closed")

// Spawner owns the thread. The zero value is ready; the thread starts with
// the first Do.
type Spawner struct {
	mu     sync.Mutex
	ch     chan func()
	done   chan struct{}
	closed bool
}

// Do runs f on the spawner's thread and returns once f has returned.
func (s *Spawner) Do(f func()) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return ErrClosed
	}
	if s.ch == nil {
		s.ch, s.done = make(chan func()), make(chan struct{})
		go func() {
			runtime.LockOSThread() // never unlocked: the thread dies with Close
			defer close(s.done)
			for f := range s.ch {
				f()
			}
		}()
	}
	ch := s.ch
	s.mu.Unlock()
	done := make(chan struct{})
	ch <- func() { defer close(done); f() }
	<-done
	return nil
}

// Close ends the thread (children started on it get their parent-death
// signal, so stop them first). Do fails afterwards. Idempotent.
func (s *Spawner) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.closed = true
	if s.ch != nil {
		close(s.ch)
		<-s.done
	}
}
