package guest

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	processpb "github.com/spacesbx/space/api/envd/process"
)

// running reports whether pid exists and is not a zombie.
func running(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	state, _, ok := parseStatState(b)
	return ok && state != 'Z' && state != 'X'
}

// listed returns the pids the agent lists.
func (e *env) listed(ctx context.Context) []uint32 {
	e.t.Helper()
	l, err := e.proc.List(ctx, connect.NewRequest(&processpb.ListRequest{}))
	if err != nil {
		e.t.Fatal(err)
	}
	var pids []uint32
	for _, p := range l.Msg.GetProcesses() {
		pids = append(pids, p.GetPid())
	}
	return pids
}

// startAndLeave starts req, reads the StartEvent and drops the client
// after linger without reading anything more, like an e2b script that exits
// right after commands.run(..., {background: true}) returned. It returns
// the pid of the process.
func (e *env) startAndLeave(ctx context.Context, req *connect.Request[processpb.StartRequest], linger time.Duration) uint32 {
	e.t.Helper()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := e.proc.Start(sctx, req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer st.Close()
	if !st.Receive() || st.Msg().GetEvent().GetStart().GetPid() == 0 {
		e.t.Fatalf("start: %v %v", st.Msg(), st.Err())
	}
	pid := st.Msg().GetEvent().GetStart().GetPid()
	time.Sleep(linger)
	cancel()
	return pid
}

// connectUntil attaches to pid and reads until its output contains want.
func (e *env) connectUntil(ctx context.Context, pid uint32, want string) {
	e.t.Helper()
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	cs, err := e.proc.Connect(cctx, connect.NewRequest(&processpb.ConnectRequest{Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}}))
	if err != nil {
		e.t.Fatal(err)
	}
	defer cs.Close()
	if !cs.Receive() || cs.Msg().GetEvent().GetStart().GetPid() != pid {
		e.t.Fatalf("connect start: %v %v", cs.Msg(), cs.Err())
	}
	var out strings.Builder
	for !strings.Contains(out.String(), want) {
		if !cs.Receive() {
			e.t.Fatalf("connect ended before %q: %v (output %q)", want, cs.Err(), out.String())
		}
		d := cs.Msg().GetEvent().GetData()
		out.Write(d.GetStdout())
		out.Write(d.GetPty())
	}
}

// Finding 9: a process whose Start client went away right after the start
// keeps running (with its output drained, not blocking it), and a later
// Connect gets its output from then on.
func TestProcessOutlivesStartClient(t *testing.T) {
	for _, tc := range []struct {
		name string
		pty  bool
	}{{"pipes", false}, {"pty", true}} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			ctx := ctxT(t)
			msg := sh("sleep 0.2; while true; do echo x; sleep 0.05; done")
			if tc.pty {
				msg.Pty = &processpb.PTY{Size: &processpb.PTY_Size{Cols: 80, Rows: 24}}
			}
			pid := e.startAndLeave(ctx, connect.NewRequest(msg), 0)
			time.Sleep(2 * time.Second) // the loop wrote ~40 lines to nobody
			if pids := e.listed(ctx); len(pids) != 1 || pids[0] != pid {
				t.Fatalf("listed %v two seconds after the client left, want [%d]", pids, pid)
			}
			if !running(int(pid)) {
				t.Fatalf("process %d is not running two seconds after the client left", pid)
			}
			e.connectUntil(ctx, pid, "x")
			if !running(int(pid)) {
				t.Fatalf("process %d is not running after a Connect came and went", pid)
			}
			sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
			if _, err := e.proc.SendSignal(ctx, connect.NewRequest(&processpb.SendSignalRequest{Process: sel, Signal: processpb.Signal_SIGNAL_SIGKILL})); err != nil {
				t.Fatal(err)
			}
			eventually(t, "killed process gone", func() bool { return len(e.listed(ctx)) == 0 })
		})
	}
}

// A client that never reads and then goes away does not leave the process
// blocked on a full pipe: its output is drained.
func TestProcessNotBlockedByDepartedClient(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	done := filepath.Join(e.home(), "done")
	// 4 MB: far more than the pipe, the stream's queue and the transport
	// buffers hold together.
	// The client stays a moment without reading: the process is held up
	// by it (backpressure) until it leaves.
	pid := e.startAndLeave(ctx, connect.NewRequest(sh(`head -c 4000000 /dev/zero | tr '\0' x; touch `+done+`; sleep 30`)), 300*time.Millisecond)
	eventually(t, "output written after the client left", func() bool {
		_, err := os.Stat(done)
		return err == nil
	})
	if !running(int(pid)) {
		t.Fatalf("process %d is not running", pid)
	}
	_ = syscall.Kill(-int(pid), syscall.SIGKILL)
	eventually(t, "killed process gone", func() bool { return len(e.listed(ctx)) == 0 })
}

// The Start request's timeout (Connect-Timeout-Ms, e2b's timeoutMs) still
// kills the process when its client is long gone.
func TestStartTimeoutKillsDetachedProcess(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	const timeout = 1500 * time.Millisecond
	tctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	pid := e.startAndLeave(tctx, connect.NewRequest(sh("while true; do echo x; sleep 0.05; done")), 0)
	time.Sleep(500 * time.Millisecond)
	if !running(int(pid)) {
		t.Fatalf("process %d died %v after start, before its timeout", pid, time.Since(start))
	}
	eventually(t, "timed-out process gone", func() bool { return len(e.listed(ctx)) == 0 })
	if d := time.Since(start); d < timeout-100*time.Millisecond {
		t.Fatalf("process gone after %v, before its %v timeout", d, timeout)
	}
	eventually(t, "timed-out process reaped", func() bool { return !running(int(pid)) })
}

// A child left behind by a command (`loop &`) keeps the command's stdout.
// The command's stream still ends when the command exits, but the child
// must not get SIGPIPE or block: the pipe is drained until its last writer
// is gone (or the agent closes).
func TestOrphanedOutputIsDrained(t *testing.T) {
	for _, tc := range []struct {
		name  string
		pause string // between the child's writes
		kill  bool   // kill the child before the agent closes
	}{
		// Pauses longer than drainGrace: the stream ends at once.
		{"sporadic", "0.3", true},
		// Output without pause: the stream ends after readerWait; the
		// child is still running when the agent closes (Close must end
		// the drain).
		{"continuous", "0.02", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var child int
			t.Cleanup(func() {
				if child > 0 {
					_ = syscall.Kill(child, syscall.SIGKILL)
				}
			})
			e := newEnv(t)
			pidFile := filepath.Join(e.home(), "child.pid")
			script := `sh -c 'echo $$ > ` + pidFile + `.tmp; mv ` + pidFile + `.tmp ` + pidFile + `; while true; do echo child; sleep ` + tc.pause + `; done' & echo parent`
			r := e.run("", sh(script))
			if r.end.GetExitCode() != 0 || !strings.Contains(r.stdout, "parent") {
				t.Fatalf("end %v stdout %q", r.end, r.stdout)
			}
			b, err := os.ReadFile(pidFile)
			if err != nil {
				t.Fatal(err)
			}
			if child, err = strconv.Atoi(strings.TrimSpace(string(b))); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Second) // several writes after the stream ended
			if !running(child) {
				t.Fatalf("child %d left behind by the command died after its stream ended", child)
			}
			if tc.kill {
				_ = syscall.Kill(child, syscall.SIGKILL)
				eventually(t, "drain ended", func() bool {
					e.srv.mu.Lock()
					defer e.srv.mu.Unlock()
					return len(e.srv.drains) == 0
				})
			}
		})
	}
}
