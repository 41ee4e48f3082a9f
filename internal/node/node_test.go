package node

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

func TestConfigDefaultsAndValidate(t *testing.T) {
	if err := (Config{}).Validate(); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("empty config: %v, want ErrInvalid (data and snapshot dirs are required)", err)
	}
	c := Config{DataDir: "/d", SnapshotDir: "/s"}
	if err := c.Validate(); err != nil {
		t.Fatalf("zero fields with defaults must be valid: %v", err)
	}
	d := c.withDefaults()
	exe, _ := os.Executable()
	if d.Capacity != DefaultCapacity || d.Logger == nil || d.BinDir != filepath.Dir(exe) {
		t.Fatalf("defaults: %+v", d)
	}
	if c.Capacity != 0 || c.Logger != nil {
		t.Fatal("withDefaults changed its receiver")
	}
	if err := (Config{DataDir: "/d", SnapshotDir: "/s", Capacity: -1}).Validate(); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("negative capacity: %v", err)
	}
}

func TestNSInitPath(t *testing.T) {
	dir := t.TempDir()
	if p := NSInitPath(dir); p != "" {
		t.Fatalf("no space-nsinit: %q", p)
	}
	if err := os.WriteFile(filepath.Join(dir, "space-nsinit"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if p := NSInitPath(dir); p != filepath.Join(dir, "space-nsinit") {
		t.Fatalf("NSInitPath = %q", p)
	}
}

// Every worker gets an ns substrate of its own (its own cgroup parent,
// which its Sweep owns); asking again gives the same one.
func TestNSPerWorker(t *testing.T) {
	testenv.RequireRoot(t, "the ns substrate needs root and cgroups")
	h, err := Open(Config{DataDir: t.TempDir(), SnapshotDir: t.TempDir(), NSNoDiskQuota: true})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	a, err := h.NS("w1")
	if err != nil {
		t.Fatal(err)
	}
	b, err := h.NS("w2")
	if err != nil {
		t.Fatal(err)
	}
	if again, _ := h.NS("w1"); again != a || a == b {
		t.Fatalf("w1 %p (again %p), w2 %p", a, again, b)
	}
	// One worker id on two data dirs (two platforms on one host): two
	// parents, so one's Sweep never ends the other's sandboxes.
	if p, q := NSCgroupParent("/a", "w1"), NSCgroupParent("/b", "w1"); p == q || !strings.HasPrefix(p, "space/w1.") {
		t.Fatalf("NSCgroupParent = %q and %q", p, q)
	}
	subs, err := h.Substrates("w2")
	if err != nil || len(subs) == 0 || subs[0] != substrate.Substrate(b) {
		t.Fatalf("Substrates(w2) = %v, %v", subs, err)
	}
}
