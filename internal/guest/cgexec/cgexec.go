//go:build linux

// Package cgexec starts a command inside a cgroup the caller can only reach
// through an open cgroup.procs file (the ns substrate hands spaced-guest
// the one of the sandbox's user group as SPACE_CGROUP_FD), with no moment
// where the command's code runs outside that group.
//
// The command is started as a re-execution of the running binary
// (/proc/self/exe) with argv[0] "space-cgexec": this wrapper, already
// carrying the command's credentials, session, process group, controlling
// terminal, stdio, environment and working directory, blocks on a socket
// until the caller has written its pid to cgroup.procs, then execs the real
// command. The pid the caller gets from Start is therefore the command's
// own pid; exit statuses and signals are the command's. If the final exec
// fails, the wrapper reports the errno and exits 127; Place returns the
// same *os.PathError os/exec would have returned from Start.
//
// Every binary that starts commands this way must import this package (its
// init runs the wrapper and never returns when argv[0] is "space-cgexec").
// The binary must be executable by the command's user (mode o+x): the
// wrapper runs after the credential switch.
package cgexec

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// EnvFD names the environment variable carrying the number of an inherited
// file descriptor open for writing on the cgroup.procs file of the group
// user processes must run in.
const EnvFD = "SPACE_CGROUP_FD"

// wrapperArg0 marks the wrapper: argv = [wrapperArg0, path, argv...].
const wrapperArg0 = "space-cgexec"

// handoffFD is the wrapper's end of the handoff socket.
const handoffFD = 3

// exitExecFailed is the wrapper's status when it could not exec (as a shell).
const exitExecFailed = 127

func init() {
	if len(os.Args) >= 3 && os.Args[0] == wrapperArg0 {
		wrapper()
	}
}

// wrapper waits for the go-ahead ("g") on the handoff socket and execs
// os.Args[1] with os.Args[2:]. Anything else (EOF: the starter gave up)
// exits without running anything.
func wrapper() {
	// The wrapper is moved into the user group while it waits here, and
	// that group may be full (a fork bomb at pids.max): from then on clone
	// fails with EAGAIN, and a Go runtime that wants another thread dies
	// ("failed to create new OS thread"). So it must not want one: one P
	// (no idle P for a runnable background goroutine to wake a thread
	// for), no garbage collection, a raw read (a Go syscall blocked for
	// over 10 ms has its P handed to another thread), and the starter
	// moves it only after it said it is ready ('r'): until then the
	// runtime may still be starting threads of its own.
	runtime.GOMAXPROCS(1)
	debug.SetGCPercent(-1)
	ready := [1]byte{'r'}
	if _, _, errno := syscall.RawSyscall(syscall.SYS_WRITE, handoffFD, uintptr(unsafe.Pointer(&ready[0])), 1); errno != 0 {
		os.Exit(exitExecFailed)
	}
	var b [1]byte
	for {
		n, _, errno := syscall.RawSyscall(syscall.SYS_READ, handoffFD, uintptr(unsafe.Pointer(&b[0])), 1)
		if errno == syscall.EINTR {
			continue
		}
		if errno != 0 || n != 1 || b[0] != 'g' {
			os.Exit(exitExecFailed)
		}
		break
	}
	// Nothing but 0, 1 and 2 goes to the command. The agent already made
	// everything else close-on-exec (guest.SealFDs); doing it again here
	// keeps a descriptor the agent may have missed out of user code. The
	// handoff stays usable for the errno until the exec succeeds.
	if unix.CloseRange(handoffFD, ^uint(0), unix.CLOSE_RANGE_CLOEXEC) != nil {
		syscall.CloseOnExec(handoffFD)
	}
	err := syscall.Exec(os.Args[1], os.Args[2:], environ())
	errno, ok := err.(syscall.Errno)
	if !ok {
		errno = syscall.EINVAL
	}
	msg := []byte(strconv.Itoa(int(errno)))
	_, _ = syscall.Write(handoffFD, msg)
	os.Exit(exitExecFailed)
}

// environ is the wrapper's environment verbatim (os.Environ drops
// duplicate names), as the starter passed it.
func environ() []string {
	b, err := os.ReadFile("/proc/self/environ")
	if err != nil {
		return os.Environ()
	}
	env := strings.Split(string(b), "\x00")
	if n := len(env); n > 0 && env[n-1] == "" {
		env = env[:n-1]
	}
	return env
}

// FromEnv returns the cgroup.procs file named by $SPACE_CGROUP_FD (close on
// exec from now on), or nil when the variable is unset. It unsets the
// variable so that children do not see it.
func FromEnv() (*os.File, error) {
	v, ok := os.LookupEnv(EnvFD)
	if !ok {
		return nil, nil
	}
	_ = os.Unsetenv(EnvFD)
	fd, err := strconv.Atoi(v)
	if err != nil || fd < 3 {
		return nil, fmt.Errorf("cgexec: %s=%q is not an inherited file descriptor", EnvFD, v)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("cgexec: %s=%d: %w", EnvFD, fd, err)
	}
	syscall.CloseOnExec(fd)
	return os.NewFile(uintptr(fd), "cgroup.procs"), nil
}

// Handoff is one wrapped start in progress.
type Handoff struct {
	parent, child *os.File
	path          string
}

// Prepare rewrites cmd, not yet started and without ExtraFiles, so that
// Start runs the wrapper for cmd.Path and cmd.Args. After a successful
// Start (or pty.Start) call Place; after a failed one, Close.
func Prepare(cmd *exec.Cmd) (*Handoff, error) {
	if len(cmd.ExtraFiles) > 0 {
		return nil, errors.New("cgexec: commands with ExtraFiles are not supported")
	}
	h, err := NewHandoff()
	if err != nil {
		return nil, err
	}
	cmd.Path, cmd.Args = h.Wrap(cmd.Path, cmd.Args)
	cmd.ExtraFiles = []*os.File{h.ChildFile()}
	return h, nil
}

// NewHandoff creates the handoff socket. For starters that do not use
// os/exec: run Wrap's path and argv with ChildFile as fd 3, then Place.
func NewHandoff() (*Handoff, error) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("cgexec: socketpair: %w", err)
	}
	return &Handoff{
		parent: os.NewFile(uintptr(fds[0]), "cgexec-parent"),
		child:  os.NewFile(uintptr(fds[1]), "cgexec-child"),
	}, nil
}

// Wrap returns the path and argv that run the wrapper for path and argv.
func (h *Handoff) Wrap(path string, argv []string) (string, []string) {
	h.path = path
	if len(argv) == 0 {
		argv = []string{path}
	}
	return "/proc/self/exe", append([]string{wrapperArg0, path}, argv...)
}

// ChildFile is the wrapper's end of the handoff socket (its fd 3).
func (h *Handoff) ChildFile() *os.File { return h.child }

// Close releases the handoff (idempotent). A wrapper still waiting exits
// without running anything.
func (h *Handoff) Close() {
	_ = h.child.Close()
	_ = h.parent.Close()
}

// Place moves the started wrapper pid into the group of procs (a
// cgroup.procs file open for writing), lets it exec the command and waits
// for the exec. On any error the wrapper is killed (SIGKILL) and the caller
// must still reap it. The handoff is closed in every case.
func (h *Handoff) Place(pid int, procs *os.File) error {
	defer h.Close()
	_ = h.child.Close()
	fail := func(err error) error {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		return err
	}
	// The wrapper's runtime has started every thread it will ever need.
	var ready [1]byte
	if n, err := h.parent.Read(ready[:]); n != 1 || ready[0] != 'r' {
		return fail(fmt.Errorf("cgexec: wrapper %d did not become ready: %q %v", pid, ready[:n], err))
	}
	if _, err := procs.WriteString(strconv.Itoa(pid)); err != nil {
		return fail(fmt.Errorf("cgexec: move %d into the user cgroup: %w", pid, err))
	}
	if _, err := h.parent.Write([]byte{'g'}); err != nil {
		return fail(fmt.Errorf("cgexec: release %d: %w", pid, err))
	}
	// EOF: the exec succeeded (the socket is close-on-exec); otherwise the
	// wrapper's errno.
	var buf [16]byte
	n, err := h.parent.Read(buf[:])
	if n == 0 {
		if errors.Is(err, io.EOF) {
			return nil
		}
		return fail(fmt.Errorf("cgexec: wait for exec of %d: %w", pid, err))
	}
	errno, perr := strconv.Atoi(string(buf[:n]))
	if perr != nil {
		return fail(fmt.Errorf("cgexec: bad status %q from wrapper %d", buf[:n], pid))
	}
	return fail(&os.PathError{Op: "fork/exec", Path: h.path, Err: syscall.Errno(errno)})
}
