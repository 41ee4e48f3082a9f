package worker

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// TasksPerIdleSandbox is what one idle ns sandbox holds against the host's
// task limits (kernel.pid_max, kernel.threads-max: every process and every
// thread takes a pid): spaced-host (about 5 threads) and the agent (about
// 7), measured by make density. A sandbox serving a service port adds its
// netgtw (one process, about 5 threads) while it runs.
const TasksPerIdleSandbox = 13

// FilesPerIdleSandbox is what one idle sandbox holds open in the worker
// process (pidfds of its init and spaced-host, the agent's log pipe and
// file, connections to spaced-host), against RLIMIT_NOFILE, measured.
const FilesPerIdleSandbox = 7

// hostTaskReserve is kept free for everything else on the host (the
// platform's own threads, user commands, the system).
const hostTaskReserve = 1024

// PidBudget checks the host's task limits (and this process's open-file
// limit) against sandboxes idle sandboxes. It returns "" when they fit, else which limit is short, by
// how much, and how to raise it: past it, new processes and threads fail
// (the Go runtime aborts a process that cannot create a thread).
func PidBudget(sandboxes int) string {
	need := sandboxes*TasksPerIdleSandbox + hostTaskReserve
	var short []string
	for _, l := range []struct {
		name, file string
		raise      int
	}{
		{"kernel.pid_max", "/proc/sys/kernel/pid_max", 4194304}, // the 64-bit maximum
		{"kernel.threads-max", "/proc/sys/kernel/threads-max", 2 * need},
	} {
		b, err := os.ReadFile(l.file)
		if err != nil {
			continue
		}
		v, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || v >= need {
			continue
		}
		short = append(short, fmt.Sprintf("%s is %d, below the %d tasks that %d idle sandboxes take "+
			"(%d each: every process and thread takes a pid; plus %d for the rest of the host): "+
			"raise it (sysctl -w %s=%d) or lower --capacity (%d fit)",
			l.name, v, need, sandboxes, TasksPerIdleSandbox, hostTaskReserve, l.name, max(l.raise, need), max(0, (v-hostTaskReserve)/TasksPerIdleSandbox)))
	}
	var nofile unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &nofile); err == nil {
		if fneed := uint64(sandboxes*FilesPerIdleSandbox + hostTaskReserve); nofile.Cur < fneed {
			short = append(short, fmt.Sprintf("RLIMIT_NOFILE (open files of this process) is %d, below the %d that %d idle sandboxes hold open here (%d each, plus %d): "+
				"raise it (ulimit -n %d, or LimitNOFILE= for a service) or lower --capacity (%d fit)",
				nofile.Cur, fneed, sandboxes, FilesPerIdleSandbox, hostTaskReserve, fneed, max(0, (int(nofile.Cur)-hostTaskReserve)/FilesPerIdleSandbox)))
		}
	}
	return strings.Join(short, "; ")
}
