package guest

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"

	"golang.org/x/sys/unix"
)

// SealFDs makes sure no descriptor but 0, 1 and 2 reaches a command the
// agent starts. Everything the agent opens itself is close-on-exec (Go
// opens all files that way), but descriptors it inherited are not: a
// descriptor leaked by whatever started the sandbox (fd 251 of `space up`'s
// parent was open in pid 1 and in every command), and the listener (fd 3)
// and user cgroup.procs (fd 4), which the agent keeps but user code must
// never get: with the listener, a command could answer the host's
// connections in the agent's place.
//
// Inherited descriptors other than keep are closed (a descriptor the
// runtime opened before this call is close-on-exec, so it is not taken
// for an inherited one), then every descriptor from 3 up, keep included,
// is marked close-on-exec. Call it first thing at startup, before any
// goroutine starts commands.
func SealFDs(keep ...int) error {
	// Marking comes whatever closing did: it needs no /proc (not yet
	// mounted when the agent starts as a VM's init) when close_range works.
	return errors.Join(closeInherited(keep), cloexecFrom(3))
}

// closeInherited closes the descriptors from 3 up that are not
// close-on-exec and not in keep.
func closeInherited(keep []int) error {
	fds, err := openFDs()
	if err != nil {
		return err
	}
	var errs []error
	for _, fd := range fds {
		if fd < 3 || slices.Contains(keep, fd) {
			continue
		}
		flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
		if err != nil || flags&unix.FD_CLOEXEC != 0 {
			continue // gone meanwhile (the listing's own), or the agent's
		}
		if err := unix.Close(fd); err != nil {
			errs = append(errs, fmt.Errorf("close inherited fd %d: %w", fd, err))
		}
	}
	return errors.Join(errs...)
}

// cloexecFrom marks every descriptor from first up close-on-exec: one
// close_range call, or fcntl per descriptor where the kernel (before 5.11)
// or a seccomp filter refuses it.
func cloexecFrom(first int) error {
	if err := unix.CloseRange(uint(first), ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err == nil {
		return nil
	}
	fds, err := openFDs()
	if err != nil {
		return err
	}
	var errs []error
	for _, fd := range fds {
		if fd < first {
			continue
		}
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, unix.FD_CLOEXEC); err != nil && !errors.Is(err, unix.EBADF) {
			errs = append(errs, fmt.Errorf("mark fd %d close-on-exec: %w", fd, err))
		}
	}
	return errors.Join(errs...)
}

// openFDs lists the process's open descriptors (including, briefly, the
// one reading the list).
func openFDs() ([]int, error) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil, fmt.Errorf("list open fds: %w", err)
	}
	fds := make([]int, 0, len(ents))
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil {
			fds = append(fds, fd)
		}
	}
	return fds, nil
}
