//go:build linux

package ns

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/testenv"
)

// TestSpareDisk: after a start, a layer disk is made ahead of time; the
// next new activation directory takes it (its image moved there, the
// spare's name gone), with nothing of another sandbox in it, and Close
// leaves no spare image behind.
func TestSpareDisk(t *testing.T) {
	s, first, _ := startWith(t, Config{StateDir: filepath.Join(t.TempDir(), "state")})
	if !s.quota {
		testenv.Skipf(t, "no disk quota here: %s", diskQuotaUnsupported())
	}
	mustOK(t, first, 0, "echo first > /root/f")
	var spareImg string
	for deadline := time.Now().Add(10 * time.Second); spareImg == ""; {
		s.spareMu.Lock()
		if s.spare != nil {
			spareImg = s.spare.disk.img
		}
		s.spareMu.Unlock()
		if time.Now().After(deadline) {
			t.Fatal("no spare disk was made after a start")
		}
		time.Sleep(10 * time.Millisecond)
	}
	spec := newSpec(t, first.lim)
	release, err := s.acquireLayer(spec.Dir, first.lim.DiskBytes)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(spareImg); !os.IsNotExist(err) {
		t.Fatalf("the spare's image is still at %s (not taken): %v", spareImg, err)
	}
	// Its loop device names the activation's image (what Reclaim and the
	// next mount's wait look for), not the spare's old name.
	s.layerMu.Lock()
	loop := s.layers[spec.Dir].disk.Device()
	s.layerMu.Unlock()
	if img := filepath.Join(spec.Dir, DiskImageName); !loopBacks(loop, img) || loopBacking(img) != loop {
		b, _ := os.ReadFile(filepath.Join("/sys/block", filepath.Base(loop), "loop", "backing_file"))
		t.Fatalf("%s backs %q, not %s", loop, b, img)
	}
	upper := s.LayerDir(spec.Dir)
	if _, err := os.Stat(filepath.Join(upper, "root/f")); !os.IsNotExist(err) {
		t.Fatalf("the taken disk holds another sandbox's file: %v", err)
	}
	if err := os.WriteFile(filepath.Join(upper, "x"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := release(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(spec.Dir, DiskImageName)); err != nil {
		t.Fatalf("the taken disk's image is not in the activation dir: %v", err)
	}
	s.Close()
	if ents, _ := os.ReadDir(s.spareDir()); len(ents) != 0 {
		t.Fatalf("spare images left after Close: %v", ents)
	}
}
