//go:build linux

package microvm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

// TestAgentEnvReachesInit checks the quoting of the environment script
// with the same busybox sh the guest runs.
func TestAgentEnvScript(t *testing.T) {
	vals := []string{`plain`, `it's "quoted" $HOME \n`, "multi\nline", `'`, ``}
	var env []string
	for i, v := range vals {
		env = append(env, fmt.Sprintf("V%d=%s", i, v))
	}
	script, err := agentEnvScript(env)
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"1X=a", "A-B=c", "noequals", "X=a\x00b"} {
		if _, err := agentEnvScript([]string{bad}); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	sh := DefaultBusyboxPath
	if _, err := os.Stat(sh); err != nil {
		testenv.Skipf(t, "no busybox")
	}
	p := filepath.Join(t.TempDir(), "env")
	if err := os.WriteFile(p, script, 0o600); err != nil {
		t.Fatal(err)
	}
	for i, v := range vals {
		out, err := exec.Command(sh, "sh", "-c", fmt.Sprintf(`. %s && printf %%s "$V%d"`, p, i)).Output()
		if err != nil || string(out) != v {
			t.Errorf("V%d = %q, %v; want %q", i, out, err, v)
		}
	}
}

func grepLine(text, sub string) string {
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, sub) {
			return strings.TrimSpace(l)
		}
	}
	return ""
}

// TestStartFailureCleansUp: QEMU refusing to boot (busybox is no kernel)
// fails Start with QEMU's own words, and leaves no socket or uid behind.
func TestStartFailureCleansUp(t *testing.T) {
	cfg := testConfig(t)
	cfg.KernelPath = DefaultBusyboxPath
	cfg.Accel = "tcg" // forced: no probe, so Start itself meets the bad kernel
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	dir := filepath.Join(t.TempDir(), "f1")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err = s.Start(ctx, substrate.Spec{Route: testRoute("f1"), Template: "base", Dir: dir, AgentPath: DefaultBusyboxPath})
	if err == nil || !strings.Contains(err.Error(), "console tail") || !strings.Contains(err.Error(), "qemu-system-x86_64:") {
		t.Fatalf("Start with a bad kernel: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, SocketName)); !os.IsNotExist(err) {
		t.Errorf("socket left behind: %v", err)
	}
	if testenv.IsRoot() {
		l, err := leaseUID(cfg.UIDLockDir, cfg.UIDFirst, 1, 0)
		if err != nil {
			t.Fatalf("uid not released: %v", err)
		}
		l.release()
	}
	t.Logf("Start error: %v", err)
	// A spec for another substrate or with a relative dir never gets far.
	bad := substrate.Spec{Route: testRoute("f2"), Dir: "rel", AgentPath: DefaultBusyboxPath}
	if _, err := s.Start(ctx, bad); err == nil {
		t.Error("relative Dir accepted")
	}
	bad.Dir, bad.Route.Substrate = dir, identity.SubstrateNS
	if _, err := s.Start(ctx, bad); err == nil {
		t.Error("ns route accepted")
	}
}

// TestGuestDeathClosesDone: a guest kernel panic ends QEMU (panic=-1 and
// -no-reboot), Done closes and Stop still cleans up.
func TestGuestDeathClosesDone(t *testing.T) {
	cfg := testConfig(t)
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := filepath.Join(t.TempDir(), "d1")
	inst, err := s.Start(ctx, substrate.Spec{Route: testRoute("d1"), Template: "base", Dir: dir, AgentPath: DefaultBusyboxPath})
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Stop(context.Background())
	ch := dialChannel(t, inst)
	if r, err := ch.ask("x", 60*time.Second); err != nil || r != "1 x" {
		t.Fatalf("first reply %q, %v", r, err)
	}
	_, _ = ch.c.Write([]byte("sh echo c > /proc/sysrq-trigger\n"))
	select {
	case <-inst.Done():
	case <-time.After(20 * time.Second):
		r, err := ch.ask("y", 10*time.Second)
		t.Fatalf("QEMU still running after a guest panic (then %q, %v); console:\n%s", r, err, inst.(*instance).consoleTail(3000))
	}
	if err := inst.Resume(ctx); err == nil {
		t.Error("Resume after QEMU exited succeeded")
	}
	if err := inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, SocketName)); !os.IsNotExist(err) {
		t.Errorf("socket left behind: %v", err)
	}
	if !strings.Contains(inst.(*instance).consoleTail(8192), "sysrq") {
		t.Errorf("console.log lacks the panic: %s", inst.(*instance).consoleTail(500))
	}
}

// TestZeroFreedMemory: with init_on_free=1 the state of the same guest is
// much smaller (freed pages travel as zero pages) and the guest RAM is all
// resident on the host.
func TestZeroFreedMemory(t *testing.T) {
	cfg := testConfig(t)
	cfg.ZeroFreedMemory = true
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	inst, err := s.Start(ctx, substrate.Spec{Route: testRoute("z1"), Template: "base", Dir: filepath.Join(t.TempDir(), "z1"), AgentPath: DefaultBusyboxPath})
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Stop(context.Background())
	ch := dialChannel(t, inst)
	if r, err := ch.ask("sh cat /proc/cmdline", 60*time.Second); err != nil || !strings.Contains(r, "init_on_free=1") {
		t.Fatalf("cmdline %q, %v", r, err)
	}
	if err := inst.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	n, err := inst.(substrate.StateSaver).SaveState(ctx, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	rss, err := guestRAMResident(inst.InitPID(), DefaultMemoryBytes)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("init_on_free=1: state %.1f MiB in %s, guest RAM resident %d MiB", float64(n)/(1<<20), time.Since(t0).Round(time.Millisecond), rss>>20)
	if n > 75<<20 {
		t.Errorf("state of %d bytes: zeroed free pages should keep it under 75 MiB", n)
	}
}

func TestLeaseUID(t *testing.T) {
	dir := t.TempDir()
	a, err := leaseUID(dir, 5000, 2, 0)
	if err != nil {
		t.Fatal(err)
	}
	b, err := leaseUID(dir, 5000, 2, 0)
	if err != nil {
		t.Fatal(err)
	}
	if a.uid == b.uid {
		t.Fatalf("two leases got uid %d", a.uid)
	}
	if _, err := leaseUID(dir, 5000, 2, 1); err == nil {
		t.Fatal("a third lease in a range of two succeeded")
	}
	a.release()
	c, err := leaseUID(dir, 5000, 2, 0)
	if err != nil || c.uid != a.uid {
		t.Fatalf("released uid not leased again: %v %v", c, err)
	}
	b.release()
	c.release()
	c.release() // idempotent
}

// The probe boots a guest: TCG works on every host; KVM is tried where
// /dev/kvm exists and its outcome (booted, or why not) is reported. A
// "kernel" that is no kernel fails both, with the reason.
func TestAccelProbe(t *testing.T) {
	cfg := testConfig(t)
	cfg.Accel = "tcg" // New skips the probe; the test runs it
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	t0 := time.Now()
	if err := s.probe(ctx, "tcg", DefaultProbeTimeoutTCG); err != nil {
		t.Fatalf("tcg probe: %v", err)
	}
	t.Logf("tcg probe booted in %s", time.Since(t0).Round(time.Millisecond))
	if _, err := os.Stat(kvmDevice); err == nil {
		t0 = time.Now()
		err := s.probe(ctx, "kvm", DefaultProbeTimeout)
		t.Logf("kvm probe after %s: %v (nil: this host's KVM boots the guest kernel)", time.Since(t0).Round(time.Millisecond), err)
	} else {
		t.Logf("no %s: kvm not probed", kvmDevice)
	}

	bad := cfg
	bad.KernelPath = DefaultBusyboxPath
	bad.Accel = ""
	bad.ProbeTimeout, bad.ProbeTimeoutTCG = 2*time.Second, 5*time.Second
	sb, err := New(bad)
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	if sb.Accel() != "" || sb.Unavailable() == "" {
		t.Fatalf("a non-kernel probed as usable: accel %q", sb.Accel())
	}
	t.Logf("unavailable: %s", sb.Unavailable())
	_, err = sb.Start(ctx, substrate.Spec{Route: testRoute("a1"), Dir: t.TempDir(), AgentPath: DefaultBusyboxPath})
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "no working accelerator") {
		t.Fatalf("Start on an unavailable substrate: %v", err)
	}
}
