package hostile

// Probes: attacks that are cheap for the host. They run in parallel, after
// the heavy attacks (heavy_test.go) have run one at a time.

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// Finding 1: a sandbox pushes a command into the operator's terminal with
// TIOCSTI on /dev/tty (space up's controlling terminal, inherited because
// sandbox processes stay in space up's session).
func TestTIOCSTIOperatorTerminal(t *testing.T) {
	p := shared(t)
	if b, err := os.ReadFile("/proc/sys/dev/tty/legacy_tiocsti"); err == nil && strings.TrimSpace(string(b)) == "0" {
		testenv.Skipf(t, "dev.tty.legacy_tiocsti is 0 on this host: the kernel refuses TIOCSTI to everyone")
	}
	t.Parallel()
	s := p.sandbox(t, false)
	s.upload(t)
	spaceSid, err := statField(p.pid, 6)
	if err != nil {
		t.Fatal(err)
	}
	// The session of every sandbox process, seen from the host, while a
	// command runs.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, done := s.start(ctx, "user", "/tmp/attack", "sid", "3s")
	if !out.waitFor("sid", 10*time.Second) {
		t.Fatalf("the sid probe did not start: %q", out.String())
	}
	pids := hostPids(s.ID)
	if len(pids) < 2 {
		t.Fatalf("found %d host processes of sandbox %s, want the agent and the command", len(pids), s.ID)
	}
	for _, pid := range pids {
		sid, err := statField(pid, 6)
		if err != nil {
			continue
		}
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		if sid == spaceSid {
			t.Errorf("sandbox process %d (%s) is in space up's session %d: it shares the operator's controlling terminal",
				pid, strings.TrimSpace(string(comm)), sid)
		}
		if tty, err := statField(pid, 7); err == nil && tty != 0 {
			t.Errorf("sandbox process %d (%s) has a controlling terminal (tty_nr %#x)", pid, strings.TrimSpace(string(comm)), tty)
		}
	}
	<-done

	marker := "HOSTILE-TIOCSTI-" + randHex(4)
	for _, user := range []string{"root", "user"} {
		r := s.attack(t, user, "tiocsti", "echo "+marker+"\n")
		t.Logf("as %s: %s", user, strings.TrimSpace(r.out))
		if v, ok := lookup(lines(r.out), "TIOCSTI"); ok && strings.HasPrefix(v, "ok") {
			t.Errorf("as %s: TIOCSTI into /dev/tty succeeded (%s): the sandbox types into the operator's terminal", user, v)
		}
	}
	time.Sleep(300 * time.Millisecond)
	if screen := p.ptyScreen(); strings.Contains(screen, marker) {
		t.Errorf("the injected command reached the operator's terminal: %q", screen)
	}
	var queued int
	if n, err := unix.IoctlGetInt(int(p.ptySlave.Fd()), unix.TIOCINQ); err == nil {
		queued = n
	}
	if queued > 0 {
		t.Errorf("%d bytes wait in the operator terminal's input queue (injected as typed input)", queued)
		// Drain it so nothing runs the injected command later.
		_ = unix.SetNonblock(int(p.ptySlave.Fd()), true)
		io.ReadAll(io.LimitReader(p.ptySlave, int64(queued)))
	}
}

// Finding 7: descriptors space up inherited must not reach sandboxes.
func TestInheritedFDLeak(t *testing.T) {
	p := shared(t)
	t.Parallel()
	s := p.sandbox(t, false)
	s.upload(t)
	isLeak := func(target string) bool {
		for _, l := range p.leakPaths {
			if strings.Contains(target, filepath.Base(l)) {
				return true
			}
		}
		return false
	}
	for _, user := range []string{"root", "user"} {
		r := s.attack(t, user, "fds")
		if r.err != nil || r.code != 0 {
			t.Fatalf("fds as %s: %d %v %s", user, r.code, r.err, r.out)
		}
		for _, l := range strings.Split(strings.TrimSpace(r.out), "\n") {
			var fd int
			var target string
			if _, err := fmt.Sscanf(l, "fd %d -> %s", &fd, &target); err != nil {
				continue
			}
			switch {
			case isLeak(target):
				t.Errorf("as %s: a command holds fd %d -> %s, space up's inherited descriptor", user, fd, target)
			case fd > 2:
				t.Errorf("as %s: a command holds fd %d -> %s beyond 0, 1 and 2 (inherited)", user, fd, target)
			}
		}
	}
	// The agent, from the host.
	agent := agentPid(t, s.ID)
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", agent))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		target, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", agent, e.Name()))
		if isLeak(target) {
			t.Errorf("the sandbox's pid 1 holds fd %s -> %s, space up's inherited descriptor", e.Name(), target)
		}
	}
	// And through the sandbox's own /proc/1/fd as root.
	r := s.sh(t, "root", "for f in /proc/1/fd/*; do readlink $f; done")
	for _, l := range strings.Split(r.out, "\n") {
		if isLeak(l) {
			t.Errorf("root in the sandbox sees %s among /proc/1/fd", l)
		}
	}
}

// Finding 8: root in the sandbox takes the agent's descriptors
// (pidfd_getfd), compares them (kcmp), or works on its memory
// (process_madvise) or attaches to it (ptrace).
func TestPidfdGetfd(t *testing.T) {
	agentAccess(t, func(name string) bool {
		return strings.HasPrefix(name, "pidfd_getfd") || name == "kcmp" || name == "process_madvise" || name == "ptrace attach"
	}, 19)
}

// Finding 8 by the older ways: root in the sandbox opens the agent's
// memory (/proc/1/mem, read and write) or its descriptors
// (/proc/1/fd/N), the same access pidfd_getfd gives.
func TestAgentProcAccess(t *testing.T) {
	agentAccess(t, func(name string) bool {
		return strings.HasPrefix(name, "open /proc/PID/") || strings.HasPrefix(name, "read /proc/PID/") ||
			strings.HasPrefix(name, "readlink /proc/PID/")
	}, 3)
}

// agentAccess runs the pidfd attack as root on pid 1 (the agent) and wants
// every result selected by which refused with EPERM, ENOSYS or EACCES.
func agentAccess(t *testing.T, which func(string) bool, want int) {
	p := shared(t)
	t.Parallel()
	s := p.sandbox(t, false)
	// The program is root's own file (uploaded as root), as a root
	// attacker's tools would be.
	s.upload(t)
	r := s.attack(t, "root", "pidfd", "1")
	t.Logf("pidfd attack as root:\n%s", r.out)
	l := lines(r.out)
	checked := 0
	for _, x := range l {
		if !which(x.name) {
			continue
		}
		checked++
		if x.v != "err EPERM" && x.v != "err ENOSYS" && x.v != "err EACCES" {
			t.Errorf("%s on the agent: %s, want EPERM, EACCES or ENOSYS", x.name, x.v)
		}
	}
	if v, _ := lookup(l, "pidfd_open"); !strings.HasPrefix(v, "ok") {
		t.Logf("pidfd_open(1) is refused (%s)", v)
	}
	if checked < want {
		t.Errorf("only %d results (want %d) from the attack program:\n%s", checked, want, r.out)
	}
}

// Finding 6: file operations as a user follow that user's rights.
func TestFilesAsUser(t *testing.T) {
	p := shared(t)
	t.Parallel()
	s := p.sandbox(t, true)
	secret := "SECRET-" + randHex(8)
	s.mustSh(t, "root", "umask 077; echo "+secret+" > /root/secret; echo public > /home/user/public.txt; chmod 644 /home/user/public.txt")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	t.Run("read root's file as user", func(t *testing.T) {
		b, err := s.ReadFile(ctx, "/root/secret", sdk.FileOptions{User: "user"})
		if strings.Contains(string(b), secret) {
			t.Fatalf("user read /root/secret")
		}
		if !errors.Is(err, sdk.ErrForbidden) {
			t.Errorf("reading /root/secret as user: %v, want 403 forbidden", err)
		}
	})
	t.Run("write /etc as user", func(t *testing.T) {
		_, err := s.WriteFile(ctx, "/etc/x", []byte("hostile\n"), sdk.FileOptions{User: "user"})
		if !errors.Is(err, sdk.ErrForbidden) {
			t.Errorf("writing /etc/x as user: %v, want 403 forbidden", err)
		}
		if r := s.sh(t, "root", "test -e /etc/x"); r.code == 0 {
			t.Errorf("/etc/x exists after user's write")
		}
	})
	t.Run("signed URL with Basic root", func(t *testing.T) {
		sign := func(path, user string, exp int64) string {
			raw := path + ":read:" + user + ":" + s.AccessToken + ":" + strconv.FormatInt(exp, 10)
			sum := sha256.Sum256([]byte(raw))
			return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
		}
		get := func(path, user string, basic bool) (int, string) {
			exp := time.Now().Add(5 * time.Minute).Unix()
			q := url.Values{"path": {path}, "signature": {sign(path, user, exp)}, "signature_expiration": {strconv.FormatInt(exp, 10)}}
			if user != "" {
				q.Set("username", user)
			}
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.edge+"/files?"+q.Encode(), nil)
			req.Header.Set(sdk.HeaderSandboxID, s.ID)
			req.Header.Set(sdk.HeaderSandboxPort, strconv.Itoa(sdk.EnvdPort))
			if basic {
				req.Header.Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte("root:")))
			}
			res, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer res.Body.Close()
			b, _ := io.ReadAll(io.LimitReader(res.Body, 1<<20))
			return res.StatusCode, string(b)
		}
		// The signing is right: a signed read of the user's own file works.
		if code, body := get("/home/user/public.txt", "user", false); code != 200 || body != "public\n" {
			t.Fatalf("a correctly signed download as user: %d %q (the test's signature does not match the platform's)", code, body)
		}
		for _, c := range []struct{ user string }{{"user"}, {""}} {
			code, body := get("/root/secret", c.user, true)
			if strings.Contains(body, secret) {
				t.Errorf("a URL signed for username %q plus Authorization: Basic root: read /root/secret (%d)", c.user, code)
			} else if code == 200 {
				t.Errorf("a URL signed for username %q plus Basic root: answered 200 for /root/secret", c.user)
			}
		}
	})
	t.Run("write to read-only places answers 4xx", func(t *testing.T) {
		// /dev is read-only in every template (an image's /usr is the
		// sandbox's own to change, as root, like in E2B).
		for _, path := range []string{"/dev/hostile-ro", "/proc/sys/kernel/hostile", "/proc/version"} {
			_, err := s.WriteFile(ctx, path, []byte("x"), sdk.FileOptions{User: "root"})
			var e *sdk.Error
			switch {
			case err == nil:
				t.Errorf("writing %s as root succeeded", path)
			case !errors.As(err, &e):
				t.Errorf("writing %s: %v (no HTTP answer)", path, err)
			case e.Status < 400 || e.Status > 499:
				t.Errorf("writing %s answered %d (%v), want 4xx", path, e.Status, err)
			}
		}
	})
}

// Finding 9: a background command outlives the client that started it.
func TestBackgroundServerSurvivesClient(t *testing.T) {
	p := shared(t)
	mod, err := filepath.Abs("../e2e/node_modules/e2b")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(mod, "package.json")); err != nil {
		testenv.Skipf(t, "the e2b npm package is not installed (make e2e-deps installs it)")
	}
	if _, err := exec.LookPath("node"); err != nil {
		testenv.Skipf(t, "node is not installed (make deps installs it)")
	}
	t.Parallel()
	s := p.sandbox(t, false)
	script := `const { Sandbox } = require(process.env.E2B_MODULE)
;(async () => {
  const sbx = await Sandbox.connect(process.env.SBX_ID)
  await sbx.commands.run('python3 -m http.server 8000', { background: true })
  console.log('started')
  process.exit(0)
})().catch((e) => { console.error(e); process.exit(1) })`
	cmd := exec.Command("node", "-e", script)
	cmd.Env = append(os.Environ(), "E2B_API_URL=http://"+p.api, "E2B_SANDBOX_URL=http://"+p.edge, "E2B_API_KEY="+apiKey,
		"E2B_MODULE="+mod, "SBX_ID="+s.ID)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "started") {
		t.Fatalf("node: %v\n%s", err, out)
	}
	// The client is gone; the server must still run and answer.
	time.Sleep(2 * time.Second)
	var r result
	for i := 0; i < 10; i++ {
		r = s.sh(t, "user", "curl -sS -m 3 -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/")
		if r.code == 0 && strings.TrimSpace(r.out) == "200" {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	if r.code != 0 || strings.TrimSpace(r.out) != "200" {
		ps := s.sh(t, "root", "ps -eo pid,stat,args")
		t.Errorf("the background http.server does not answer after its client exited: exit %d %q\nprocesses:\n%s", r.code, r.out, ps.out)
	}
}

// Escape: host processes, pid 1's environment and root.
func TestEscapeHostProcesses(t *testing.T) {
	p := shared(t)
	t.Parallel()
	s := p.sandbox(t, false)
	if out := s.mustSh(t, "root", "cat /proc/1/comm"); strings.TrimSpace(out) != "spaced-guest" {
		t.Errorf("/proc/1 in the sandbox is %q, not the sandbox's agent", out)
	}
	out := s.mustSh(t, "root", "ps -eo pid=,comm=")
	n := 0
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		n++
		switch f[1] {
		case "space", "spaced-host", "space-nsinit", "netgtw", "systemd", "init", "sshd", "go":
			t.Errorf("the sandbox sees host process %s", l)
		}
	}
	if n > 10 {
		t.Errorf("the sandbox sees %d processes:\n%s", n, out)
	}
	// The canary is in space up's environment only.
	r := s.sh(t, "root", "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; cat "+p.hostSecret+" /proc/1/root"+p.hostSecret+
		" /proc/1/cwd"+p.hostSecret+" 2>&1; ls /proc/"+strconv.Itoa(p.pid)+"/root/ 2>&1")
	if strings.Contains(r.out, p.canary) {
		t.Errorf("the sandbox read the host's canary (space up's environment or a host file):\n%s", r.out)
	}
	if r := s.sh(t, "root", "test -d /proc/"+strconv.Itoa(p.pid)+" && cat /proc/"+strconv.Itoa(p.pid)+"/comm"); strings.Contains(r.out, "space") {
		t.Errorf("space up's host pid %d is visible in the sandbox as %q", p.pid, r.out)
	}
}

// Escape: network. Only lo; no host loopback service, no host address.
func TestEscapeNetwork(t *testing.T) {
	p := shared(t)
	t.Parallel()
	s := p.sandbox(t, false)
	s.upload(t)
	var accepted atomic.Int32
	listen := func(addr string) string {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				accepted.Add(1)
				c.Close()
			}
		}()
		return l.Addr().String()
	}
	loop := listen("127.0.0.1:0")
	wild := listen("0.0.0.0:0")
	_, anyPort, _ := net.SplitHostPort(wild)
	targets := []string{loop, p.api, p.edge}
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && !ipn.IP.IsLoopback() && ipn.IP.To4() != nil {
			targets = append(targets, net.JoinHostPort(ipn.IP.String(), anyPort))
		}
	}
	// The sandbox's link leads to the worker's egress proxy, which
	// completes every TCP handshake and then closes what the policy
	// denies: a connect that succeeds proves nothing; what the host's
	// listeners accepted does. Once under the default policy (deny), once
	// with the internet open: the host's own addresses stay unreachable.
	open := true
	created, err := p.client.CreateSandbox(context.Background(), sdk.CreateOptions{Timeout: 10 * time.Minute, AllowInternetAccess: &open})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { created.Kill(context.Background()) })
	openSbx := &sandbox{created, p}
	openSbx.upload(t)
	for _, sb := range []*sandbox{s, openSbx} {
		for _, user := range []string{"root", "user"} {
			r := sb.attack(t, user, append([]string{"connect"}, targets...)...)
			for _, l := range lines(r.out) {
				if strings.HasPrefix(l.name, "connect ") && strings.HasPrefix(l.v, "ok") {
					t.Logf("as %s: %s completed a handshake (with the egress proxy)", user, l.name)
				}
			}
		}
	}
	if n := accepted.Load(); n > 0 {
		t.Errorf("the host listeners accepted %d connections from the sandboxes", n)
	}
	// One interface besides lo: eth0, with one address from the link pool
	// and one way out, its gateway.
	out := s.mustSh(t, "root", "tail -n +3 /proc/net/dev | cut -d: -f1")
	for _, ifc := range strings.Fields(out) {
		if ifc != "lo" && ifc != "eth0" {
			t.Errorf("the sandbox has network interface %s", ifc)
		}
	}
	routes := s.mustSh(t, "root", "cat /proc/net/route")
	for _, l := range strings.Split(strings.TrimSpace(routes), "\n")[1:] {
		if f := strings.Fields(l); len(f) > 0 && f[0] != "eth0" {
			t.Errorf("the sandbox has a route through %s: %s", f[0], l)
		}
	}
}

// Escape: devices (host disks, memory, the kernel log device; mknod).
func TestEscapeDevices(t *testing.T) {
	p := shared(t)
	t.Parallel()
	s := p.sandbox(t, false)
	s.upload(t)
	for _, dir := range []string{"/tmp", "/dev/shm"} {
		r := s.attack(t, "root", "devices", dir)
		t.Logf("devices (%s):\n%s", dir, r.out)
		for _, l := range lines(r.out) {
			if !strings.HasPrefix(l.v, "ok") {
				continue
			}
			switch name := l.name; {
			case strings.HasPrefix(name, "mknod "):
				// Making the node is allowed (CAP_MKNOD); opening it is not.
			default:
				t.Errorf("as root: %s succeeded", name)
			}
		}
	}
	for _, user := range []string{"root", "user"} {
		for _, c := range []string{"head -c 64 /dev/mem", "ls /dev/sda /dev/vda /dev/nvme0n1"} {
			if r := s.sh(t, user, c); r.code == 0 {
				t.Errorf("as %s: %q succeeded:\n%.300s", user, c, r.out)
			}
		}
	}
}

// Escape: the kernel log (dmesg, /dev/kmsg, /proc/kmsg, syslog(2)).
func TestEscapeKernelLog(t *testing.T) {
	p := shared(t)
	t.Parallel()
	s := p.sandbox(t, false)
	for _, user := range []string{"root", "user"} {
		for _, c := range []string{"dmesg", "dmesg -c", "head -c 64 /dev/kmsg", "head -c 64 /proc/kmsg"} {
			if r := s.sh(t, user, c); r.code == 0 {
				t.Errorf("as %s: %q succeeded:\n%.300s", user, c, r.out)
			}
		}
	}
}

// Escape: writes to /proc/sys and /sys.
func TestEscapeProcSysWrites(t *testing.T) {
	p := shared(t)
	t.Parallel()
	s := p.sandbox(t, false)
	core, _ := os.ReadFile("/proc/sys/kernel/core_pattern")
	// Each write puts back the host's current value (or a harmless one):
	// a hole is detected by the write succeeding, not by damage.
	writes := map[string]string{
		"/proc/sys/kernel/core_pattern":               strings.TrimSpace(string(core)),
		"/proc/sys/vm/drop_caches":                    "1",
		"/proc/sys/kernel/sysrq":                      readTrim("/proc/sys/kernel/sysrq"),
		"/proc/sys/kernel/hostname":                   "hostile",
		"/proc/sys/net/ipv4/ip_forward":               "0",
		"/proc/sysrq-trigger":                         "h",
		"/sys/kernel/mm/transparent_hugepage/enabled": "never",
		"/sys/fs/cgroup/pids/pids.max":                "max",
	}
	for path, v := range writes {
		if r := s.sh(t, "root", fmt.Sprintf("printf '%%s\\n' '%s' > %s", v, path)); r.code == 0 {
			t.Errorf("as root: writing %s succeeded", path)
		}
	}
	if r := s.sh(t, "root", "ls /sys | wc -l"); strings.TrimSpace(r.out) != "0" {
		t.Logf("/sys in the sandbox lists %s entries", strings.TrimSpace(r.out))
	}
}

func readTrim(path string) string {
	b, _ := os.ReadFile(path)
	return strings.TrimSpace(string(b))
}

// Escape: another sandbox's files and processes.
func TestEscapeOtherSandbox(t *testing.T) {
	p := shared(t)
	t.Parallel()
	a, b := p.sandbox(t, false), p.sandbox(t, false)
	tag := "hostile-" + randHex(6)
	a.mustSh(t, "user", "echo "+tag+" > /tmp/"+tag)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out, _ := a.start(ctx, "user", "/bin/bash", "-c", "echo started; exec -a "+tag+" sleep 60")
	if !out.waitFor("started", 10*time.Second) {
		t.Fatalf("a's process did not start: %q", out.String())
	}
	upperA := a.upperDir(t)
	time.Sleep(200 * time.Millisecond)
	if r := b.sh(t, "root", "ps -eo args | grep -c '[h]ostile-'"); strings.TrimSpace(r.out) != "0" {
		t.Errorf("sandbox b sees a's process: %q", r.out)
	}
	if r := b.sh(t, "root", "find / -xdev -name '"+tag+"' 2>/dev/null; grep -rls '"+tag+"' /tmp /home /root /var 2>/dev/null"); strings.Contains(r.out, tag) {
		t.Errorf("sandbox b finds a's file:\n%s", r.out)
	}
	// a's writable layer by its host path.
	if upperA != "" {
		if r := b.sh(t, "root", "cat "+upperA+"/tmp/"+tag); r.code == 0 || strings.Contains(r.out, tag+"\n") {
			t.Errorf("sandbox b reads a's file through its host path %s: %q", upperA, r.out)
		}
	}
}

// Escape: entering or making namespaces, mounting.
func TestEscapeNamespaces(t *testing.T) {
	p := shared(t)
	t.Parallel()
	s := p.sandbox(t, false)
	s.upload(t)
	for _, user := range []string{"root", "user"} {
		r := s.attack(t, user, "ns")
		n := 0
		for _, l := range lines(r.out) {
			switch l.name {
			case "chroot", "sethostname": // in the sandbox's own root and UTS namespace
				continue
			}
			n++
			if strings.HasPrefix(l.v, "ok") {
				t.Errorf("as %s: %s succeeded", user, l.name)
			}
		}
		if n < 20 {
			t.Errorf("as %s: only %d results:\n%s", user, n, r.out)
		}
	}
}

// Slow clients at the edge: slowloris headers must not take the edge.
func TestEdgeSlowloris(t *testing.T) {
	p := shared(t)
	t.Parallel()
	s := p.sandbox(t, false)
	const conns = 500
	var open []net.Conn
	defer func() {
		for _, c := range open {
			c.Close()
		}
	}()
	for i := 0; i < conns; i++ {
		c, err := net.DialTimeout("tcp", p.edge, 5*time.Second)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		fmt.Fprintf(c, "GET /health HTTP/1.1\r\nHost: 49983-%s.localhost\r\n", s.ID)
		open = append(open, c)
	}
	t0 := time.Now()
	stop := make(chan struct{})
	go func() { // one more header line per connection every 2 s
		tk := time.NewTicker(2 * time.Second)
		defer tk.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tk.C:
			}
			for _, c := range open {
				c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
				fmt.Fprintf(c, "X-Slow-%d: %d\r\n", i, i)
			}
		}
	}()
	defer close(stop)
	for i := 0; i < 5; i++ {
		if d := s.alive(t, 10*time.Second); d > 5*time.Second {
			t.Errorf("a normal command took %v with %d slow clients at the edge", d, conns)
		}
		time.Sleep(time.Second)
	}
	// The edge must drop connections that never finish their headers.
	deadline := t0.Add(45 * time.Second)
	closed := 0
	for _, c := range open {
		c.SetReadDeadline(deadline)
		_, err := c.Read(make([]byte, 1))
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			break // still open at the deadline
		}
		closed++
	}
	if closed < conns {
		t.Errorf("%d of %d slowloris connections still open after %v", conns-closed, conns, time.Since(t0).Round(time.Second))
	}
}

// hostUIDs returns the real, effective, saved and filesystem uids of a
// host process.
func hostUIDs(t *testing.T, pid int) []string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) == 5 && f[0] == "Uid:" {
			return f[1:]
		}
	}
	t.Fatalf("pid %d: no Uid line", pid)
	return nil
}

// Escape: root in a sandbox (its agent, and what sudo gives user) is an
// unprivileged uid on the host, a different one in each sandbox.
func TestRootIsNobodyOnHost(t *testing.T) {
	p := shared(t)
	t.Parallel()
	a, b := p.sandbox(t, false), p.sandbox(t, false)
	ua, ub := hostUIDs(t, agentPid(t, a.ID)), hostUIDs(t, agentPid(t, b.ID))
	for _, u := range append(append([]string{}, ua...), ub...) {
		if u == "0" {
			t.Fatalf("a sandbox's root is host root: agent uids %v and %v", ua, ub)
		}
	}
	if ua[0] == ub[0] {
		t.Fatalf("two sandboxes' roots share host uid %s", ua[0])
	}
	if out := a.mustSh(t, "root", "id -u; awk '{print $1, $2}' /proc/self/uid_map"); out != "0\n0 "+ua[0]+"\n" {
		t.Fatalf("root inside a: %q (host uid %s)", out, ua[0])
	}
	// sudo as user: root inside, the same unprivileged range outside.
	if out := a.mustSh(t, "user", "sudo -n sh -c 'id -u; awk \"{print \\$2}\" /proc/self/uid_map'"); out != "0\n"+ua[0]+"\n" {
		t.Fatalf("sudo as user: %q", out)
	}
}
