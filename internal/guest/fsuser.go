package guest

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// File operations run with the requesting user's credentials, so that the
// kernel (not the agent) decides what a user may read and write. The agent
// is root with CAP_DAC_OVERRIDE and friends; a request of "user" must not
// read /root or write /etc because of that.
//
// Go's syscall.Setuid and friends change every thread of the process (and
// would leave the agent unprivileged). Instead one OS thread at a time takes
// the user's filesystem identity: the goroutine locks itself to its thread
// and sets the thread's supplementary groups, fsgid and fsuid with raw,
// per-thread system calls, then clears the thread's effective capabilities.
// (The kernel itself drops the filesystem ones, CAP_DAC_OVERRIDE,
// CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_CHOWN, CAP_FSETID, ..., when fsuid
// leaves 0; clearing all of them also ends the others' bypasses, such as
// CAP_SYS_RESOURCE's of quotas, and does not depend on securebits.) The
// permitted set is kept, so the thread can raise them again: that needs no
// capability. Files and directories the thread creates belong to the user
// (owner fsuid, group fsgid), as with envd.
//
// A thread is handed back to the Go scheduler only after its credentials
// were restored and checked against the agent's own; otherwise its
// goroutine exits still locked and the runtime terminates the thread (or
// parks it for good, if it is the main thread). Threads the runtime starts
// while a goroutine is locked are cloned from its template thread, never
// from a switched one.

// threadCreds is the part of a thread's credentials file access depends on.
type threadCreds struct {
	fsuid, fsgid int
	groups       []int
	caps         [2]unix.CapUserData
}

func (c *threadCreds) equal(o *threadCreds) bool {
	return c.fsuid == o.fsuid && c.fsgid == o.fsgid && slices.Equal(c.groups, o.groups) && c.caps == o.caps
}

// currentThreadCreds reads the calling thread's credentials. setfsuid and
// setfsgid with an invalid id (-1) change nothing and return the current one.
func currentThreadCreds() (threadCreds, error) {
	var c threadCreds
	c.fsuid, _ = unix.SetfsuidRetUid(-1)
	c.fsgid, _ = unix.SetfsgidRetGid(-1)
	groups, err := unix.Getgroups()
	if err != nil {
		return c, fmt.Errorf("getgroups: %w", err)
	}
	c.groups = groups
	if err := capget(&c.caps); err != nil {
		return c, err
	}
	return c, nil
}

func capget(data *[2]unix.CapUserData) error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	return nil
}

func capset(data *[2]unix.CapUserData) error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return nil
}

// agentCreds are the agent's own credentials, read once (every thread has
// them outside runAs).
var agentCreds = sync.OnceValues(func() (threadCreds, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return currentThreadCreds()
})

// fsThreadsLost counts threads that could not be restored and were left to
// die with their goroutine (tests check it stays zero).
var fsThreadsLost atomic.Int64

// errActAsUser is returned when the agent cannot take a user's identity
// (it is not root, or the kernel refused): the operation is not done.
var errActAsUser = errors.New("agent cannot act as this user")

// runAs runs fn with acct's filesystem credentials (see above) and returns
// its error. fn runs on another goroutine: it must not start goroutines
// that touch the filesystem, and whatever it opens stays usable afterwards
// (permissions are checked when a file is opened, not when it is read).
//
// A root account runs fn directly when the agent is root: root's own
// credentials are the agent's. An agent that is not root (tests, dev) runs
// fn directly for its own uid and refuses every other user.
func runAs(acct *account, fn func() error) error {
	base, err := agentCreds()
	if err != nil {
		return fmt.Errorf("reading agent credentials: %w", err)
	}
	if int(acct.UID) == base.fsuid && (base.fsuid == 0 || acct.GID == uint32(base.fsgid)) {
		return fn()
	}
	if base.fsuid != 0 {
		return fmt.Errorf("%w %s (uid %d): the agent runs as uid %d: %w", errActAsUser, quote(acct.Name), acct.UID, base.fsuid, fs.ErrPermission)
	}
	groups := make([]int, len(acct.Groups))
	for i, g := range acct.Groups {
		groups[i] = int(g)
	}
	type result struct {
		err   error
		panic any
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		var r result
		defer func() {
			// Restore before the thread can run anything else. A thread
			// whose credentials cannot be proven restored is never
			// unlocked: it dies when this goroutine returns.
			if restoreCreds(&base) {
				runtime.UnlockOSThread()
			} else {
				fsThreadsLost.Add(1)
			}
			done <- r
		}()
		if err := switchCreds(acct.UID, acct.GID, groups); err != nil {
			r.err = fmt.Errorf("%w %s: %w", errActAsUser, quote(acct.Name), err)
			return
		}
		func() {
			defer func() { r.panic = recover() }()
			r.err = fn()
		}()
	}()
	r := <-done
	if r.panic != nil {
		panic(r.panic)
	}
	return r.err
}

// switchCreds gives the calling (locked) thread uid, gid and groups as its
// filesystem identity and no effective capability.
func switchCreds(uid, gid uint32, groups []int) error {
	if err := unix.Setgroups(groups); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	_, _ = unix.SetfsgidRetGid(int(gid))
	_, _ = unix.SetfsuidRetUid(int(uid))
	var c threadCreds
	c.fsuid, _ = unix.SetfsuidRetUid(-1)
	c.fsgid, _ = unix.SetfsgidRetGid(-1)
	if c.fsuid != int(uid) || c.fsgid != int(gid) {
		return fmt.Errorf("setfsuid/setfsgid: thread has fsuid %d fsgid %d, want %d %d", c.fsuid, c.fsgid, uid, gid)
	}
	if err := capget(&c.caps); err != nil {
		return err
	}
	c.caps[0].Effective, c.caps[1].Effective = 0, 0
	if err := capset(&c.caps); err != nil {
		return err
	}
	if err := capget(&c.caps); err != nil {
		return err
	}
	if c.caps[0].Effective != 0 || c.caps[1].Effective != 0 {
		return fmt.Errorf("capset: effective capabilities %08x%08x remain", c.caps[1].Effective, c.caps[0].Effective)
	}
	return nil
}

// restoreCreds gives the calling thread the agent's credentials back and
// reports whether it verifiably has them.
func restoreCreds(base *threadCreds) bool {
	// Capabilities first: setfsuid(0) and setgroups need CAP_SETUID and
	// CAP_SETGID, and raising the effective set within the permitted one
	// needs nothing.
	if capset(&base.caps) != nil {
		return false
	}
	_, _ = unix.SetfsuidRetUid(base.fsuid)
	_, _ = unix.SetfsgidRetGid(base.fsgid)
	if unix.Setgroups(base.groups) != nil {
		return false
	}
	c, err := currentThreadCreds()
	return err == nil && c.equal(base)
}

// agentProcFile reports whether f, opened as a user, is a file of the
// agent's own /proc/<pid> (or of one of its threads). Within a thread group
// the kernel's ptrace check always passes, whatever the thread's fsuid, so
// the mode bits alone guard these files: the world-readable ones (maps,
// smaps, ...) would tell a user the agent's memory layout, which the user's
// own processes may not read, and the world-writable ones (attr/*) would
// take a user's writes for the agent.
func agentProcFile(f *os.File) bool {
	var sfs unix.Statfs_t
	if unix.Fstatfs(int(f.Fd()), &sfs) != nil || sfs.Type != unix.PROC_SUPER_MAGIC {
		return false
	}
	p, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(int(f.Fd())))
	if err != nil {
		return true // cannot tell: refuse
	}
	for _, c := range strings.Split(p, "/") {
		if _, err := strconv.ParseUint(c, 10, 32); err != nil {
			continue
		}
		if _, err := os.Lstat("/proc/self/task/" + c); err == nil {
			return true
		}
	}
	return false
}
