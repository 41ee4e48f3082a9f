package procwait

import (
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

func threads(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Threads:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	t.Fatal("no Threads line")
	return 0
}

// TestWaitStatus: the exit status and the reap are cmd.Wait's.
func TestWaitStatus(t *testing.T) {
	cmd := exec.Command("sh", "-c", "exit 3")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	err := Wait(cmd)
	ee, ok := err.(*exec.ExitError)
	if !ok || ee.ExitCode() != 3 {
		t.Fatalf("Wait = %v, want exit status 3", err)
	}
	if cmd.ProcessState == nil || !cmd.ProcessState.Exited() {
		t.Fatal("process not reaped")
	}
	// Already exited before Wait: returns at once.
	cmd = exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if err := Wait(cmd); err != nil {
		t.Fatal(err)
	}
}

// TestWaitHoldsNoThread: 64 children waited for at once add (nearly) no
// OS threads to this process, where cmd.Wait would add one each.
func TestWaitHoldsNoThread(t *testing.T) {
	runtime.GC()
	before := threads(t)
	const n = 64
	var cmds []*exec.Cmd
	done := make(chan error, n)
	for range n {
		cmd := exec.Command("sleep", "30")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds = append(cmds, cmd)
		go func() { done <- Wait(cmd) }()
	}
	time.Sleep(500 * time.Millisecond)
	during := threads(t)
	for _, c := range cmds {
		c.Process.Kill()
	}
	for range n {
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("Wait did not return after the child was killed")
		}
	}
	if during-before > 8 {
		t.Fatalf("threads %d while waiting for %d children (before %d): Wait holds threads", during, n, before)
	}
	t.Logf("threads before %d, while waiting for %d children %d", before, n, during)
}

func fds(t *testing.T) int {
	t.Helper()
	e, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(e)
}

// TestWaitHoldsNoDescriptor: waiting costs no file descriptor per child
// (beyond the pidfd the os package keeps for each started process).
func TestWaitHoldsNoDescriptor(t *testing.T) {
	const n = 32
	var cmds []*exec.Cmd
	for range n {
		cmd := exec.Command("sleep", "30")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds = append(cmds, cmd)
	}
	before := fds(t)
	done := make(chan error, n)
	for _, c := range cmds {
		go func() { done <- Wait(c) }()
	}
	time.Sleep(300 * time.Millisecond)
	during := fds(t)
	for _, c := range cmds {
		c.Process.Kill()
	}
	for range n {
		<-done
	}
	if during-before > 4 {
		t.Fatalf("%d descriptors while waiting for %d children (%d before)", during, n, before)
	}
}

// A stopped watch never fires, and the watcher goroutine ends once no
// child is waited for.
func TestExitedStop(t *testing.T) {
	cmd := exec.Command("sleep", "0.2")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ch, stop := Exited(cmd.Process.Pid)
	stop()
	stop()
	time.Sleep(400 * time.Millisecond)
	select {
	case <-ch:
		t.Fatal("a stopped watch fired")
	default:
	}
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	// Nothing waited for: the watcher has ended (well before its backstop).
	for deadline := time.Now().Add(backstop / 2); ; time.Sleep(10 * time.Millisecond) {
		mu.Lock()
		w := watching
		mu.Unlock()
		if !w {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the watcher runs on with nothing to wait for")
		}
	}
	cmd = exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ch, _ = Exited(cmd.Process.Pid)
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatal("no exit seen")
	}
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
}
