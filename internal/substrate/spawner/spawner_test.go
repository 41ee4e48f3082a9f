package spawner

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"
)

// Every Do runs on the same thread, and nothing runs after Close.
func TestDoUsesOneThreadUntilClose(t *testing.T) {
	var s Spawner
	var tids []int
	for range 3 {
		if err := s.Do(func() { tids = append(tids, unix.Gettid()) }); err != nil {
			t.Fatal(err)
		}
	}
	if tids[0] != tids[1] || tids[1] != tids[2] {
		t.Fatalf("Do ran on threads %v", tids)
	}
	s.Close()
	s.Close()
	ran := false
	if err := s.Do(func() { ran = true }); !errors.Is(err, ErrClosed) || ran {
		t.Fatalf("Do after Close: %v (ran %v)", err, ran)
	}
	var unused Spawner
	unused.Close() // a spawner that never started closes too
}
