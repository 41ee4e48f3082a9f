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
	if os.Getenv(helperEnv) != "" {
		os.Exit(runHelper()) // a worker of TestWorkerDeath
	}
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
