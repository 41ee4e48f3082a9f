//go:build linux

package ns

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

func TestStartErrors(t *testing.T) {
	s := needRoot(t)
	ctx := context.Background()

	spec := newSpec(t, substrate.Limits{})
	spec.Route.Generation = 0
	if _, err := s.Start(ctx, spec); err == nil {
		t.Error("invalid route accepted")
	}
	spec = newSpec(t, substrate.Limits{})
	spec.Route.Substrate = identity.SubstrateMicroVM
	if _, err := s.Start(ctx, spec); err == nil {
		t.Error("microvm route accepted")
	}
	spec = newSpec(t, substrate.Limits{})
	spec.Route.ActivationID = "../x"
	if _, err := s.Start(ctx, spec); err == nil {
		t.Error("unsafe activation id accepted")
	}
	spec = newSpec(t, substrate.Limits{})
	spec.AgentPath = "/nonexistent/agent"
	if _, err := s.Start(ctx, spec); err == nil {
		t.Error("missing agent accepted")
	}
	spec = newSpec(t, substrate.Limits{})
	spec.Template = "nope"
	if _, err := s.Start(ctx, spec); !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), `template "nope" is not available on this worker`) {
		t.Errorf("unknown template: %v", err)
	}

	// A failure inside the init comes back as a clear error, and Start
	// cleans up after itself.
	spec = newSpec(t, substrate.Limits{})
	// (the sandbox's own layer holds a directory where the init writes
	// /etc/hosts).
	upper, release, err := s.PrepareLayer(ctx, spec.Dir, spec.Limits)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(upper, "etc", "hosts"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := release(); err != nil {
		t.Fatal(err)
	}
	_, err = s.Start(ctx, spec)
	if err == nil || !strings.Contains(err.Error(), "/etc/hosts") {
		t.Fatalf("want the init's /etc/hosts error, got %v", err)
	}
	t.Logf("init error: %v", err)
	cgName := spec.Route.SandboxID + "-" + spec.Route.ActivationID
	if s.cgroups.v2 {
		if _, err := os.Stat(filepath.Join(s.cgroups.unified, s.cfg.CgroupParent, cgName)); !os.IsNotExist(err) {
			t.Errorf("cgroup left after failed start: %v", err)
		}
	} else {
		for _, mnt := range s.cgroups.v1 {
			if _, err := os.Stat(filepath.Join(mnt, s.cfg.CgroupParent, cgName)); !os.IsNotExist(err) {
				t.Errorf("cgroup left after failed start: %v", err)
			}
		}
	}
	if _, err := os.Lstat(filepath.Join(spec.Dir, SocketName)); !os.IsNotExist(err) {
		t.Errorf("socket left after failed start: %v", err)
	}

	// An agent that exits at once: Done closes, Stop still cleans up.
	spec = newSpec(t, substrate.Limits{})
	spec.AgentPath = "/usr/bin/true"
	in, err := s.Start(ctx, spec)
	if err == nil {
		select {
		case <-in.Done():
		case <-time.After(10 * time.Second):
			t.Error("Done not closed after the agent exited")
		}
		stopAndCheck(t, in.(*instance))
	}
}

func TestRestartOnSameDirKeepsUpper(t *testing.T) {
	s := needRoot(t)
	spec := newSpec(t, substrate.Limits{})
	ctx := context.Background()
	in, err := s.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	mustOK(t, in, 1000, "echo persisted > /home/user/p")
	stopAndCheck(t, in.(*instance))
	spec.Route.ActivationID = randID(4)
	in2, err := s.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer stopAndCheck(t, in2.(*instance))
	if out := mustOK(t, in2, 0, "cat /home/user/p"); out != "persisted\n" {
		t.Fatalf("got %q", out)
	}
}

func BenchmarkStart(b *testing.B) {
	s := needRoot(b)
	ctx := context.Background()
	var startTotal, stopTotal time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		spec := newSpec(b, substrate.Limits{})
		t0 := time.Now()
		in, err := s.Start(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := in.Stop(ctx); err != nil {
			b.Fatal(err)
		}
		startTotal += t1.Sub(t0)
		stopTotal += time.Since(t1)
	}
	b.ReportMetric(float64(startTotal.Microseconds())/1000/float64(b.N), "start-ms/op")
	b.ReportMetric(float64(stopTotal.Microseconds())/1000/float64(b.N), "stop-ms/op")
}

func TestConcurrentStarts(t *testing.T) {
	needRoot(t)
	const n = 4
	var wg sync.WaitGroup
	insts := make([]*instance, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := testSub
			spec := newSpec(t, substrate.Limits{})
			in, err := s.Start(context.Background(), spec)
			if err != nil {
				t.Errorf("Start %d: %v", i, err)
				return
			}
			insts[i] = in.(*instance)
		}()
	}
	wg.Wait()
	for _, in := range insts {
		if in == nil {
			continue
		}
		if out := mustOK(t, in, 0, "cat /proc/sys/kernel/hostname"); strings.TrimSpace(out) != in.Route().SandboxID {
			t.Errorf("hostname %q for %s", out, in.Route().SandboxID)
		}
	}
	for _, in := range insts {
		if in != nil {
			stopAndCheck(t, in)
		}
	}
}

// With Config.InitPath the init is that binary (cmd/space-nsinit), not a
// re-execution of the hosting one; the sandbox is the same.
func TestInitPath(t *testing.T) {
	needRoot(t)
	if err := (Config{StateDir: testState, InitPath: "space-nsinit"}).Validate(); err == nil {
		t.Fatal("relative InitPath accepted")
	}
	initBin := filepath.Join(t.TempDir(), "space-nsinit")
	if out, err := exec.Command("go", "build", "-o", initBin, "github.com/spacesbx/space/cmd/space-nsinit").CombinedOutput(); err != nil {
		t.Fatalf("build space-nsinit: %v\n%s", err, out)
	}
	_, inst, spec := startWith(t, Config{StateDir: testState, InitPath: initBin})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if out := mustOK(t, inst, 0, "cat /proc/sys/kernel/hostname"); strings.TrimSpace(out) != spec.Route.SandboxID {
		t.Errorf("hostname %q", out)
	}
	// The init is InitPath's binary: without one there, no start.
	gone, err := New(Config{StateDir: testState, InitPath: initBin + ".missing"})
	if err != nil {
		t.Fatal(err)
	}
	defer gone.Close()
	if in, err := gone.Start(ctx, newSpec(t, substrate.Limits{})); err == nil {
		stopAndCheck(t, in.(*instance))
		t.Fatal("started without its init binary")
	}
}
