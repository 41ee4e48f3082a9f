// Package procwait waits for a child process without holding an OS thread
// while it runs.
//
// exec.Cmd.Wait blocks its thread in waitid(2) until the child exits: a
// worker that waits for thousands of children (every sandbox's init,
// spaced-host and netgtw) would hold as many threads, and every thread
// counts against kernel.pid_max. Wait first waits for the child's pidfd to
// become readable (it does when the child exits) through the Go runtime's
// poller, then reaps it with cmd.Wait, which no longer blocks.
package procwait

import (
	"os"
	"os/exec"

	"golang.org/x/sys/unix"
)

// Wait waits for cmd's process to exit and then calls cmd.Wait (which
// reaps it, collects its output and returns its status). Without pidfds
// (Linux before 5.3) it is cmd.Wait.
//
// Only the caller may reap cmd's process: the pidfd is opened here, before
// the reap, so the pid still names that child.
func Wait(cmd *exec.Cmd) error {
	exited(cmd.Process.Pid)
	return cmd.Wait()
}

// exited returns once the child pid has exited (or at once when its pidfd
// cannot be used).
func exited(pid int) {
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		return
	}
	// A non-blocking descriptor: os.NewFile registers it with the poller.
	f := os.NewFile(uintptr(fd), "pidfd")
	defer f.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Read(func(fd uintptr) bool {
		// A pidfd is readable once its process has exited.
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			n, err := unix.Poll(pfd, 0)
			if err == unix.EINTR {
				continue
			}
			return err != nil || n > 0
		}
	})
}
