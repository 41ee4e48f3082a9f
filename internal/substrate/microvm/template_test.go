//go:build linux

package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/substrate"
)

// smapsRollup returns the named fields (kB) of /proc/<pid>/smaps_rollup.
func smapsRollup(t *testing.T, pid int) map[string]int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) == 3 && f[2] == "kB" {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			out[strings.TrimSuffix(f[0], ":")] = n
		}
	}
	return out
}

// TestTemplateClones: the first Start builds the template (boot, agent
// up, save without RAM, memfds sealed); every Start then clones it. Each
// clone takes its own identity at activation, has its own hostname, files
// and random numbers, shares the template's unchanged pages with the
// other clones, and can be saved and restored like any VM. Nobody can
// change a sealed template.
func TestTemplateClones(t *testing.T) {
	s, agent, ctx := agentSubstrate(t)
	base := t.TempDir()

	type clone struct {
		inst *instance
		a    *agentSession
	}
	start := func(name string) clone {
		r := testRoute(name)
		r.SandboxID = "clone" + name
		t0 := time.Now()
		inst, err := s.Start(ctx, substrate.Spec{Route: r, Template: "base", Dir: filepath.Join(base, name), AgentPath: agent})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { inst.Stop(context.Background()) })
		started := time.Since(t0)
		a := activate(t, ctx, inst, r)
		t.Logf("clone %s: Start %s, activated %s after Start began", name, started.Round(time.Millisecond), time.Since(t0).Round(time.Millisecond))
		return clone{inst.(*instance), a}
	}
	c1 := start("c1")
	s.tmplMu.Lock()
	if len(s.templates) != 1 {
		t.Fatalf("%d templates after the first Start, want 1", len(s.templates))
	}
	var tmpl *vmTemplate
	for _, slot := range s.templates {
		tmpl = slot.t
	}
	s.tmplMu.Unlock()
	if tmpl == nil {
		t.Fatal("no template was built: the first Start booted cold")
	}
	t.Logf("template built in %s", tmpl.took.Round(time.Millisecond))
	c2 := start("c2")

	// Own identity, hostname, files and random numbers.
	out1 := c1.a.run(t, ctx, "hostname; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; echo one > /tmp/f; cat /tmp/f")
	out2 := c2.a.run(t, ctx, "hostname; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; cat /tmp/f 2>/dev/null || echo none")
	f1, f2 := strings.Fields(out1), strings.Fields(out2)
	if len(f1) != 3 || len(f2) != 3 {
		t.Fatalf("outputs %q / %q", out1, out2)
	}
	if f1[0] != "clonec1" || f2[0] != "clonec2" {
		t.Errorf("hostnames %q, %q: want each clone's sandbox id", f1[0], f2[0])
	}
	if f1[1] == f2[1] || len(f1[1]) != 32 {
		t.Errorf("clones drew the same random bytes %q, %q", f1[1], f2[1])
	}
	if f1[2] != "one" || f2[2] != "none" {
		t.Errorf("files leak between clones: %q, %q", f1[2], f2[2])
	}

	// Pages of the template are shared: each clone's QEMU maps fewer
	// pages privately than it has resident, and its PSS is below its RSS.
	for i, c := range []clone{c1, c2} {
		m := smapsRollup(t, c.inst.pid)
		t.Logf("clone %d QEMU: Rss %d kB, Pss %d kB, Shared_Clean %d kB, Private_Dirty %d kB",
			i+1, m["Rss"], m["Pss"], m["Shared_Clean"], m["Private_Dirty"])
		if m["Shared_Clean"] == 0 || m["Pss"] >= m["Rss"] {
			t.Errorf("clone %d shares no template pages: %v", i+1, m)
		}
	}

	// A clone saves and restores like any VM (its RAM goes into the state).
	if err := c1.inst.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(base, "state")
	sf, err := os.Create(state)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c1.inst.SaveState(ctx, sf); err != nil {
		t.Fatal(err)
	}
	sf.Close()
	c1.a.close()
	if err := c1.inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	r3 := testRoute("c3")
	r3.SandboxID = "clonec1"
	r3.Generation = 2
	inst3, err := s.Start(ctx, substrate.Spec{Route: r3, Template: "base", Dir: filepath.Join(base, "c3"), AgentPath: agent, RestoreState: state})
	if err != nil {
		t.Fatal(err)
	}
	defer inst3.Stop(context.Background())
	a3 := activate(t, ctx, inst3, r3)
	if out := a3.run(t, ctx, "cat /tmp/f"); out != "one\n" {
		t.Fatalf("restored clone: %q", out)
	}

	// The sealed template refuses every change, even to root through a
	// fresh file description.
	for name, f := range map[string]*os.File{"ram": tmpl.ram, "state": tmpl.state} {
		w, err := os.OpenFile(procSelfFD(f), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.WriteAt([]byte("x"), 0); !errors.Is(err, unix.EPERM) {
			t.Errorf("%s: write: %v, want EPERM", name, err)
		}
		if err := w.Truncate(1); !errors.Is(err, unix.EPERM) {
			t.Errorf("%s: truncate: %v, want EPERM", name, err)
		}
		if err := unix.Fallocate(int(w.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, 4096); !errors.Is(err, unix.EPERM) {
			t.Errorf("%s: punch hole: %v, want EPERM", name, err)
		}
		if _, err := unix.Mmap(int(w.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); !errors.Is(err, unix.EPERM) {
			t.Errorf("%s: shared writable mmap: %v, want EPERM", name, err)
		}
		if _, err := unix.FcntlInt(w.Fd(), unix.F_ADD_SEALS, 0); !errors.Is(err, unix.EPERM) {
			t.Errorf("%s: seals can still change: %v", name, err)
		}
		w.Close()
	}
}

// A template is rebuilt when anything its state depends on changes: the
// image (kernel, modules, busybox, agent), the shape, the accelerator or
// the QEMU binary.
func TestTemplateKeyCoversItsInputs(t *testing.T) {
	dir := t.TempDir()
	qemu := filepath.Join(dir, "qemu")
	if err := os.WriteFile(qemu, []byte("qemu v1"), 0o755); err != nil {
		t.Fatal(err)
	}
	s := &Substrate{cfg: Config{QEMUPath: qemu}, accel: "tcg", sums: map[fileKey][32]byte{}}
	shape := machineShape{MemoryMiB: 256, VCPUs: 1}
	k, err := s.templateKey("img1", shape, nil)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]string{k: "base"}
	check := func(name string, key string, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		if prev, ok := seen[key]; ok {
			t.Fatalf("%s gives the same template key as %s", name, prev)
		}
		seen[key] = name
	}
	k2, err := s.templateKey("img2", shape, nil)
	check("another image", k2, err)
	k3, err := s.templateKey("img1", machineShape{MemoryMiB: 512, VCPUs: 1}, nil)
	check("another memory size", k3, err)
	k4, err := s.templateKey("img1", machineShape{MemoryMiB: 256, VCPUs: 2}, nil)
	check("another vCPU count", k4, err)
	s.accel = "kvm"
	k5, err := s.templateKey("img1", shape, nil)
	check("another accelerator", k5, err)
	s.accel = "tcg"
	time.Sleep(10 * time.Millisecond) // a new mtime for the memo
	if err := os.WriteFile(qemu, []byte("qemu v2"), 0o755); err != nil {
		t.Fatal(err)
	}
	k6, err := s.templateKey("img1", shape, nil)
	check("another QEMU binary", k6, err)
}
