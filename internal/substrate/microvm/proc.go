//go:build linux

package microvm

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// A QEMU outlives the worker that started it, so the next worker finds it
// by pid and must make sure the pid still names that very process: a
// pidfd pins the process (a pid can be reused, a pidfd's process cannot),
// and what /proc says about the pid counts only once the pidfd shows the
// process alive after the reads.

// procID is what names one QEMU process of one boot and what it runs.
type procID struct {
	Boot   string `json:"boot_id"`
	PID    int    `json:"pid"`
	Start  uint64 `json:"start_time"` // /proc/<pid>/stat field 22, clock ticks after boot
	ExeDev uint64 `json:"exe_dev"`
	ExeIno uint64 `json:"exe_ino"`
	UID    uint32 `json:"uid"`
	GID    uint32 `json:"gid"`
	Leased bool   `json:"uid_leased"` // UID is a uidlease range of one (the substrate ran as root)
}

// openPidfd returns a non-blocking pidfd of pid as a file the runtime's
// poller watches (see waitExit).
func openPidfd(pid int) (*os.File, error) {
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("pidfd of %d: %w", pid, err)
	}
	unix.CloseOnExec(fd)
	return os.NewFile(uintptr(fd), "pidfd-"+strconv.Itoa(pid)), nil
}

// signalPidfd sends sig to the process of f (sig 0 only checks that it
// has not exited).
func signalPidfd(f *os.File, sig syscall.Signal) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.PidfdSendSignal(int(fd), sig, nil, 0) }); err != nil {
		return err
	}
	return serr
}

func pidfdReadable(fd uintptr) bool {
	for {
		p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(p, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return err != nil || n > 0
	}
}

// waitExit returns nil once the process of f has exited, or an error once
// f is closed. It parks in the runtime's poller (a pidfd is readable when
// its process exits), so watching a VM takes no OS thread.
func waitExit(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	return rc.Read(pidfdReadable)
}

// procStat reads pid's state letter and start time from /proc/<pid>/stat.
func procStat(pid int) (state byte, start uint64, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, err
	}
	// Fields are counted after the last ')': the command name may hold
	// spaces and parentheses. State is field 3, start time field 22.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, errors.New("malformed stat")
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 20 || len(f[0]) != 1 {
		return 0, 0, errors.New("malformed stat")
	}
	start, err = strconv.ParseUint(string(f[19]), 10, 64)
	if err != nil {
		return 0, 0, errors.New("malformed stat")
	}
	return f[0][0], start, nil
}

// procCreds returns pid's real, effective, saved and file-system uids and
// gids from /proc/<pid>/status.
func procCreds(pid int) (uids, gids []uint32, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return nil, nil, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || (k != "Uid" && k != "Gid") {
			continue
		}
		var ids []uint32
		for _, s := range strings.Fields(v) {
			n, err := strconv.ParseUint(s, 10, 32)
			if err != nil {
				return nil, nil, fmt.Errorf("malformed status: %s", line)
			}
			ids = append(ids, uint32(n))
		}
		if k == "Uid" {
			uids = ids
		} else {
			gids = ids
		}
	}
	if len(uids) != 4 || len(gids) != 4 {
		return nil, nil, errors.New("malformed status: no Uid or Gid line")
	}
	return uids, gids, nil
}

// exeOf returns the device and inode of the file pid executes (the
// running binary, even if its path was replaced or removed since).
func exeOf(pid int) (dev, ino uint64, err error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/"+strconv.Itoa(pid)+"/exe", &st); err != nil {
		return 0, 0, err
	}
	return st.Dev, st.Ino, nil
}

// identify records what names the running process of pidfd f (pid) now
// (Leased is the caller's).
func identify(f *os.File, pid int) (procID, error) {
	id := procID{PID: pid}
	var err error
	if id.Boot, err = bootID(); err != nil {
		return id, err
	}
	var state byte
	if state, id.Start, err = procStat(pid); err != nil {
		return id, err
	}
	if id.ExeDev, id.ExeIno, err = exeOf(pid); err != nil {
		return id, err
	}
	uids, gids, err := procCreds(pid)
	if err != nil {
		return id, err
	}
	id.UID, id.GID = uids[0], gids[0]
	if state == 'Z' || state == 'X' || signalPidfd(f, 0) != nil {
		return id, fmt.Errorf("process %d exited", pid)
	}
	return id, nil
}

// verify checks that the process of pidfd f is the one want names: this
// boot, the same start time (so not a reused pid), the same executable
// file, running as want.UID alone (every uid and gid). The pidfd is
// checked last: /proc's answers were the pinned process's.
func (want procID) verify(f *os.File) error {
	boot, err := bootID()
	if err != nil {
		return err
	}
	if boot != want.Boot {
		return fmt.Errorf("recorded in another boot (%s, this is %s)", want.Boot, boot)
	}
	state, start, err := procStat(want.PID)
	if err != nil {
		return fmt.Errorf("process %d: %w", want.PID, err)
	}
	if start != want.Start {
		return fmt.Errorf("process %d started at tick %d, the recorded qemu at %d: another process", want.PID, start, want.Start)
	}
	if state == 'Z' || state == 'X' {
		return fmt.Errorf("qemu %d exited", want.PID)
	}
	dev, ino, err := exeOf(want.PID)
	if err != nil {
		return fmt.Errorf("process %d: executable: %w", want.PID, err)
	}
	if dev != want.ExeDev || ino != want.ExeIno {
		return fmt.Errorf("process %d runs file %d:%d, the recorded qemu binary is %d:%d", want.PID, dev, ino, want.ExeDev, want.ExeIno)
	}
	uids, gids, err := procCreds(want.PID)
	if err != nil {
		return fmt.Errorf("process %d: %w", want.PID, err)
	}
	for i := range uids {
		if uids[i] != want.UID || gids[i] != want.GID {
			return fmt.Errorf("process %d runs as uids %v gids %v, the recorded qemu as %d:%d", want.PID, uids, gids, want.UID, want.GID)
		}
	}
	if err := signalPidfd(f, 0); err != nil {
		return fmt.Errorf("qemu %d exited: %w", want.PID, err)
	}
	return nil
}

// bootID is this boot's id: a pid and start time name a process of one
// boot only.
var bootID = sync.OnceValues(func() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	return strings.TrimSpace(string(b)), err
})
