package guest

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/internal/testenv"
)

// testUserCgroup creates a pids cgroup for the test (v2: in the unified
// hierarchy) and returns its directory and its cgroup.procs open for
// writing. Cleanup kills what is left in it and removes it.
func testUserCgroup(t *testing.T) (string, *os.File) {
	t.Helper()
	root := "/sys/fs/cgroup/pids"
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		root = "/sys/fs/cgroup"
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	dir := filepath.Join(root, "space-guest-test-"+hex.EncodeToString(b))
	if err := os.Mkdir(dir, 0o755); err != nil {
		testenv.Skipf(t, "cannot create a test cgroup: %v", err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "cgroup.procs"), os.O_WRONLY, 0)
	if err != nil {
		_ = os.Remove(dir)
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = f.Close()
		deadline := time.Now().Add(5 * time.Second)
		for {
			b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
			for _, p := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(p); err == nil {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			err := syscall.Rmdir(dir)
			if err == nil || time.Now().After(deadline) {
				if err != nil {
					t.Errorf("remove test cgroup: %v", err)
				}
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	return dir, f
}

// selfCgroupLine returns the path of the pids (v1) or unified (v2) line of
// a /proc/<pid>/cgroup text.
func selfCgroupLine(text string) string {
	for _, line := range strings.Split(text, "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			continue
		}
		if f[1] == "pids" {
			return f[2]
		}
		if f[0] == "0" && f[1] == "" {
			if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
				return f[2]
			}
		}
	}
	return ""
}

func TestUserCgroupWrapper(t *testing.T) {
	testenv.RequireRoot(t, "runs processes as other users")
	dir, ucg := testUserCgroup(t)
	e := newEnvCgroup(t, ucg)
	want := "/" + filepath.Base(dir)

	// The command itself (same pid as reported) runs in the group, as the
	// requested user, with the environment, cwd and exit code it would
	// have had without the wrapper, and no extra file descriptors.
	r := e.run("user", sh(`echo $$; cat /proc/self/cgroup; id -u; echo "$SPACE_DEFAULT"; pwd; ls -l /proc/self/fd/ | grep -c socket: ; exit 7`))
	lines := strings.SplitN(r.stdout, "\n", 2)
	if lines[0] != strconv.Itoa(int(r.pid)) {
		t.Fatalf("pid in the process %q, reported %d", lines[0], r.pid)
	}
	if got := selfCgroupLine(lines[1]); got != want {
		t.Fatalf("cgroup of the process %q, want %q:\n%s", got, want, r.stdout)
	}
	// No socket (the wrapper's handoff) leaks into the command.
	if !strings.HasSuffix(r.stdout, "\n1000\nyes\n"+e.home()+"\n0\n") || r.end.GetExitCode() != 7 {
		t.Fatalf("stdout %q exit %d", r.stdout, r.end.GetExitCode())
	}
	// Nothing but the agent's test process stays outside: the group holds
	// no leftovers and the agent never joined it.
	b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	for _, p := range strings.Fields(string(b)) {
		if p == strconv.Itoa(os.Getpid()) {
			t.Fatal("the agent itself joined the user cgroup")
		}
	}

	// A signal ends the real command.
	r = e.run("", sh(`kill -TERM $$`))
	if r.end.GetExited() || !strings.Contains(r.end.GetStatus(), "terminated") {
		t.Fatalf("end %v", r.end)
	}

	// PTY: the command owns the terminal.
	req := sh(`tty >/dev/null && echo tty-ok; cat /proc/self/cgroup`)
	req.Pty = &processpb.PTY{Size: &processpb.PTY_Size{Cols: 80, Rows: 24}}
	r = e.run("", req)
	if !strings.Contains(r.pty, "tty-ok") || selfCgroupLine(strings.ReplaceAll(r.pty, "\r", "")) != want {
		t.Fatalf("pty output %q", r.pty)
	}

	// An exec failure is reported at Start, as without the wrapper.
	script := filepath.Join(e.home(), "noexec.sh")
	writeFile(t, script, "#!/bin/sh\necho hi\n")
	for _, cmd := range []string{script, filepath.Join(e.home(), "missing")} {
		st, err := e.proc.Start(ctxT(t), connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: cmd}}))
		if err == nil {
			for st.Receive() {
			}
			err = st.Err()
			st.Close()
		}
		if codeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), cmd) {
			t.Fatalf("start %s: %v", cmd, err)
		}
	}
}
