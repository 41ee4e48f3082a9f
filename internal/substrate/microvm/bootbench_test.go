//go:build linux && bootbench

package microvm

// The boot-time measurement of image VMs against busybox ones: a
// measurement, not a check, so it is built only with -tags bootbench:
//
//	go test -tags bootbench -run TestImageBootTime -v ./internal/substrate/microvm/ -args -microvm.bootbench=5 [-microvm.bootbench.debian]

import (
	"context"
	"flag"
	"fmt"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/substrate"
)

var (
	bootBench       = flag.Int("microvm.bootbench", 3, "cold boots per kind for TestImageBootTime ")
	bootBenchDebian = flag.Bool("microvm.bootbench.debian", false, "TestImageBootTime boots the Debian base instead of the test image")
)

// TestImageBootTime compares cold boots and template clones (Start to the
// agent's ACK) of a busybox VM and an image VM; run with
// -args -microvm.bootbench=N (and -microvm.bootbench.debian for the
// Debian base instead of the small test image).
func TestImageBootTime(t *testing.T) {
	s, agent, ctx := agentSubstrate(t)
	s.cfg.NoTemplates = true
	s.cfg.RootDiskDir = filepath.Join(t.TempDir(), "vm-images")
	img := testImage(t, t.TempDir())
	if *bootBenchDebian {
		img = debianBase(t)
		s.cfg.RootDiskDir = DefaultRootDiskDir
	}
	if _, err := s.ensureRootDisk(img); err != nil {
		t.Fatal(err)
	}
	base := t.TempDir()
	boot := func(name string, image *substrate.Image) time.Duration {
		sp := substrate.Spec{Route: testRoute(name), Template: "base", Dir: filepath.Join(base, name), AgentPath: agent, Image: image}
		t0 := time.Now()
		inst, err := s.Start(ctx, sp)
		if err != nil {
			t.Fatal(err)
		}
		defer inst.Stop(context.Background())
		started := time.Since(t0)
		a := activate(t, ctx, inst, sp.Route)
		d := time.Since(t0)
		a.close()
		t.Logf("%s: Start returned after %s, ACK after %s (%s)", name, started.Round(time.Millisecond), d.Round(time.Millisecond), initReady(inst))
		return d
	}
	measure := func(kind string) {
		var bb, im []time.Duration
		for i := range *bootBench {
			bb = append(bb, boot(fmt.Sprintf("%sbb%d", kind[:2], i), nil))
			im = append(im, boot(fmt.Sprintf("%sim%d", kind[:2], i), img))
		}
		slices.Sort(bb)
		slices.Sort(im)
		mb, mi := bb[len(bb)/2], im[len(im)/2]
		t.Logf("%s to ACK (accel %s), median of %d: busybox %s, image %s, ratio %.2f; all busybox %v, image %v",
			kind, s.Accel(), *bootBench, mb.Round(time.Millisecond), mi.Round(time.Millisecond), float64(mi)/float64(mb), bb, im)
	}
	measure("cold boot")
	// Creates as the worker makes them: clones of a template (built by
	// a first start of each kind, not counted).
	s.cfg.NoTemplates = false
	boot("tbb", nil)
	boot("tim", img)
	measure("clone")
}
