package procid

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/testenv"
	"golang.org/x/sys/unix"
)

// TestMain lets the test binary play two helper roles:
//   - PROCID_LISTEN=path: listen on a Unix socket at path, print "ok",
//     accept forever (a process whose identity is checked as a peer);
//   - PROCID_PIDNS=1: run as pid 1 of a fresh pid namespace and force a
//     pid to be reused (see pidnsReuse), printing the outcome as JSON.
func TestMain(m *testing.M) {
	if p := os.Getenv("PROCID_LISTEN"); p != "" {
		os.Remove(p)
		l, err := net.Listen("unix", p)
		if err != nil {
			os.Exit(3)
		}
		fmt.Println("ok")
		for {
			c, err := l.Accept()
			if err != nil {
				os.Exit(0)
			}
			go func() { io.Copy(io.Discard, c) }() // held open until the peer or the process ends

		}
	}
	if os.Getenv("PROCID_PIDNS") == "1" {
		os.Exit(pidnsReuse())
	}
	os.Exit(m.Run())
}

func startListener(path string) (*exec.Cmd, error) {
	cmd := exec.Command("/proc/self/exe", "-test.run=^$")
	cmd.Env = append(os.Environ(), "PROCID_LISTEN="+path)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	if l, _ := bufio.NewReader(out).ReadString('\n'); l != "ok\n" {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, fmt.Errorf("listener helper: %q", l)
	}
	return cmd, nil
}

type reuseResult struct {
	PID1, PID2       int
	Start1, Start2   uint64
	HandleErr        string
	HandleMismatch   bool
	PeerErr          string
	PeerMismatch     bool
	FallbackErr      string
	FallbackMismatch bool
	NewPeerMethod    PeerMethod
	Err              string
}

// pidnsReuse runs as pid 1 of a new pid (and mount) namespace, where it is
// the only process that forks: it records a process, kills it, sets
// ns_last_pid so that the next process gets the same pid, starts a process
// of the same executable, and checks the old records against it.
func pidnsReuse() int {
	res := reuseResult{}
	defer func() { json.NewEncoder(os.Stdout).Encode(res) }()
	fail := func(f string, a ...any) int { res.Err = fmt.Sprintf(f, a...); return 0 }
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fail("make / private: %v", err)
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fail("mount proc: %v", err)
	}
	dir, err := os.MkdirTemp("", "pidns")
	if err != nil {
		return fail("%v", err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s")
	first, err := startListener(sock)
	if err != nil {
		return fail("first: %v", err)
	}
	res.PID1 = first.Process.Pid
	h, err := Open(res.PID1)
	if err != nil {
		return fail("open: %v", err)
	}
	defer h.Close()
	old := h.Process()
	res.Start1 = old.StartTime
	first.Process.Kill()
	first.Wait()
	var second *exec.Cmd
	for range 20 { // another thread of this process may take the pid first
		os.WriteFile("/proc/sys/kernel/ns_last_pid", []byte(strconv.Itoa(res.PID1-1)), 0)
		second, err = startListener(sock)
		if err != nil {
			return fail("second: %v", err)
		}
		if second.Process.Pid == res.PID1 {
			break
		}
		second.Process.Kill()
		second.Wait()
		second = nil
	}
	if second == nil {
		return fail("could not reuse pid %d", res.PID1)
	}
	defer func() { second.Process.Kill(); second.Wait() }()
	res.PID2 = second.Process.Pid
	res.Start2, _ = StartTime(res.PID2)
	if err := h.Check(); err != nil {
		res.HandleErr, res.HandleMismatch = err.Error(), errors.Is(err, ErrMismatch)
	}
	if err := old.Check(); err != nil {
		res.FallbackErr, res.FallbackMismatch = err.Error(), errors.Is(err, ErrMismatch)
	}
	c, err := net.Dial("unix", sock)
	if err != nil {
		return fail("dial: %v", err)
	}
	defer c.Close()
	if err := h.VerifyPeer(c); err != nil {
		res.PeerErr, res.PeerMismatch = err.Error(), errors.Is(err, ErrMismatch)
	}
	// The newcomer itself, recorded afresh, passes.
	h2, err := Open(res.PID2)
	if err != nil {
		return fail("open second: %v", err)
	}
	defer h2.Close()
	if res.NewPeerMethod, err = h2.VerifyPeerMethod(c); err != nil {
		return fail("second as itself: %v", err)
	}
	return 0
}

// A process that reuses a recorded pid is rejected: the pidfd knows the
// recorded process is gone even when the newcomer runs the same executable
// and started within the same clock tick; the pid + start time fallback
// rejects it whenever the start times differ.
func TestReusedPIDIsRejected(t *testing.T) {
	testenv.RequireRoot(t, "a pid namespace")
	cmd := exec.Command("/proc/self/exe", "-test.run=^$")
	cmd.Env = append(os.Environ(), "PROCID_PIDNS=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS}
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("pidns helper: %v %s", err, out)
	}
	var r reuseResult
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if r.Err != "" {
		t.Fatal(r.Err)
	}
	t.Logf("pid %d reused (start %d -> %d); handle: %s; peer: %s; fallback: %q; newcomer matched by %d",
		r.PID1, r.Start1, r.Start2, r.HandleErr, r.PeerErr, r.FallbackErr, r.NewPeerMethod)
	if r.PID1 != r.PID2 {
		t.Fatalf("pid not reused: %d, %d", r.PID1, r.PID2)
	}
	if !r.HandleMismatch {
		t.Fatalf("reused pid passed Handle.Check: %q", r.HandleErr)
	}
	if !r.PeerMismatch {
		t.Fatalf("reused pid passed VerifyPeer: %q", r.PeerErr)
	}
	if r.Start1 != r.Start2 && !r.FallbackMismatch {
		t.Fatalf("start-time fallback missed a reused pid: %q", r.FallbackErr)
	}
	if r.NewPeerMethod != PeerPidfdInode {
		t.Fatalf("peer matched by %d, want SO_PEERPIDFD + pidfs inode on this kernel", r.NewPeerMethod)
	}
}

// A start-time mismatch alone (the fallback without pidfds) is rejected.
func TestStartTimeMismatchIsRejected(t *testing.T) {
	h, err := Open(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	h.p.StartTime--
	if err := h.Check(); !errors.Is(err, ErrMismatch) {
		t.Fatalf("got %v", err)
	}
}

// A process that re-executes another binary keeps its pid, pidfd and start
// time; its executable's device+inode change, and it is rejected.
func TestSwappedExecutableIsRejected(t *testing.T) {
	cmd := exec.Command("/bin/sh", "-c", "read x; exec sleep 30")
	in, _ := cmd.StdinPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	h, err := Open(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := h.Check(); err != nil {
		t.Fatalf("before exec: %v", err)
	}
	old := h.Process()
	if want := sha256File(t, "/proc/self/exe"); old.ExeSHA256 == "" || old.ExeSHA256 == want {
		t.Fatalf("sh hash %q", old.ExeSHA256)
	}
	if want := sha256File(t, fmt.Sprintf("/proc/%d/exe", old.PID)); want != old.ExeSHA256 {
		t.Fatalf("hash %s, file %s", old.ExeSHA256, want)
	}
	io.WriteString(in, "\n")
	deadline := time.Now().Add(5 * time.Second)
	for {
		now, err := Read(old.PID)
		if err == nil && now.ExeIno != old.ExeIno {
			if now.StartTime != old.StartTime {
				t.Fatalf("exec changed start time")
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("sh did not exec sleep")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := h.Check(); !errors.Is(err, ErrMismatch) {
		t.Fatalf("re-executed process passed: %v", err)
	}
	if err := old.Check(); !errors.Is(err, ErrMismatch) {
		t.Fatalf("fallback: re-executed process passed: %v", err)
	}
}

// Replacing the file at an executable's path does not change a running
// process (it keeps the old inode), but a process started from the new file
// is another executable.
func TestReplacedFileAtPath(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "sleeper")
	copyFile(t, "/bin/sleep", bin)
	cmd := exec.Command(bin, "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	h, err := Open(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	copyFile(t, "/bin/sh", bin+".new")
	if err := os.Rename(bin+".new", bin); err != nil {
		t.Fatal(err)
	}
	if err := h.Check(); err != nil {
		t.Fatalf("running process changed by a rename: %v", err)
	}
	var st unix.Stat_t
	unix.Stat(bin, &st)
	if st.Ino == h.Process().ExeIno {
		t.Fatal("replacement has the recorded inode")
	}
}

// When the executable's metadata changed since Open, Check hashes it again
// and compares with the recorded SHA-256 (writes to a running executable
// fail with ETXTBSY, so this is simulated on the recorded side).
func TestChangedExecutableContentIsRejected(t *testing.T) {
	h, err := Open(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	h.meta.ctime.Nsec++ // as if the file had been written to since Open
	if err := h.Check(); err != nil {
		t.Fatalf("same content after a metadata change: %v", err)
	}
	h.meta.mtime.Nsec++
	h.p.ExeSHA256 = strings.Repeat("0", 64)
	if err := h.Check(); !errors.Is(err, ErrMismatch) {
		t.Fatalf("changed content passed: %v", err)
	}
}

func TestHandleExitedAndClosed(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h, err := Open(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if !h.HasPidfd() {
		t.Fatal("no pidfd on this kernel")
	}
	cmd.Process.Kill()
	cmd.Wait()
	if err := h.Check(); !errors.Is(err, ErrMismatch) {
		t.Fatalf("dead process passed: %v", err)
	}
	h.Close()
	if err := h.Check(); !errors.Is(err, ErrClosed) {
		t.Fatalf("closed handle: %v", err)
	}
	if _, err := Open(cmd.Process.Pid); err == nil {
		t.Fatal("opened a reaped process")
	}
}

// VerifyPeer: SO_PEERCRED and SO_PEERPIDFD must name the recorded process.
func TestHandleVerifyPeer(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s")
	peer, err := startListener(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { peer.Process.Kill(); peer.Wait() }()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	hp, err := Open(peer.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	defer hp.Close()
	m, err := hp.VerifyPeerMethod(c)
	if err != nil || m != PeerPidfdInode {
		t.Fatalf("listener as peer: %d %v", m, err)
	}
	self, err := Open(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	defer self.Close()
	if err := self.VerifyPeer(c); !errors.Is(err, ErrMismatch) {
		t.Fatalf("another process accepted as peer: %v", err)
	}
	// Same pid number, another process: only the pidfd tells them apart.
	fake := &Handle{p: hp.p, pidfd: self.pidfd, pidfs: true, pidfdDev: self.pidfdDev, pidfdIno: self.pidfdIno}
	if err := fake.samePidfd(mustPeerPidfd(t, c)); !errors.Is(err, ErrMismatch) {
		t.Fatalf("other pidfs inode accepted: %v", err)
	}
}

func mustPeerPidfd(t *testing.T, c net.Conn) int {
	t.Helper()
	var fd int
	var gerr error
	control(c, func(s int) { fd, gerr = unix.GetsockoptInt(s, unix.SOL_SOCKET, unix.SO_PEERPIDFD) })
	if gerr != nil {
		t.Fatal(gerr)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

func TestParseFdinfoPid(t *testing.T) {
	n, err := parseFdinfoPid([]byte("pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\nPid:\t4242\nNSpid:\t4242\n"))
	if err != nil || n != 4242 {
		t.Fatalf("%d %v", n, err)
	}
	for _, bad := range []string{"", "Pid:\tx\n", "pos: 0\n"} {
		if _, err := parseFdinfoPid([]byte(bad)); err == nil {
			t.Errorf("accepted %q", bad)
		}
	}
}

func sha256File(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o755); err != nil {
		t.Fatal(err)
	}
}

// Exited closes for a process that is not our child once it exits, and
// not before; Signal reaches it through the pidfd.
func TestExitedAndSignal(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	h, err := Open(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if !h.HasPidfd() {
		testenv.Skipf(t, "no pidfds on this kernel")
	}
	done, err := h.Exited()
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
		t.Fatal("Exited closed while the process runs")
	case <-time.After(100 * time.Millisecond):
	}
	if err := h.Signal(unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Exited did not close after the process was killed")
	}
	cmd.Wait()
	if err := h.Signal(0); err == nil {
		t.Fatal("signal to a reaped process succeeded")
	}
}
