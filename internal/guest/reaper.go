package guest

import (
	"bytes"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// reapInterval is how long a zombie child must stay a zombie before the
// agent, when it is the sandbox's pid 1, reaps it as an orphan.
const reapInterval = time.Second

// reapOrphans runs while the agent is pid 1 of the sandbox: processes whose
// parents exit are re-parented to it and would stay zombies forever. It
// must not steal the exit status of processes the agent started itself
// (their waitProcess goroutine waits for them), so it reaps only zombies it
// has seen on two scans in a row, at least reapInterval apart: a started
// child is waited for within moments of exiting, an orphan never is.
//
// Scans follow SIGCHLD (a child exited, or an exited process was
// re-parented here) and repeat every reapInterval only while zombies
// remain: an idle agent neither wakes up nor allocates (on a host of
// thousands of idle sandboxes, a scan per second per agent is CPU and, by
// growing the heap between GCs, resident memory).
func (s *Server) reapOrphans() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGCHLD)
	defer signal.Stop(sig)
	var t *time.Ticker
	var tick <-chan time.Time // set while zombies are pending
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	seen := map[int]time.Time{} // zombie -> first seen
	self := os.Getpid()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-sig:
		case <-tick:
		}
		now := map[int]time.Time{}
		for _, pid := range zombieChildren(self) {
			first, ok := seen[pid]
			if ok && time.Since(first) >= reapInterval {
				var ws unix.WaitStatus
				unix.Wait4(pid, &ws, unix.WNOHANG, nil)
				continue
			}
			if !ok {
				first = time.Now()
			}
			now[pid] = first
		}
		seen = now
		switch {
		case len(seen) > 0 && t == nil:
			t = time.NewTicker(reapInterval)
			tick = t.C
		case len(seen) == 0 && t != nil:
			t.Stop()
			t, tick = nil, nil
		}
	}
}

// zombieChildren lists the zombie processes whose parent is ppid.
func zombieChildren(ppid int) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		if state, parent, ok := parseStatState(b); ok && state == 'Z' && parent == ppid {
			out = append(out, pid)
		}
	}
	return out
}

// parseStatState returns the state and parent pid from a /proc/<pid>/stat
// line; the command name may contain spaces and parentheses.
func parseStatState(stat []byte) (byte, int, bool) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, 0, false
	}
	f := bytes.Fields(stat[i+1:])
	if len(f) < 2 || len(f[0]) != 1 {
		return 0, 0, false
	}
	ppid, err := strconv.Atoi(string(f[1]))
	if err != nil {
		return 0, 0, false
	}
	return f[0][0], ppid, true
}
