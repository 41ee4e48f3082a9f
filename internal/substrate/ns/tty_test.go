//go:build linux

package ns

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/substrate"
)

// ttyHelperEnv makes the test binary run TestTerminalHelper for real.
const ttyHelperEnv = "SPACE_NS_TTY_HELPER"

// TestSandboxCannotTypeIntoWorkerTerminal starts a worker (this test
// binary) whose controlling terminal is a pty, as when an operator runs
// `space up` from a shell, and has root in its sandbox push a command into
// /dev/tty with TIOCSTI. Nothing may reach the terminal: the sandbox is in
// a session of its own, so it has no controlling terminal to open.
func TestSandboxCannotTypeIntoWorkerTerminal(t *testing.T) {
	needRoot(t)
	b, _ := os.ReadFile("/proc/sys/dev/tty/legacy_tiocsti")
	if strings.TrimSpace(string(b)) == "0" {
		t.Log("dev.tty.legacy_tiocsti is 0 here: TIOCSTI is refused by the kernel anyway; the session checks still run")
	}
	master, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer master.Close()
	if err := unix.IoctlSetPointerInt(int(master.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(master.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	slave, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer slave.Close()
	cmd := exec.Command(os.Args[0], "-test.run=^TestTerminalHelper$", "-test.v")
	cmd.Env = append(os.Environ(), ttyHelperEnv+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	slave.Close()
	var out bytes.Buffer
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 4096)
		for {
			n, err := master.Read(buf)
			out.Write(buf[:n])
			if err != nil {
				return
			}
		}
	}()
	werr := cmd.Wait()
	_ = master.SetReadDeadline(time.Now().Add(2 * time.Second))
	master.Close()
	<-done
	got := out.String()
	if werr != nil || !strings.Contains(got, "--- PASS: TestTerminalHelper") {
		t.Fatalf("helper failed (%v):\n%s", werr, got)
	}
	if strings.Contains(got, "INJECTED") {
		t.Fatalf("the sandbox typed into the worker's terminal:\n%s", got)
	}
}

// TestTerminalHelper runs only as TestSandboxCannotTypeIntoWorkerTerminal's
// child, with a pty as its controlling terminal; run directly it has
// nothing to do (it is not a test that did not run, so it does not skip).
func TestTerminalHelper(t *testing.T) {
	if os.Getenv(ttyHelperEnv) == "" {
		return
	}
	if fd, err := unix.Open("/dev/tty", unix.O_RDWR, 0); err != nil {
		t.Fatalf("the helper has no controlling terminal: %v", err)
	} else {
		unix.Close(fd)
	}
	inst, _ := start(t, substrate.Limits{})
	sid, _ := unix.Getsid(0)
	isid, err := unix.Getsid(inst.InitPID())
	if err != nil || isid == sid {
		t.Fatalf("sandbox init is in the worker's session %d (%d, %v)", sid, isid, err)
	}
	const attack = `python3 -c "
import fcntl, os, termios
try:
    fd = os.open('/dev/tty', os.O_RDWR)
except OSError as e:
    print('open', e.errno); raise SystemExit(0)
for c in b'echo INJECTED\n':
    fcntl.ioctl(fd, termios.TIOCSTI, bytes([c]))
print('typed')
"`
	for _, uid := range []int{0, 1000} {
		if out := mustOK(t, inst, uid, attack); out != fmt.Sprintf("open %d\n", unix.ENXIO) {
			t.Fatalf("uid %d: /dev/tty: %q", uid, out)
		}
	}
}

// TestPTYCap: one sandbox opening pseudo-terminals until it fails stops
// at Config.MaxPTYs (ENOSPC), far below the host's kernel.pty.max, and
// another sandbox still gets one while the first holds all of its own.
func TestPTYCap(t *testing.T) {
	s := needRoot(t)
	a, _ := start(t, substrate.Limits{})
	b, _ := start(t, substrate.Limits{})
	const grab = `cat > /tmp/grab.py <<'EOF'
import os, sys, time
fds = []
try:
    while len(fds) < 5000:
        fds.append(os.open('/dev/ptmx', os.O_RDWR | os.O_NOCTTY))
except OSError as e:
    print(len(fds), e.errno, flush=True)
time.sleep(int(sys.argv[1]))
EOF
`
	// setsid, and wait for its report: the test agent kills a command's
	// process group when the command ends.
	held := strings.TrimSpace(mustOK(t, a, 1000, grab+"setsid python3 /tmp/grab.py 30 > /tmp/held 2>&1 &\n"+
		"for i in $(seq 200); do [ -s /tmp/held ] && break; sleep 0.05; done; cat /tmp/held"))
	want := fmt.Sprintf("%d %d", s.cfg.MaxPTYs, unix.ENOSPC)
	if held != want {
		t.Fatalf("sandbox a opened %q ptys (count errno), want %q", held, want)
	}
	if out := strings.TrimSpace(mustOK(t, b, 1000, grab+"python3 /tmp/grab.py 0")); out != want {
		t.Fatalf("sandbox b, while a holds its ptys: %q", out)
	}
}
