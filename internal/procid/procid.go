// Package procid identifies processes and the peers of Unix sockets well
// enough to notice a replacement: a pid is only trusted together with the
// process start time (which a reused pid cannot share) and the identity of
// its executable.
package procid

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// ErrMismatch means the process or peer is not the one expected.
var ErrMismatch = errors.New("process identity mismatch")

// Process is the identity of a running process.
type Process struct {
	PID int `json:"pid"`
	// StartTime is field 22 of /proc/<pid>/stat (clock ticks since boot).
	StartTime uint64 `json:"start_time"`
	// ExeDev and ExeIno identify the executable file.
	ExeDev uint64 `json:"exe_dev"`
	ExeIno uint64 `json:"exe_ino"`
	// ExeSHA256 is the hex SHA-256 of the executable's content. Only Open
	// computes it (once, when the process is recorded); Read leaves it
	// empty, and Process.Check ignores it.
	ExeSHA256 string `json:"exe_sha256,omitempty"`
}

// exeMeta is what a stat of the executable says about its content: any
// write to the file changes its size or its mtime/ctime.
type exeMeta struct {
	size         int64
	mtime, ctime unix.Timespec
}

// Read returns the identity of pid as it is now.
func Read(pid int) (Process, error) {
	p, _, err := read(pid)
	return p, err
}

func read(pid int) (Process, exeMeta, error) {
	st, err := StartTime(pid)
	if err != nil {
		return Process{}, exeMeta{}, err
	}
	var s unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/exe", pid), &s); err != nil {
		return Process{}, exeMeta{}, fmt.Errorf("procid: stat exe of %d: %w", pid, err)
	}
	// Re-read the start time: if the pid was reused between the two reads
	// the executable we looked at may belong to the newcomer.
	st2, err := StartTime(pid)
	if err != nil || st2 != st {
		return Process{}, exeMeta{}, fmt.Errorf("procid: %w: pid %d changed while reading", ErrMismatch, pid)
	}
	return Process{PID: pid, StartTime: st, ExeDev: uint64(s.Dev), ExeIno: s.Ino},
		exeMeta{size: s.Size, mtime: s.Mtim, ctime: s.Ctim}, nil
}

// same reports whether now (from Read) is the process p: pid, start time
// and executable file.
func (p Process) same(now Process) bool {
	return now.PID == p.PID && now.StartTime == p.StartTime && now.ExeDev == p.ExeDev && now.ExeIno == p.ExeIno
}

func (p Process) mismatch(now Process) error {
	return fmt.Errorf("procid: %w: pid %d is not the recorded process (start %d/%d, exe %d:%d/%d:%d)",
		ErrMismatch, p.PID, now.StartTime, p.StartTime, now.ExeDev, now.ExeIno, p.ExeDev, p.ExeIno)
}

// Check verifies that p still names the same live process: pid, start
// time and executable device+inode. It is the fallback when no pidfd is
// held (see Handle for the stronger check).
func (p Process) Check() error {
	now, err := Read(p.PID)
	if err != nil {
		return fmt.Errorf("procid: %w: pid %d: %v", ErrMismatch, p.PID, err)
	}
	if !p.same(now) {
		return p.mismatch(now)
	}
	return nil
}

// StartTime reads the start time of pid from /proc/<pid>/stat.
func StartTime(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("procid: read stat of %d: %w", pid, err)
	}
	return parseStartTime(b)
}

// parseStartTime extracts field 22. The command name (field 2) may contain
// spaces and parentheses, so fields are counted after the last ')'.
func parseStartTime(stat []byte) (uint64, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, fmt.Errorf("procid: malformed stat")
	}
	fields := bytes.Fields(stat[i+1:])
	// fields[0] is field 3 (state); field 22 is fields[19].
	if len(fields) < 20 {
		return 0, fmt.Errorf("procid: malformed stat: %d fields", len(fields))
	}
	v, err := strconv.ParseUint(string(fields[19]), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("procid: malformed start time: %w", err)
	}
	return v, nil
}

// PeerCred returns the credentials of the process on the other end of a
// Unix socket connection, as the kernel recorded them at connect/listen time.
func PeerCred(c net.Conn) (*unix.Ucred, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, fmt.Errorf("procid: not a unix connection: %T", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("procid: %w", err)
	}
	var cred *unix.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, fmt.Errorf("procid: %w", err)
	}
	if serr != nil {
		return nil, fmt.Errorf("procid: SO_PEERCRED: %w", serr)
	}
	return cred, nil
}

// VerifyPeer checks that the peer of c is the process p, still alive with
// the same start time and executable.
func VerifyPeer(c net.Conn, p Process) error {
	cred, err := PeerCred(c)
	if err != nil {
		return err
	}
	if int(cred.Pid) != p.PID {
		return fmt.Errorf("procid: %w: peer pid %d, expected %d", ErrMismatch, cred.Pid, p.PID)
	}
	return p.Check()
}

// IsGone reports whether err means the process no longer exists.
func IsGone(err error) bool { return errors.Is(err, syscall.ESRCH) || errors.Is(err, os.ErrNotExist) }
