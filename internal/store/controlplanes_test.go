package store

import (
	"context"
	"testing"
	"time"
)

// A control plane's entry lives while it runs, goes at once when it stops
// and with its lease when it dies (keep-alives stop, nothing revokes).
func TestControlPlaneRegistration(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()
	if _, err := s.RegisterControlPlane(ctx, "bad/id", time.Second); err == nil {
		t.Fatal("registered an id with a slash")
	}
	a, err := s.RegisterControlPlane(ctx, "cp-a", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.RegisterControlPlane(ctx, "cp-b", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if live, err := s.ControlPlanes(ctx); err != nil || !live["cp-a"] || !live["cp-b"] || len(live) != 2 {
		t.Fatalf("live control planes %v, %v", live, err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	b.abandon() // died: its lease expires
	if live, _ := s.ControlPlanes(ctx); live["cp-a"] {
		t.Fatalf("cp-a still listed after Close: %v", live)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		live, err := s.ControlPlanes(ctx)
		if err == nil && !live["cp-b"] {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("cp-b listed %v after its lease should have expired (%v)", live, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
