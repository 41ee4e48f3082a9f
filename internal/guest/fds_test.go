package guest

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/envd/process/processpbconnect"
	"github.com/spacesbx/space/internal/testenv"
)

// extraFDs returns the descriptors other than 0, 1 and 2 that `ls -l
// /proc/self/fd` output shows, without the one ls reads the directory
// with, as "fd -> target".
func extraFDs(out string) []string {
	var extra []string
	for _, line := range strings.Split(strings.ReplaceAll(out, "\r", ""), "\n") {
		_, link, ok := strings.Cut(line, " -> ")
		if !ok {
			continue
		}
		f := strings.Fields(line[:len(line)-len(link)-len(" -> ")])
		if len(f) == 0 {
			continue
		}
		fd := f[len(f)-1]
		if fd == "0" || fd == "1" || fd == "2" || strings.HasPrefix(link, "/proc/") && strings.HasSuffix(link, "/fd") {
			continue
		}
		extra = append(extra, fd+" -> "+link)
	}
	return extra
}

// leakFD opens a descriptor the way a careless parent leaves one (not
// close-on-exec) and returns it with its /proc link target.
func leakFD(t *testing.T) (int, string) {
	t.Helper()
	fd, err := unix.Open("/dev/null", unix.O_RDONLY, 0) // no O_CLOEXEC
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Close(fd) })
	return fd, "/dev/null"
}

// Finding 7: what the agent starts gets 0, 1 and 2 only, through pipes,
// a terminal or the cgexec wrapper (GUEST_TEST_CGEXEC=1), once the
// agent's inherited descriptors are sealed (SealFDs, here only its
// close-on-exec part: this test process keeps what it inherited).
func TestCommandsGetOnlyStdio(t *testing.T) {
	e := newEnv(t)
	fd, _ := leakFD(t)
	lsFD := sh("ls -l /proc/self/fd")
	r := e.run("", lsFD)
	if !strings.Contains(strings.Join(extraFDs(r.stdout), "\n"), fmt.Sprintf("%d -> /dev/null", fd)) {
		t.Fatalf("the leaked fd %d did not reach the command before sealing, the test proves nothing:\n%s", fd, r.stdout)
	}
	if err := cloexecFrom(3); err != nil {
		t.Fatal(err)
	}
	if x := extraFDs(e.run("", lsFD).stdout); len(x) > 0 {
		t.Fatalf("command got descriptors besides 0, 1, 2: %v", x)
	}
	in := sh("ls -l /proc/self/fd")
	in.Stdin = ptr(true)
	rin := e.run("", in)
	if x := extraFDs(rin.stdout); len(x) > 0 {
		t.Fatalf("command with stdin got descriptors besides 0, 1, 2: %v", x)
	}
	tty := sh("ls -l /proc/self/fd")
	tty.Pty = &processpb.PTY{Size: &processpb.PTY_Size{Cols: 200, Rows: 24}}
	if x := extraFDs(e.run("", tty).pty); len(x) > 0 {
		t.Fatalf("pty command got descriptors besides 0, 1, 2: %v", x)
	}
}

const mainHelperEnv = "GUEST_TEST_MAIN_HELPER"

// TestMainHelperProcess is the agent for TestMainSealsInheritedFDs: the
// real startup path (Main) with a listener on fd 3 and a leaked fd 4.
func TestMainHelperProcess(t *testing.T) {
	cfg := os.Getenv(mainHelperEnv)
	if cfg == "" {
		return
	}
	os.Exit(Main(MainOptions{ConfigJSON: cfg, Stderr: os.Stderr}))
}

// Main closes what it inherited besides its listener (fd 3), and the
// listener does not reach commands.
func TestMainSealsInheritedFDs(t *testing.T) {
	testenv.RequireRoot(t, "runs processes as other users")
	dir := t.TempDir()
	passwd, group := filepath.Join(dir, "passwd"), filepath.Join(dir, "group")
	writeFile(t, passwd, fmt.Sprintf("root:x:0:0:root:%s:/bin/sh\n", dir))
	writeFile(t, group, "root:x:0:\n")
	cfg, _ := json.Marshal(Config{
		Identity:   Identity{Sandbox: "sbx1", Generation: 1, Execution: "ex1", Worker: "w1", Substrate: "ns", Activation: "a1"},
		PasswdPath: passwd, GroupPath: group, DefaultUser: "root",
	})
	sock := filepath.Join(dir, "guest.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	lf, err := l.(*net.UnixListener).File()
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	leakR, leakW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer leakR.Close()
	defer leakW.Close()
	var leakSt syscall.Stat_t
	if err := syscall.Fstat(int(leakW.Fd()), &leakSt); err != nil {
		t.Fatal(err)
	}
	leakLink := fmt.Sprintf("pipe:[%d]", leakSt.Ino)
	if err := syscall.Fstat(int(lf.Fd()), &leakSt); err != nil {
		t.Fatal(err)
	}
	listenLink := fmt.Sprintf("socket:[%d]", leakSt.Ino)

	cmd := exec.Command(os.Args[0], "-test.run=^TestMainHelperProcess$")
	cmd.Env = append(os.Environ(), mainHelperEnv+"="+string(cfg))
	cmd.ExtraFiles = []*os.File{lf, leakW} // fds 3 and 4
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("agent exited with %v; stderr:\n%s", err, stderr.String())
			}
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
			t.Error("agent did not exit on SIGTERM")
		}
	}()

	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}
	defer tr.CloseIdleConnections()
	client := processpbconnect.NewProcessClient(&http.Client{Transport: tr}, "http://guest", connect.WithProtoJSON())
	ctx := ctxT(t)
	st, err := client.Start(ctx, connect.NewRequest(sh("ls -l /proc/self/fd")))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	r := collect(t, func() (*processpb.ProcessEvent, bool) {
		if !st.Receive() {
			return nil, false
		}
		return st.Msg().GetEvent(), true
	}, st.Err)
	if x := extraFDs(r.stdout); len(x) > 0 {
		t.Fatalf("command got descriptors besides 0, 1, 2: %v\n%s", x, r.stdout)
	}
	// The agent itself: the listener kept, the leaked pipe closed.
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	holdsListener := false
	for _, ent := range ents {
		link, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", cmd.Process.Pid, ent.Name()))
		if link == leakLink {
			t.Fatalf("agent still holds the leaked pipe as fd %s", ent.Name())
		}
		holdsListener = holdsListener || link == listenLink
	}
	if !holdsListener {
		t.Fatalf("agent holds no descriptor of its listener %s", listenLink)
	}
}
