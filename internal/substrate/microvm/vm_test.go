//go:build linux

package microvm

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

// testConfig finds QEMU and the kernel `make vm-deps` extracts into the
// repository's .cache/vm/kernel, or skips.
func testConfig(t *testing.T) Config {
	t.Helper()
	if _, err := os.Stat(DefaultQEMUPath); err != nil {
		testenv.Skipf(t, "%s missing (make vm-deps installs it)", DefaultQEMUPath)
	}
	if _, err := os.Stat(DefaultBusyboxPath); err != nil {
		testenv.Skipf(t, "%s missing (make vm-deps installs busybox-static)", DefaultBusyboxPath)
	}
	kdir := filepath.Join(repoRoot(t), ".cache", "vm", "kernel")
	if _, err := os.Stat(filepath.Join(kdir, "vmlinuz")); err != nil {
		testenv.Skipf(t, "no guest kernel in %s (run make vm-deps)", kdir)
	}
	state := t.TempDir()
	return Config{
		StateDir:    state,
		KernelPath:  filepath.Join(kdir, "vmlinuz"),
		ModulesDir:  filepath.Join(kdir, "modules"),
		UIDLockDir:  filepath.Join(state, "uids"),
		StopTimeout: 3 * time.Second,
		testMode:    "counter",
		// The counter test loop runs no agent, so no template could become
		// ready: these tests boot cold; the agent's tests use templates.
		NoTemplates: true,
	}
}

// repoRoot is the directory of go.mod above the test's directory.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(root, "go.mod")); err == nil {
			return root
		}
		if root == "/" {
			t.Fatal("no go.mod above the test directory")
		}
		root = filepath.Dir(root)
	}
}

func testRoute(act string) identity.Route {
	return identity.Route{
		SandboxID: "vmtest01", Generation: 1, ExecutionID: "exec1", WorkerID: "w1",
		Substrate: identity.SubstrateMicroVM, ActivationID: act,
	}
}

// channel is a connection to the guest's test loop.
type channel struct {
	c  net.Conn
	rd *bufio.Reader
}

func dialChannel(t *testing.T, inst substrate.Instance) *channel {
	t.Helper()
	c, err := net.Dial("unix", inst.GuestSocket())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &channel{c: c, rd: bufio.NewReader(c)}
}

// ask sends line and returns the reply line, or an error after timeout.
func (ch *channel) ask(line string, timeout time.Duration) (string, error) {
	if _, err := ch.c.Write([]byte(line + "\n")); err != nil {
		return "", err
	}
	return ch.reply(timeout)
}

func (ch *channel) reply(timeout time.Duration) (string, error) {
	_ = ch.c.SetReadDeadline(time.Now().Add(timeout))
	s, err := ch.rd.ReadString('\n')
	return strings.TrimSpace(s), err
}

// TestVMLifecycleSaveRestore runs under every accelerator that boots the
// probe guest here (TCG everywhere, KVM too where it works).
func TestVMLifecycleSaveRestore(t *testing.T) {
	cfg := testConfig(t)
	for _, accel := range testAccels(t, cfg) {
		t.Run(accel, func(t *testing.T) {
			cfg := cfg
			cfg.Accel = accel
			testVMLifecycleSaveRestore(t, cfg)
		})
	}
}

// testAccels lists the accelerators whose probe boots here, best first
// (the probe is memoized per process).
func testAccels(t *testing.T, cfg Config) []string {
	t.Helper()
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var out []string
	for _, p := range s.Probes() {
		if p.Err == nil {
			out = append(out, p.Accel)
		} else {
			t.Logf("accelerator %s", p)
		}
	}
	if len(out) == 0 || out[len(out)-1] != "tcg" {
		// The probe stops at the first that boots: TCG is tried as well.
		ctx, cancel := context.WithTimeout(context.Background(), DefaultProbeTimeoutTCG)
		defer cancel()
		if err := s.probe(ctx, "tcg", DefaultProbeTimeoutTCG); err != nil {
			t.Fatalf("tcg probe: %v", err)
		}
		out = append(out, "tcg")
	}
	return out
}

func testVMLifecycleSaveRestore(t *testing.T, cfg Config) {
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	agent := DefaultBusyboxPath // the counter test mode never runs the agent
	base := t.TempDir()
	spec := substrate.Spec{
		Route: testRoute("a1"), Template: "base", Dir: filepath.Join(base, "a1"), AgentPath: agent,
		AgentEnv: []string{"SPACE_GUEST_CONFIG={\"x\":\"it's\"}"},
	}

	// Image build is measured apart from the boot.
	t0 := time.Now()
	if _, _, err := s.ensureImage(agent); err != nil {
		t.Fatal(err)
	}
	t.Logf("image build: %s (accel %s)", time.Since(t0).Round(time.Millisecond), s.Accel())

	t0 = time.Now()
	inst, err := s.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	started := time.Since(t0)
	defer inst.Stop(context.Background())
	ch := dialChannel(t, inst)
	// Bytes sent before the guest opens its port wait in the socket (QEMU
	// reads only what the guest can take), so one line suffices.
	if r, err := ch.ask("a", 60*time.Second); err != nil || r != "1 a" {
		t.Fatalf("first reply %q, %v; want %q; console:\n%s", r, err, "1 a", inst.(*instance).consoleTail(3000))
	}
	t.Logf("Start returned after %s; guest answered %s after Start began (%s)", started.Round(time.Millisecond),
		time.Since(t0).Round(time.Millisecond), grepLine(inst.(*instance).consoleTail(4096), "space-init: ready"))
	// What the init set up, seen from the guest.
	for _, q := range []struct{ cmd, want string }{
		{`echo "$SPACE_GUEST_CONFIG"`, `2 {"x":"it's"}`},
		{`hostname; id -u user; /bin/bash -c 'echo bash'; cat /sys/class/virtio-ports/vport0p1/name; readlink /dev/virtio-ports/space.0`,
			`3 vmtest01 1000 bash space.0 /dev/vport0p1`},
		{`echo $PATH; ls /sys/firmware/qemu_fw_cfg 2>&1 | wc -l; test -w /tmp && test -w / && echo writable`,
			`4 /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin 1 writable`},
	} {
		if r, err := ch.ask("sh "+q.cmd, 10*time.Second); err != nil || strings.TrimSpace(r) != q.want {
			t.Errorf("guest %q = %q, %v; want %q", q.cmd, r, err, q.want)
		}
	}
	// The clock: the RTC gives the date at boot, the host's TSC frequency
	// keeps it going.
	r, err := ch.ask("sh date +%s", 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var n, guestNow int64
	if _, err := fmt.Sscanf(r, "%d %d", &n, &guestNow); err != nil || n != 5 {
		t.Fatalf("date reply %q: %v", r, err)
	}
	if d := time.Now().Unix() - guestNow; d < -2 || d > 2 {
		t.Errorf("guest clock is %d s off the host's", d)
	}

	// The listener belongs to QEMU: a client's SO_PEERCRED names QEMU's pid
	// (and, as root, the instance's own uid).
	uc := ch.c.(*net.UnixConn)
	raw, _ := uc.SyscallConn()
	var cred *unix.Ucred
	_ = raw.Control(func(fd uintptr) { cred, err = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) })
	if err != nil {
		t.Fatal(err)
	}
	if int(cred.Pid) != inst.InitPID() {
		t.Errorf("listener peer pid %d, want QEMU's %d", cred.Pid, inst.InitPID())
	}
	if testenv.IsRoot() {
		vi := inst.(*instance)
		if cred.Uid != vi.uid.uid || cred.Uid < DefaultUIDFirst {
			t.Errorf("QEMU runs as uid %d, want its leased uid %d", cred.Uid, vi.uid.uid)
		}
	}

	// Pause: nothing comes back while stopped; Resume delivers it.
	t0 = time.Now()
	if err := inst.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	pauseTook := time.Since(t0)
	if r, err := ch.ask("c", 700*time.Millisecond); err == nil {
		t.Fatalf("paused guest answered %q", r)
	}
	t0 = time.Now()
	if err := inst.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	resumeTook := time.Since(t0)
	if r, err := ch.reply(10 * time.Second); err != nil || r != "6 c" {
		t.Fatalf("reply after resume %q, %v", r, err)
	}
	t.Logf("pause %s, resume %s", pauseTook.Round(time.Microsecond), resumeTook.Round(time.Microsecond))

	st, err := inst.(substrate.StatsReporter).Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.CPUCount != 1 || st.MemTotal != DefaultMemoryBytes || st.MemUsed <= 0 || st.MemUsed > st.MemTotal {
		t.Errorf("stats %+v", st)
	}
	if _, err := guestRAMResident(inst.InitPID(), st.MemTotal); err != nil {
		t.Errorf("guest RAM mapping not found: %v", err)
	}
	t.Logf("stats: %.1f%% of %d CPU, guest RAM resident %d MiB of %d MiB", st.CPUUsedPct, st.CPUCount, st.MemUsed>>20, st.MemTotal>>20)

	// SaveState needs a paused VM.
	saver := inst.(substrate.StateSaver)
	if _, err := saver.SaveState(ctx, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "paused") {
		t.Fatalf("SaveState on a running vm: %v", err)
	}
	if err := inst.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	statePath := filepath.Join(base, "state")
	f, err := os.Create(statePath)
	if err != nil {
		t.Fatal(err)
	}
	t0 = time.Now()
	size, err := saver.SaveState(ctx, f)
	if err != nil {
		t.Fatal(err)
	}
	saveTook := time.Since(t0)
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(statePath); fi.Size() != size {
		t.Fatalf("SaveState reported %d bytes, file has %d", size, fi.Size())
	}
	t.Logf("SaveState of a %d MiB guest: %d bytes (%.1f MiB) in %s", DefaultMemoryBytes>>20, size, float64(size)/(1<<20), saveTook.Round(time.Millisecond))

	// The source can continue after a save (postmigrate -> running).
	if err := inst.Resume(ctx); err != nil {
		t.Fatalf("resume after save: %v", err)
	}
	if r, err := ch.ask("d", 10*time.Second); err != nil || r != "7 d" {
		t.Fatalf("source after save: %q, %v", r, err)
	}
	t0 = time.Now()
	if err := inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("stop %s", time.Since(t0).Round(time.Millisecond))
	select {
	case <-inst.Done():
	default:
		t.Fatal("Done not closed after Stop")
	}
	if err := inst.Stop(ctx); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	if _, err := os.Stat(spec.Dir + "/" + SocketName); !os.IsNotExist(err) {
		t.Errorf("guest.sock left behind: %v", err)
	}
	if err := inst.Pause(ctx); err == nil {
		t.Error("Pause after Stop succeeded")
	}

	// Restore in another activation dir: the loop goes on counting from
	// the saved state (counter 6 at save time, "d" came after).
	spec2 := spec
	spec2.Route = testRoute("a2")
	spec2.Dir = filepath.Join(base, "a2")
	spec2.RestoreState = statePath
	t0 = time.Now()
	inst2, err := s.Start(ctx, spec2)
	if err != nil {
		t.Fatal(err)
	}
	restoreStart := time.Since(t0)
	defer inst2.Stop(context.Background())
	ch2 := dialChannel(t, inst2)
	r, err = ch2.ask("e", 30*time.Second)
	if err != nil || r != "7 e" {
		t.Fatalf("restored guest answered %q, %v; want \"7 e\" (console: %s)", r, err, inst2.(*instance).consoleTail(1000))
	}
	t.Logf("restore: Start returned after %s, first answer after %s", restoreStart.Round(time.Millisecond), time.Since(t0).Round(time.Millisecond))
	if err := inst2.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	// Mismatches are rejected before QEMU starts.
	spec3 := spec2
	spec3.Route = testRoute("a3")
	spec3.Dir = filepath.Join(base, "a3")
	spec3.Limits.MemoryBytes = 512 << 20
	if _, err := s.Start(ctx, spec3); err == nil || !strings.Contains(err.Error(), "256 MiB") {
		t.Errorf("restore with other memory: %v", err)
	}
	spec3.Limits = substrate.Limits{}
	tampered := filepath.Join(base, "tampered")
	rewriteHeader(t, statePath, tampered, func(h *stateHeader) { h.ImageID = strings.Repeat("0", 64) })
	spec3.RestoreState = tampered
	if _, err := s.Start(ctx, spec3); err == nil || !strings.Contains(err.Error(), "guest image") {
		t.Errorf("restore of another image: %v", err)
	}
	if err := os.WriteFile(tampered, []byte("not a state file at all"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Start(ctx, spec3); err == nil || !strings.Contains(err.Error(), "magic") {
		t.Errorf("restore of garbage: %v", err)
	}
}

// rewriteHeader copies a state file with its header changed by mut.
func rewriteHeader(t *testing.T, src, dst string, mut func(*stateHeader)) {
	t.Helper()
	f, h, err := openState(src)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mut(&h)
	hb, err := h.marshal()
	if err != nil {
		t.Fatal(err)
	}
	out, err := os.Create(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if _, err := out.Write(hb); err != nil {
		t.Fatal(err)
	}
	if _, err := out.ReadFrom(f); err != nil {
		t.Fatal(err)
	}
}
