package guest

import (
	"bytes"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// reapInterval is how often the agent, when it is the sandbox's pid 1,
// collects orphaned zombies.
const reapInterval = time.Second

// reapOrphans runs while the agent is pid 1 of the sandbox: processes whose
// parents exit are re-parented to it and would stay zombies forever. It
// must not steal the exit status of processes the agent started itself
// (their waitProcess goroutine waits for them), so it reaps only zombies it
// has seen on two scans in a row: a started child is waited for within
// moments of exiting, an orphan never is.
func (s *Server) reapOrphans() {
	t := time.NewTicker(reapInterval)
	defer t.Stop()
	seen := map[int]bool{}
	self := os.Getpid()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		}
		now := map[int]bool{}
		for _, pid := range zombieChildren(self) {
			if seen[pid] {
				var ws unix.WaitStatus
				unix.Wait4(pid, &ws, unix.WNOHANG, nil)
				continue
			}
			now[pid] = true
		}
		seen = now
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
