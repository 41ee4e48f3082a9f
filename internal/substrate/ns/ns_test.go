//go:build linux

package ns

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

var (
	agentPath string // built by TestMain when root
	testState string
	subOnce   sync.Once
	testSub   *Substrate
	subErr    error
)

func TestMain(m *testing.M) {
	MaybeInit() // the test binary is also the sandbox init
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	if testenv.IsRoot() {
		tmp, err := os.MkdirTemp("", "space-ns-test-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(tmp)
		testState = filepath.Join(tmp, "state")
		agentPath = filepath.Join(tmp, "agent")
		build := exec.Command("go", "build", "-o", agentPath, "./testdata/agent")
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "build test agent: %v\n%s", err, out)
			return 1
		}
	} else {
		fmt.Println(testenv.SkipPrefix + ": ns integration tests (they need root)")
	}
	code := m.Run()
	if testSub != nil {
		_ = testSub.Close()
		removeEmptyCgroupParents(testSub)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			return 1
		}
	}
	return code
}

// removeEmptyCgroupParents removes the <parent> groups the tests created
// (only if empty: another process's sandboxes may live there).
func removeEmptyCgroupParents(s *Substrate) {
	if s.cgroups.v2 {
		_ = syscall.Rmdir(filepath.Join(s.cgroups.unified, s.cfg.CgroupParent))
		return
	}
	for _, mnt := range s.cgroups.v1 {
		_ = syscall.Rmdir(filepath.Join(mnt, s.cfg.CgroupParent))
	}
}

func needRoot(tb testing.TB) *Substrate {
	tb.Helper()
	testenv.RequireRoot(tb, "namespaces, cgroups, mounts")
	subOnce.Do(func() {
		testSub, subErr = New(Config{StateDir: testState})
	})
	if subErr != nil {
		tb.Fatalf("New: %v", subErr)
	}
	return testSub
}

func randID(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func newSpec(tb testing.TB, lim substrate.Limits) substrate.Spec {
	return substrate.Spec{
		Route: identity.Route{
			SandboxID:    "sbx" + randID(4),
			Generation:   1,
			ExecutionID:  randID(8),
			WorkerID:     "w1",
			Substrate:    identity.SubstrateNS,
			ActivationID: randID(4),
		},
		Template:  TemplateBase,
		Dir:       tb.TempDir(),
		AgentPath: agentPath,
		AgentEnv:  []string{"SPACE_TEST=1"},
		Limits:    lim,
	}
}

// start starts a sandbox and registers a Stop + cleanup check.
func start(tb testing.TB, lim substrate.Limits) (*instance, substrate.Spec) {
	tb.Helper()
	s := needRoot(tb)
	spec := newSpec(tb, lim)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	in, err := s.Start(ctx, spec)
	if err != nil {
		tb.Fatalf("Start: %v", err)
	}
	inst := in.(*instance)
	tb.Cleanup(func() { stopAndCheck(tb, inst) })
	return inst, spec
}

// startWith starts a sandbox on a substrate of its own made from cfg
// (closed, with the sandbox stopped and checked, when the test ends).
func startWith(t *testing.T, cfg Config) (*Substrate, *instance, substrate.Spec) {
	t.Helper()
	needRoot(t)
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	spec := newSpec(t, substrate.Limits{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	in, err := s.Start(ctx, spec)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	inst := in.(*instance)
	t.Cleanup(func() { stopAndCheck(t, inst) })
	return s, inst, spec
}

// stopAndCheck stops inst and verifies that nothing is left behind.
func stopAndCheck(tb testing.TB, inst *instance) {
	tb.Helper()
	dirs := append([]string(nil), inst.cg.dirs...)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := inst.Stop(ctx); err != nil {
		tb.Fatalf("Stop: %v", err)
	}
	if err := inst.Stop(ctx); err != nil {
		tb.Fatalf("second Stop: %v", err)
	}
	select {
	case <-inst.Done():
	default:
		tb.Error("Done not closed after Stop")
	}
	for _, d := range dirs {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			tb.Errorf("cgroup %s still exists (%v)", d, err)
		}
	}
	if err := syscall.Kill(inst.InitPID(), 0); err != syscall.ESRCH {
		tb.Errorf("init pid %d still exists: %v", inst.InitPID(), err)
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		tb.Fatal(err)
	}
	if strings.Contains(string(mi), inst.dir) {
		tb.Errorf("host mountinfo mentions %s:\n%s", inst.dir, mi)
	}
	if _, err := os.Lstat(inst.GuestSocket()); !os.IsNotExist(err) {
		tb.Errorf("socket left behind: %v", err)
	}
	for _, gone := range []string{rootfsDir} {
		if _, err := os.Lstat(filepath.Join(inst.dir, gone)); !os.IsNotExist(err) {
			tb.Errorf("%s left behind: %v", gone, err)
		}
	}
	// The writable layer is kept: its disk image, or its directory.
	kept := filepath.Join(inst.dir, DiskMountName, diskUpperDir)
	if inst.s.quota {
		kept = filepath.Join(inst.dir, DiskImageName)
		if ok, _ := isMountPoint(filepath.Join(inst.dir, DiskMountName)); ok {
			tb.Errorf("layer disk still mounted after Stop")
		}
	}
	if _, err := os.Stat(kept); err != nil {
		tb.Errorf("writable layer not kept: %v", err)
	}
}

type result struct {
	Out  string `json:"out"`
	Code int    `json:"code"`
}

// sh runs cmd in the sandbox as uid through the test agent.
func sh(tb testing.TB, inst substrate.Instance, uid int, cmd string) result {
	tb.Helper()
	r, err := shTimeout(inst, uid, cmd, 0)
	if err != nil {
		tb.Fatalf("run %q: %v", cmd, err)
	}
	return r
}

func shTimeout(inst substrate.Instance, uid int, cmd string, timeout time.Duration) (result, error) {
	c, err := net.DialTimeout("unix", inst.GuestSocket(), 5*time.Second)
	if err != nil {
		return result{}, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout + 30*time.Second))
	b, _ := json.Marshal(map[string]any{"cmd": cmd, "uid": uid, "timeout_ms": timeout.Milliseconds()})
	if _, err := c.Write(append(b, '\n')); err != nil {
		return result{}, err
	}
	line, err := bufio.NewReader(c).ReadBytes('\n')
	if err != nil {
		return result{}, err
	}
	var r result
	if err := json.Unmarshal(line, &r); err != nil {
		return result{}, fmt.Errorf("%w: %q", err, line)
	}
	return r, nil
}

func mustOK(tb testing.TB, inst substrate.Instance, uid int, cmd string) string {
	tb.Helper()
	r := sh(tb, inst, uid, cmd)
	if r.Code != 0 {
		tb.Fatalf("%q: exit %d: %s", cmd, r.Code, r.Out)
	}
	return r.Out
}

func mustFail(tb testing.TB, inst substrate.Instance, uid int, cmd string) string {
	tb.Helper()
	r := sh(tb, inst, uid, cmd)
	if r.Code == 0 {
		tb.Fatalf("%q unexpectedly succeeded: %s", cmd, r.Out)
	}
	return r.Out
}

func TestSandboxIsolation(t *testing.T) {
	inst, spec := start(t, substrate.Limits{})

	t.Run("echo", func(t *testing.T) {
		if out := mustOK(t, inst, 0, "echo hello"); out != "hello\n" {
			t.Fatalf("got %q", out)
		}
	})
	t.Run("hostname", func(t *testing.T) {
		if out := strings.TrimSpace(mustOK(t, inst, 0, "cat /proc/sys/kernel/hostname")); out != spec.Route.SandboxID {
			t.Fatalf("hostname %q, want %q", out, spec.Route.SandboxID)
		}
	})
	t.Run("uid", func(t *testing.T) {
		if out := mustOK(t, inst, 1000, "id -u; id -g; echo $HOME; touch ~/f && echo ok"); out != "1000\n1000\n/home/user\nok\n" {
			t.Fatalf("got %q", out)
		}
		if out := mustOK(t, inst, 0, "id -u"); out != "0\n" {
			t.Fatalf("got %q", out)
		}
		mustFail(t, inst, 1000, "ls /root")
	})
	t.Run("host files", func(t *testing.T) {
		marker := "/root/space-ns-marker-" + randID(4)
		if err := os.WriteFile(marker, []byte("host secret"), 0o600); err != nil {
			t.Fatal(err)
		}
		defer os.Remove(marker)
		mustFail(t, inst, 0, "cat "+marker)
		mustFail(t, inst, 0, "test -e /etc/shadow || test -e /etc/gshadow")
		mustFail(t, inst, 0, "ls /etc/ssh /etc/sudoers /etc/machine-id 2>&1")
		if out := mustOK(t, inst, 0, "cat /etc/passwd"); out != basePasswd {
			t.Fatalf("/etc/passwd is not the generated one:\n%s", out)
		}
		mustFail(t, inst, 0, "test -e "+inst.GuestSocket())
		mustFail(t, inst, 0, "test -e "+spec.Dir)
		mustFail(t, inst, 0, "test -e /sys/kernel")
		// /usr is read-only, /proc/sys too.
		mustFail(t, inst, 0, "touch /usr/bin/space-x")
		mustFail(t, inst, 0, "echo 1 > /proc/sys/kernel/panic")
		mustFail(t, inst, 0, "echo b > /proc/sysrq-trigger")
		// The writable layer: what root writes lands in the layer.
		if out := mustOK(t, inst, 0, "echo data > /root/note && stat -c %a /tmp /var/tmp /dev/shm /root"); out != "1777\n1777\n1777\n700\n" {
			t.Fatalf("modes: %q", out)
		}
		if b, err := os.ReadFile(filepath.Join(inst.LayerDir(), "root", "note")); err != nil || string(b) != "data\n" {
			t.Fatalf("upper layer: %q %v", b, err)
		}
		// A device node made with CAP_MKNOD is inert (nodev).
		out := mustFail(t, inst, 0, "mknod /tmp/mem c 1 1 && head -c1 /tmp/mem")
		t.Logf("mknod+read: %s", out)
	})
	t.Run("processes", func(t *testing.T) {
		out := mustOK(t, inst, 0, "ls /proc | grep -c '^[0-9][0-9]*$'")
		n, _ := strconv.Atoi(strings.TrimSpace(out))
		if n < 2 || n > 6 {
			t.Fatalf("sandbox sees %d processes", n)
		}
		if pid := os.Getpid(); pid > 50 {
			mustFail(t, inst, 0, fmt.Sprintf("test -e /proc/%d", pid))
		}
		if out := mustOK(t, inst, 0, "cat /proc/1/cmdline | tr '\\0' ' '"); out != "spaced-guest " {
			t.Fatalf("pid 1 is %q", out)
		}
	})
	t.Run("network", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		var accepted int
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				accepted++
				c.Close()
			}
		}()
		port := l.Addr().(*net.TCPAddr).Port
		mustFail(t, inst, 0, fmt.Sprintf("bash -c 'echo hi > /dev/tcp/127.0.0.1/%d'", port))
		mustFail(t, inst, 0, "bash -c 'echo hi > /dev/tcp/1.1.1.1/80'")
		l.Close()
		wg.Wait()
		if accepted != 0 {
			t.Fatalf("host listener accepted %d connections from the sandbox", accepted)
		}
		out := mustOK(t, inst, 0, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
		if out != "lo\n" {
			t.Fatalf("interfaces: %q", out)
		}
	})
	t.Run("seccomp and caps", func(t *testing.T) {
		mustFail(t, inst, 0, "mount -t tmpfs x /mnt")
		mustFail(t, inst, 0, "unshare -n true")
		mustFail(t, inst, 0, "unshare -U true")
		mustFail(t, inst, 0, "unshare -m true")
		// pidfd_getfd on the agent (pid 1: its listener is fd 3), kcmp and
		// process_madvise are refused with EPERM.
		const attack = `python3 -c "
import ctypes
l = ctypes.CDLL(None, use_errno=True)
pfd = l.syscall(434, 1, 0)
r = []
for nr, args in ((438, (pfd, 3, 0)), (312, (1, 1, 0, 3, 3)), (440, (pfd, 0, 0, 0, 0))):
    ctypes.set_errno(0)
    r.append((l.syscall(nr, *args), ctypes.get_errno()))
print(pfd >= 0, r)
"`
		if out := mustOK(t, inst, 0, attack); out != "True [(-1, 1), (-1, 1), (-1, 1)]\n" {
			t.Fatalf("pidfd_getfd/kcmp/process_madvise: %q", out)
		}
		out := mustOK(t, inst, 0, "grep -E '^(CapBnd|CapEff|CapInh|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status")
		want := fmt.Sprintf("%016x", allowedCapMask())
		// In a user namespace no_new_privs stays off so that sudo works
		// (a set-uid binary makes a process root in that namespace only).
		nnp := "NoNewPrivs:\t1"
		if inst.uids != nil {
			nnp = "NoNewPrivs:\t0"
		}
		for _, w := range []string{"CapBnd:\t" + want, "CapEff:\t" + want, "CapInh:\t0000000000000000", "CapAmb:\t0000000000000000", nnp, "Seccomp:\t2"} {
			if !strings.Contains(out, w) {
				t.Errorf("status lacks %q:\n%s", w, out)
			}
		}
		out = mustOK(t, inst, 1000, "grep -E '^(CapEff|CapPrm):' /proc/self/status")
		if strings.Count(out, "0000000000000000") != 2 {
			t.Errorf("uid 1000 has capabilities:\n%s", out)
		}
	})
	t.Run("pty", func(t *testing.T) {
		// Opening the private devpts instance's ptmx allocates pts 0.
		if out := mustOK(t, inst, 1000, "exec 3<>/dev/ptmx; ls /dev/pts; stat -c '%a %g' /dev/pts/0"); out != "0\nptmx\n620 5\n" {
			t.Fatalf("got %q", out)
		}
	})
}

func TestTwoSandboxesDoNotShareFiles(t *testing.T) {
	a, _ := start(t, substrate.Limits{})
	b, _ := start(t, substrate.Limits{})
	mustOK(t, a, 1000, "echo a-secret > /home/user/secret && echo x > /tmp/x")
	mustFail(t, b, 0, "cat /home/user/secret")
	mustFail(t, b, 0, "test -e /tmp/x")
	if a.InitPID() == b.InitPID() {
		t.Fatal("same init")
	}
}

func TestMemoryLimit(t *testing.T) {
	inst, _ := start(t, substrate.Limits{MemoryBytes: 64 << 20})
	r := sh(t, inst, 0, "head -c 1000m /dev/zero | tail")
	if r.Code != 128+int(syscall.SIGKILL) {
		t.Fatalf("memory hog: exit %d: %s", r.Code, r.Out)
	}
	mustOK(t, inst, 0, "echo still alive")
	if !inst.cg.v2 {
		b, err := os.ReadFile(filepath.Join(inst.cg.dirs[0], "memory.oom_control"))
		if err != nil || !strings.Contains(string(b), "oom_kill ") || strings.Contains(string(b), "oom_kill 0") {
			t.Errorf("memory.oom_control %q %v", b, err)
		}
	} else {
		b, err := os.ReadFile(filepath.Join(inst.cg.dirs[0], "memory.events"))
		if err != nil || strings.Contains(string(b), "oom_kill 0") {
			t.Errorf("memory.events %q %v", b, err)
		}
	}
}

// pidsDir is the user group in the pids hierarchy.
func pidsDir(inst *instance) string { return inst.cg.userDir }

func TestPidsLimit(t *testing.T) {
	inst, _ := start(t, substrate.Limits{Pids: 64})
	dir := pidsDir(inst)
	stop := make(chan struct{})
	var maxSeen int
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			b, err := os.ReadFile(filepath.Join(dir, "pids.current"))
			if err != nil {
				continue
			}
			if n, _ := strconv.Atoi(strings.TrimSpace(string(b))); n > maxSeen {
				maxSeen = n
			}
		}
	}()
	_, err := shTimeout(inst, 1000, "f() { f | f & }; f; sleep 3", 3*time.Second)
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatalf("fork bomb: %v", err)
	}
	if maxSeen > 64 {
		t.Fatalf("pids.current reached %d > 64", maxSeen)
	}
	ev, _ := os.ReadFile(filepath.Join(dir, "pids.events"))
	t.Logf("max pids seen %d; pids.events %q", maxSeen, strings.TrimSpace(string(ev)))
	if !strings.Contains(string(ev), "max") || strings.Contains(string(ev), "max 0") {
		t.Errorf("pids limit never hit: %q", ev)
	}
	// The bomb's group was killed by the agent; the sandbox recovers.
	deadline := time.Now().Add(10 * time.Second)
	for {
		r, err := shTimeout(inst, 0, "echo ok", 5*time.Second)
		if err == nil && r.Code == 0 && r.Out == "ok\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox did not recover: %v %+v", err, r)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func readCounter(t *testing.T, path string) int {
	t.Helper()
	for i := 0; i < 100; i++ {
		b, err := os.ReadFile(path)
		if err == nil {
			if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
				return n
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no counter at %s", path)
	return 0
}

func TestPauseResume(t *testing.T) {
	inst, _ := start(t, substrate.Limits{})
	mustOK(t, inst, 1000, `setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.02; done' </dev/null >/dev/null 2>&1 & while [ ! -s /tmp/counter ]; do sleep 0.01; done; sleep 0.1`)
	// The loop renames each value into place: a freeze between truncate and
	// write would otherwise leave the file empty.
	counter := filepath.Join(inst.LayerDir(), "tmp", "counter")
	time.Sleep(200 * time.Millisecond)
	c0 := readCounter(t, counter)
	ctx := context.Background()
	if err := inst.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	c1 := readCounter(t, counter)
	time.Sleep(300 * time.Millisecond)
	if c2 := readCounter(t, counter); c2 != c1 {
		t.Fatalf("counter advanced while paused: %d -> %d", c1, c2)
	}
	// A paused agent accepts (kernel backlog) but does not answer.
	if _, err := shTimeout(inst, 0, "true", -29500*time.Millisecond); err == nil {
		t.Fatal("paused agent answered")
	}
	if err := inst.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if c3 := readCounter(t, counter); c3 <= c1 {
		t.Fatalf("counter did not advance after resume: %d (before pause %d)", c3, c0)
	}
	mustOK(t, inst, 0, "true")
	// Stop works on a paused sandbox (stopAndCheck runs in cleanup).
	if err := inst.Pause(ctx); err != nil {
		t.Fatal(err)
	}
}

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
	if _, err := s.Start(ctx, spec); err == nil {
		t.Error("unknown template accepted")
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

// TestAgentCgroupLayout checks the split: the user group carries the
// sandbox's pids limit and holds the user's processes, the agent (the init)
// lives in agent.<name> with its own reserve; Stop removes both (the
// cleanup check in start).
func TestAgentCgroupLayout(t *testing.T) {
	inst, spec := start(t, substrate.Limits{Pids: 64})
	name := spec.Route.SandboxID + "-" + spec.Route.ActivationID
	user := inst.cg.userDir
	agent := filepath.Join(filepath.Dir(user), agentGroupPrefix+name)
	if filepath.Base(user) != name {
		t.Fatalf("user group %s, want .../%s", user, name)
	}
	if got := strings.TrimSpace(readFile(t, filepath.Join(user, "pids.max"))); got != "64" {
		t.Fatalf("user pids.max %q, want 64", got)
	}
	if got := strings.TrimSpace(readFile(t, filepath.Join(agent, "pids.max"))); got != strconv.Itoa(agentPids) {
		t.Fatalf("agent pids.max %q, want %d", got, agentPids)
	}
	if !slices.Contains(inst.cg.dirs, agent) {
		t.Fatalf("agent group %s not among %v", agent, inst.cg.dirs)
	}
	initPid := strconv.Itoa(inst.InitPID())
	if procs := strings.Fields(readFile(t, filepath.Join(agent, "cgroup.procs"))); !slices.Equal(procs, []string{initPid}) {
		t.Fatalf("agent group procs %v, want [%s]", procs, initPid)
	}
	// A user command runs in the user group (seen from the sandbox's cgroup
	// namespace, rooted at the agent's groups, it is a sibling), the init
	// never leaves the agent's.
	out := mustOK(t, inst, 1000, "cat /proc/self/cgroup")
	want := "/../" + name
	ok := false
	for _, line := range strings.Split(out, "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) == 3 && (f[1] == "pids" || (inst.cg.v2 && f[0] == "0")) {
			ok = f[2] == want
		}
	}
	if !ok {
		t.Fatalf("user command's cgroups:\n%s\nwant pids at %s", out, want)
	}
	if procs := strings.Fields(readFile(t, filepath.Join(agent, "cgroup.procs"))); !slices.Equal(procs, []string{initPid}) {
		t.Fatalf("agent group procs after a command %v, want [%s]", procs, initPid)
	}
}

// TestForkBombKeepsAgentReserve: while a user fork bomb holds the user
// group at its pids.max, the agent still creates threads and processes and
// starts new commands (moved into the full group: migration is not limited),
// several at once.
func TestForkBombKeepsAgentReserve(t *testing.T) {
	inst, _ := start(t, substrate.Limits{Pids: 64})
	user := inst.cg.userDir
	bomb := make(chan error, 1)
	var bombOut result
	go func() {
		// Forks until the group is full and holds it there: a classic bomb's
		// population swings as its processes exit (on a loaded machine it
		// may never sit at the limit while it is sampled), and a shell that
		// cannot fork exits, taking its group with it.
		const hold = `python3 -c "
import os, time
while True:
    try:
        if os.fork() == 0:
            time.sleep(8)
            os._exit(0)
    except OSError:
        break
time.sleep(6)
"`
		r, err := shTimeout(inst, 1000, hold, 7*time.Second)
		bombOut = r
		bomb <- err
	}()
	// Generous: on a loaded 2-core machine the bomb grows slowly.
	deadline := time.Now().Add(8 * time.Second)
	for readCounter(t, filepath.Join(user, "pids.current")) < 64 {
		select {
		case err := <-bomb:
			t.Fatalf("the bomb ended before filling the user group (pids.current %d, err %v, exit %d, output %.300q)", readCounter(t, filepath.Join(user, "pids.current")), err, bombOut.Code, bombOut.Out)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the bomb did not fill the user group: pids.current %d", readCounter(t, filepath.Join(user, "pids.current")))
		}
		time.Sleep(20 * time.Millisecond)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range cap(errs) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := shTimeout(inst, i%2*1000, "echo alive", 5*time.Second)
			if err == nil && (r.Code != 0 || r.Out != "alive\n") {
				err = fmt.Errorf("echo alive: %+v", r)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("agent while the user group is full: %v", err)
		}
	}
	if err := <-bomb; err != nil {
		t.Fatalf("bomb: %v", err)
	}
	if ev := readFile(t, filepath.Join(user, "pids.events")); !strings.Contains(ev, "max") || strings.Contains(ev, "max 0") {
		t.Errorf("pids limit never hit: %q", ev)
	}
	mustOK(t, inst, 0, "echo ok")
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
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
