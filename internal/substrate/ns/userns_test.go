//go:build linux

package ns

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

func TestUserNamespace(t *testing.T) {
	s := needRoot(t)
	if !s.userns {
		testenv.Skipf(t, "user namespaces unavailable here: %s", userNamespacesUnsupported())
	}
	a, _ := start(t, substrate.Limits{})
	base := a.uids.First()

	// Sandbox root is the range's first uid on the host.
	if out := mustOK(t, a, 0, "cat /proc/self/uid_map"); strings.Join(strings.Fields(out), " ") != fmt.Sprintf("0 %d 65536", base) {
		t.Fatalf("uid_map %q, want 0 %d 65536", out, base)
	}
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", a.InitPID()))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(st), fmt.Sprintf("Uid:\t%d\t%d\t%d\t%d", base, base, base, base)) {
		t.Fatalf("agent's host ids are not the range's first uid %d:\n%s", base, st)
	}
	// The template and /usr still read as root-owned inside.
	if out := mustOK(t, a, 0, "stat -c '%u:%g' /etc/passwd /usr/bin/env /home/user /"); out != "0:0\n0:0\n1000:1000\n0:0\n" {
		t.Fatalf("owners inside: %q", out)
	}
	// What the sandbox writes is stored under its inside ids.
	mustOK(t, a, 0, "echo r > /root/r && mkdir -p /srv/d && rm /etc/hostname && rm -rf /var/log && mkdir /var/log")
	mustOK(t, a, 1000, "echo u > /home/user/u")
	for rel, want := range map[string]uint32{"root/r": 0, "home/user/u": 1000, "srv/d": 0} {
		var fi syscall.Stat_t
		if err := syscall.Lstat(filepath.Join(a.LayerDir(), rel), &fi); err != nil {
			t.Fatal(err)
		}
		if fi.Uid != want || fi.Gid != want {
			t.Errorf("upper/%s owned by %d:%d on disk, want %d", rel, fi.Uid, fi.Gid, want)
		}
	}
	// Whiteouts and opaque directories in the overlay's userxattr form.
	var wh syscall.Stat_t
	if err := syscall.Lstat(filepath.Join(a.LayerDir(), "etc/hostname"), &wh); err != nil || wh.Mode&syscall.S_IFMT != syscall.S_IFCHR || wh.Rdev != 0 {
		t.Errorf("no whiteout for a deleted file: %+v %v", wh, err)
	}
	buf := make([]byte, 8)
	if n, err := syscall.Getxattr(filepath.Join(a.LayerDir(), "var/log"), "user.overlay.opaque", buf); err != nil || string(buf[:n]) != "y" {
		t.Errorf("recreated dir is not opaque: %q %v", buf, err)
	}
	// Root inside cannot act on host-owned things the namespace does not map.
	mustFail(t, a, 0, "cat /proc/1/environ >/dev/null 2>&1 && test -w /proc/sys/kernel/hostname && echo x > /proc/sys/kernel/hostname")

	// Per-user kernel limits are per sandbox: user in one sandbox takes
	// every inotify instance it can; user in another still gets one.
	b, _ := start(t, substrate.Limits{})
	if b.uids.First() == base {
		t.Fatal("two sandboxes share a uid range")
	}
	const grab = `cat > /tmp/inotify.py <<'EOF'
import ctypes, sys, time
l = ctypes.CDLL(None)
fds = [l.inotify_init() for _ in range(int(sys.argv[1]))]
print(sum(1 for f in fds if f >= 0), flush=True)
time.sleep(int(sys.argv[2]))
EOF
`
	// a's user takes every instance it can and holds them (setsid: the
	// test agent kills a command's process group when it ends).
	took := strings.TrimSpace(mustOK(t, a, 1000, grab+"setsid python3 /tmp/inotify.py 1000 30 > /tmp/held 2>&1 &\n"+
		"for i in $(seq 200); do [ -s /tmp/held ] && break; sleep 0.05; done; cat /tmp/held"))
	if took == "0" || took == "" {
		t.Fatalf("no inotify instance at all in sandbox a: %q", took)
	}
	t.Logf("user in sandbox a holds %s inotify instances", took)
	if out := strings.TrimSpace(mustOK(t, a, 1000, grab+"python3 /tmp/inotify.py 1 0")); out != "0" {
		t.Fatalf("a's user got another inotify instance beyond its limit: %q", out)
	}
	if out := strings.TrimSpace(mustOK(t, b, 1000, grab+"python3 /tmp/inotify.py 1 0")); out != "1" {
		t.Fatalf("user in sandbox b got %s inotify instances while sandbox a held all of its own (a took %s)", out, took)
	}
}

func TestWithoutUserNamespaces(t *testing.T) {
	_, inst, _ := startWith(t, Config{StateDir: testState, NoUserNamespaces: true, NoWarmInit: true})
	if inst.uids != nil {
		t.Fatal("a uid range was leased with user namespaces off")
	}
	out := mustOK(t, inst, 0, "grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status; cat /proc/self/uid_map")
	for _, w := range []string{"NoNewPrivs:\t1", "Seccomp:\t2", "4294967295"} {
		if !strings.Contains(out, w) {
			t.Errorf("lacks %q:\n%s", w, out)
		}
	}
}

// TestSudo: user runs sudo as in E2B's images, and the root it gets is the
// sandbox's: its ids still map to the sandbox's host range.
func TestSudo(t *testing.T) {
	s := needRoot(t)
	if !s.userns {
		testenv.Skipf(t, "sudo needs user namespaces, unavailable here: %s", userNamespacesUnsupported())
	}
	if _, err := os.Stat(filepath.Join(s.cfg.UsrDir, "bin/sudo")); err != nil {
		t.Fatalf("sudo is not installed on the host (make sandbox-deps installs it): %v", err)
	}
	inst, _ := start(t, substrate.Limits{})
	out := mustOK(t, inst, 1000, "echo secret > /tmp/s 2>/dev/null; sudo -n sh -c 'id -u; echo r > /root/by-sudo; cat /proc/self/uid_map' 2>&1")
	if f := strings.Fields(out); len(f) != 4 || f[0] != "0" || f[2] != fmt.Sprint(inst.uids.First()) {
		t.Fatalf("sudo as user: %q", out)
	}
	mustOK(t, inst, 0, "test -s /root/by-sudo")
	// Root through sudo is still the sandbox's root: no mounts, no modules.
	mustFail(t, inst, 1000, "sudo -n mount -t tmpfs x /mnt")
	mustFail(t, inst, 1000, "sudo -n sh -c 'echo 1 > /proc/sys/kernel/sysrq'")
}
