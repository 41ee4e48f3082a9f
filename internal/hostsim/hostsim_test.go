package hostsim

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/testenv"
)

// The test binary doubles as the processes hosts run (HOSTSIM_HELPER).
func TestMain(m *testing.M) {
	switch os.Getenv("HOSTSIM_HELPER") {
	case "serve":
		serveHelper()
		return
	}
	goleak.VerifyTestMain(m)
}

// serveHelper answers HTTP on $ADDR with "<name> <pid>", and with
// $DAEMON set first starts a daemon of its own (a new session) that only
// sleeps: Kill must end it too.
func serveHelper() {
	if os.Getenv("DAEMON") != "" {
		cmd := exec.Command("/bin/sleep", "3600")
		cmd.SysProcAttr = &unix.SysProcAttr{Setsid: true}
		if err := cmd.Start(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		fmt.Printf("daemon %d\n", cmd.Process.Pid)
	}
	l, err := net.Listen("tcp", os.Getenv("ADDR"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("listening", l.Addr())
	_ = http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s %d", os.Getenv("NAME"), os.Getpid())
	}))
}

func newNet(t *testing.T, cfg Config) *Net {
	t.Helper()
	testenv.RequireRoot(t, "network namespaces, bridges, veths, cgroups")
	if _, err := exec.LookPath("nsenter"); err != nil {
		testenv.Skipf(t, "needs nsenter (util-linux): %v", err)
	}
	n, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return n
}

func host(t *testing.T, n *Net, name string) *Host {
	t.Helper()
	h, err := n.Host(name)
	if err != nil {
		t.Fatalf("Host(%s): %v", name, err)
	}
	return h
}

func serve(t *testing.T, h *Host, daemon bool) *Proc {
	t.Helper()
	env := []string{"HOSTSIM_HELPER=serve", "NAME=" + h.Name(), "ADDR=" + netip.AddrPortFrom(h.Addr(), 8080).String()}
	if daemon {
		env = append(env, "DAEMON=1")
	}
	p, err := h.Start("srv", Command{Path: os.Args[0], Env: env})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	return p
}

// get fetches http://<to>:8080/ from inside host from.
func get(from *Host, to netip.Addr, timeout time.Duration) (string, error) {
	tr := &http.Transport{DialContext: from.DialContext, DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: timeout}
	resp, err := c.Get("http://" + netip.AddrPortFrom(to, 8080).String() + "/")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// getEventually retries get until it answers (a process just started).
func getEventually(t *testing.T, from *Host, to netip.Addr) string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		s, err := get(from, to, 2*time.Second)
		if err == nil {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s -> %s: %v", from.Name(), to, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestConfigRejects(t *testing.T) {
	for _, c := range []Config{
		{Prefix: netip.MustParsePrefix("8.8.8.0/24")},
		{Prefix: netip.MustParsePrefix("fd00::/64")},
		{Prefix: netip.MustParsePrefix("10.1.0.0/30")},
		{Prefix: netip.MustParsePrefix("10.1.0.1/24")},
		{Prefix: netip.MustParsePrefix("10.0.0.0/7")},
		{Dir: "relative/dir"},
	} {
		if err := c.Validate(); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%+v: Validate = %v, want ErrInvalid", c, err)
		}
		if _, err := New(c); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%+v: New = %v, want ErrInvalid", c, err)
		}
	}
	if err := (Config{}).Validate(); err != nil {
		t.Errorf("zero config: %v", err)
	}
}

// TestHosts: hosts reach each other on their own addresses, from their
// own namespaces only; nothing is made in the caller's namespace.
func TestHosts(t *testing.T) {
	rootLinks := linkNames(t)
	n := newNet(t, Config{Prefix: netip.MustParsePrefix("10.213.7.0/24")})
	a, b, c := host(t, n, "a"), host(t, n, "b"), host(t, n, "client")
	if a.Addr() != netip.MustParseAddr("10.213.7.2") || b.Addr() != netip.MustParseAddr("10.213.7.3") || c.Addr() != netip.MustParseAddr("10.213.7.4") {
		t.Fatalf("addresses %s %s %s", a.Addr(), b.Addr(), c.Addr())
	}
	if again, _ := n.Host("a"); again != a {
		t.Fatal("Host(a) twice made two hosts")
	}
	serve(t, a, false)
	serve(t, b, false)
	if s := getEventually(t, c, a.Addr()); !strings.HasPrefix(s, "a ") {
		t.Fatalf("client -> a: %q", s)
	}
	if s := getEventually(t, a, b.Addr()); !strings.HasPrefix(s, "b ") {
		t.Fatalf("a -> b: %q", s)
	}
	// The caller's namespace got no link, and no host has a route but
	// the prefix's own.
	if now := linkNames(t); strings.Join(now, ",") != strings.Join(rootLinks, ",") {
		t.Errorf("links of the caller's namespace changed: %v -> %v", rootLinks, now)
	}
	hh, err := handleAt(a.Netns())
	if err != nil {
		t.Fatal(err)
	}
	defer hh.Close()
	routes, err := hh.RouteList(nil, netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range routes {
		if r.Dst == nil || (r.Dst.IP.To4() != nil && r.Dst.String() != "10.213.7.0/24") || r.Gw != nil {
			t.Errorf("host a has a route other than its prefix's: %v", r)
		}
	}
	// The caller's loopback is not the host's: a listener on the caller's
	// 127.0.0.1 is not reachable from a host.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if conn, err := a.DialContext(context.Background(), "tcp", l.Addr().String()); err == nil {
		conn.Close()
		t.Errorf("host a reached the caller's loopback %s", l.Addr())
	}
	// Off-prefix addresses are unreachable at once (no route).
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if _, err := a.DialContext(ctx, "tcp", "192.0.2.1:80"); !errors.Is(err, unix.ENETUNREACH) {
		t.Errorf("dial off the prefix from a host: %v, want ENETUNREACH", err)
	}
}

func linkNames(t *testing.T) []string {
	t.Helper()
	links, err := netlink.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range links {
		out = append(out, l.Attrs().Name)
	}
	return out
}

func TestHostNameRejects(t *testing.T) {
	n := newNet(t, Config{})
	for _, name := range []string{"", "Upper", "1abc", "a/b", "switch", "waytoolongname-xx", "a b"} {
		if _, err := n.Host(name); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("Host(%q) = %v, want ErrInvalid", name, err)
		}
	}
	h := host(t, n, "a")
	if _, err := h.Start("../x", Command{Path: "true"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("Start(../x) = %v, want ErrInvalid", err)
	}
	if _, err := h.Start("x", Command{Path: "no-such-binary-hostsim"}); err == nil {
		t.Error("Start of a missing binary succeeded")
	}
	serve(t, h, false)
	if _, err := h.Start("srv", Command{Path: "true"}); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("second srv while the first runs: %v, want ErrConflict", err)
	}
}

func TestPrefixFull(t *testing.T) {
	n := newNet(t, Config{Prefix: netip.MustParsePrefix("10.213.9.0/29")}) // .2 to .6
	for i := range 5 {
		host(t, n, fmt.Sprintf("h%d", i))
	}
	if _, err := n.Host("h5"); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("sixth host in a /29: %v, want ErrUnavailable", err)
	}
}

// TestKillRestart: Kill ends every process of the host, a daemon in a
// session of its own included; Restart runs the same commands again.
func TestKillRestart(t *testing.T) {
	n := newNet(t, Config{})
	w, c := host(t, n, "w"), host(t, n, "client")
	p := serve(t, w, true)
	first := getEventually(t, c, w.Addr())
	daemon := daemonPid(t, p.Log)
	if pids := w.cg.pids(); len(pids) < 2 {
		t.Fatalf("host cgroup holds %v, want the server and its daemon", pids)
	}
	if err := w.Kill(); err != nil {
		t.Fatalf("Kill: %v", err)
	}
	if p.Running() || p.ProcessState() == nil {
		t.Fatal("server still runs after Kill")
	}
	if alive(daemon) {
		t.Fatalf("daemon %d still runs after Kill", daemon)
	}
	if _, err := get(c, w.Addr(), time.Second); err == nil {
		t.Fatal("killed host still answers")
	}
	if err := w.Restart(); err != nil {
		t.Fatalf("Restart: %v", err)
	}
	second := getEventually(t, c, w.Addr())
	if second == first || !strings.HasPrefix(second, "w ") {
		t.Fatalf("after restart %q (before %q): want a new process", second, first)
	}
	if w.Proc("srv") == p {
		t.Fatal("Proc(srv) is the killed process")
	}
	killed, err := w.Stop(5 * time.Second)
	if err != nil {
		t.Fatalf("Stop: %v", err)
	}
	// The server exits on SIGTERM; its daemon (another session, not in
	// its group) is killed by the cgroup.
	if len(killed) != 0 {
		t.Errorf("Stop had to kill %v", killed)
	}
}

// alive reports whether pid exists and is not a zombie (an orphan's
// reaper may take its time).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	_, rest, ok := strings.Cut(string(b), ") ")
	return ok && !strings.HasPrefix(rest, "Z")
}

func daemonPid(t *testing.T, log string) int {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		f, err := os.Open(log)
		if err == nil {
			sc := bufio.NewScanner(f)
			for sc.Scan() {
				if s, ok := strings.CutPrefix(sc.Text(), "daemon "); ok {
					f.Close()
					pid, _ := strconv.Atoi(s)
					return pid
				}
			}
			f.Close()
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no daemon line in %s", log)
	return 0
}

// TestPartition: a partitioned host neither reaches nor is reached; Heal
// brings it back, its processes untouched.
func TestPartition(t *testing.T) {
	n := newNet(t, Config{})
	w, c := host(t, n, "w"), host(t, n, "client")
	p := serve(t, w, false)
	before := getEventually(t, c, w.Addr())
	if err := w.Partition(); err != nil {
		t.Fatalf("Partition: %v", err)
	}
	if !w.Partitioned() {
		t.Fatal("Partitioned() = false")
	}
	if s, err := get(c, w.Addr(), 1500*time.Millisecond); err == nil {
		t.Fatalf("partitioned host answered %q", s)
	}
	if s, err := get(w, c.Addr(), 1500*time.Millisecond); err == nil {
		t.Fatalf("partitioned host reached the client: %q", s)
	}
	// It still reaches itself.
	if s, err := get(w, w.Addr(), time.Second); err != nil || s != before {
		t.Fatalf("partitioned host to itself: %q %v", s, err)
	}
	if err := w.Heal(); err != nil {
		t.Fatalf("Heal: %v", err)
	}
	if s := getEventually(t, c, w.Addr()); s != before {
		t.Fatalf("after heal %q, want %q (same process)", s, before)
	}
	if !p.Running() {
		t.Fatal("partition ended the process")
	}
}

// TestCloseLeavesNothing: no namespace mount, process, cgroup or file is
// left after Close.
func TestCloseLeavesNothing(t *testing.T) {
	testenv.RequireRoot(t, "network namespaces, bridges, veths, cgroups")
	n, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			n.Close()
		}
	}()
	var inodes []uint64
	var pids []int
	var paths []string
	for _, name := range []string{"a", "b"} {
		h := host(t, n, name)
		p := serve(t, h, true)
		getEventually(t, h, h.Addr())
		pids = append(pids, p.Pid(), daemonPid(t, p.Log))
		paths = append(paths, h.Netns())
	}
	paths = append(paths, n.SwitchNetns())
	for _, p := range paths {
		ino, err := netnsInode(p)
		if err != nil {
			t.Fatal(err)
		}
		inodes = append(inodes, ino)
	}
	dir, cg := n.Dir(), n.cg
	closed = true
	if err := n.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := n.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("dir %s left: %v", dir, err)
	}
	if cg != nil {
		if _, err := os.Stat(cg.path); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("cgroup %s left: %v", cg.path, err)
		}
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(mi), dir) {
		t.Errorf("mounts under %s left:\n%s", dir, mi)
	}
	for _, pid := range pids {
		if alive(pid) {
			t.Errorf("process %d left", pid)
		}
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/ns/net")
	for _, p := range procs {
		var st unix.Stat_t
		if unix.Stat(p, &st) != nil {
			continue
		}
		for _, ino := range inodes {
			if st.Ino == ino {
				t.Errorf("%s is still in a namespace of the net (inode %d)", p, ino)
			}
		}
	}
	if _, err := n.Host("c"); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("Host after Close: %v, want ErrConflict", err)
	}
}

// TestTwoNetsSamePrefix: two nets of one prefix (two test processes) do
// not meet.
func TestTwoNetsSamePrefix(t *testing.T) {
	n1, n2 := newNet(t, Config{}), newNet(t, Config{})
	a1, a2 := host(t, n1, "a"), host(t, n2, "a")
	c2 := host(t, n2, "client")
	serve(t, a1, false)
	if a1.Addr() != a2.Addr() {
		t.Fatalf("addresses differ: %s %s", a1.Addr(), a2.Addr())
	}
	// n2's a serves nothing: a connection from n2 must be refused, never
	// answered by n1's a.
	if s, err := get(c2, a2.Addr(), 2*time.Second); err == nil {
		t.Fatalf("n2 reached n1's server: %q", s)
	}
}

// TestKillFrozen: a process of the host frozen by a cgroup v1 freezer (a
// paused sandbox) is killed too.
func TestKillFrozen(t *testing.T) {
	n := newNet(t, Config{})
	h := host(t, n, "w")
	fz := freezerMount()
	if fz == "" {
		testenv.Skipf(t, "no cgroup v1 freezer mounted: nothing to thaw (v2's cgroup.kill ends frozen tasks)")
	}
	p, err := h.Start("sleep", Command{Path: "/bin/sleep", Args: []string{"3600"}})
	if err != nil {
		t.Fatal(err)
	}
	cg := filepath.Join(fz, fmt.Sprintf("hostsim-test-%d", os.Getpid()))
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	defer unix.Rmdir(cg)
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(p.Pid())), 0); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cg, "freezer.state"), []byte("FROZEN"), 0); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	if err := h.Kill(); err != nil {
		t.Fatalf("Kill of a frozen process: %v", err)
	}
	if p.Running() {
		t.Fatal("frozen process still runs after Kill")
	}
	t.Logf("killed a frozen process in %v", time.Since(t0))
}
