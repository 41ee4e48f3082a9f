package store

import (
	"testing"
	"time"
)

// The retry schedule doubles from its start up to maxBackOff, without
// jitter, and starts over after Reset.
func TestBackOffSchedule(t *testing.T) {
	b := newBackOff(200 * time.Millisecond)
	want := []time.Duration{200, 400, 800, 1600, 3200, 5000, 5000}
	for i, w := range want {
		if got := b.NextBackOff(); got != w*time.Millisecond {
			t.Fatalf("interval %d: %v, want %v", i, got, w*time.Millisecond)
		}
	}
	b.Reset()
	if got := b.NextBackOff(); got != 200*time.Millisecond {
		t.Fatalf("after reset: %v", got)
	}
}
