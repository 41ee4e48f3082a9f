// Package procwait waits for child processes without holding an OS thread
// or a file descriptor per child while they run.
//
// exec.Cmd.Wait blocks its thread in waitid(2) until the child exits: a
// worker that waits for thousands of children (every sandbox's init and
// spaced-host, and netgtw) would hold as many threads, and every thread
// counts against kernel.pid_max. Wait instead registers the child with one
// process-wide watcher that, on every SIGCHLD, probes the registered
// children with waitid(WNOHANG|WNOWAIT) (which leaves the zombie in place)
// and wakes the waiters of those that exited; each then reaps its child
// with cmd.Wait, which no longer blocks. (A pidfd per child on the poller
// would do too, but costs a descriptor per child against RLIMIT_NOFILE.)
package procwait

import (
	"os"
	"os/exec"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Wait waits for cmd's process to exit and then calls cmd.Wait (which
// reaps it, collects its output and returns its status).
//
// Only the caller may reap cmd's process.
func Wait(cmd *exec.Cmd) error {
	ch, _ := Exited(cmd.Process.Pid)
	<-ch
	return cmd.Wait()
}

var (
	mu      sync.Mutex
	waiters = map[int]chan struct{}{}
	// watching is true while the watcher goroutine runs; it ends when no
	// child is waited for.
	watching bool
	// kick wakes the watcher after a stop, so it ends at once when that
	// was the last child waited for.
	kick = make(chan struct{}, 1)
)

// backstop re-probes the registered children this often even without a
// SIGCHLD (none is lost with os/signal; this bounds any surprise).
const backstop = 5 * time.Second

// watch probes the registered children on every SIGCHLD until none is
// left. Started with mu held and watching set.
func watch() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGCHLD)
	defer signal.Stop(ch)
	t := time.NewTicker(backstop)
	defer t.Stop()
	probe() // an exit between the registration and Notify
	for {
		select {
		case <-ch:
		case <-t.C:
		case <-kick:
		}
		if probe() == 0 {
			mu.Lock()
			if len(waiters) == 0 {
				watching = false
				mu.Unlock()
				return
			}
			mu.Unlock()
		}
	}
}

// probe wakes the waiters of every registered child that has exited and
// returns how many are still waited for.
func probe() int {
	mu.Lock()
	defer mu.Unlock()
	for pid, done := range waiters {
		if hasExited(pid) {
			close(done)
			delete(waiters, pid)
		}
	}
	return len(waiters)
}

// hasExited reports whether the child pid is a zombie (or gone), without
// reaping it.
func hasExited(pid int) bool {
	var info unix.Siginfo // zeroed: Signo stays 0 while the child runs
	err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil)
	if err == unix.EINTR {
		return hasExited(pid)
	}
	// ECHILD: not (or no longer) our child: nothing to wait for here;
	// cmd.Wait reports it.
	return err != nil || info.Signo != 0
}

// Exited returns a channel closed once the child pid has exited (it is
// left for the caller to reap) and a stop that unregisters the child
// instead (the channel then never closes): a caller that lets go of a
// child which outlives it (an ns sandbox handed to the next worker
// process) holds no goroutine for it. Only one waiter per pid.
func Exited(pid int) (<-chan struct{}, func()) {
	done := make(chan struct{})
	mu.Lock()
	waiters[pid] = done
	if !watching {
		watching = true
		go watch()
	}
	mu.Unlock()
	// Registered first, then probed: an exit before the registration is
	// seen here, one after it raises a SIGCHLD the watcher sees.
	probe()
	stop := func() {
		mu.Lock()
		if waiters[pid] == done {
			delete(waiters, pid)
		}
		mu.Unlock()
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	return done, stop
}
