//go:build linux

// Package uidlease hands out host uid ranges that no two running
// instances on a machine share: a range is held by an flock on a file
// named after its first uid, so a crashed holder releases it with its
// last open descriptor and several processes (space up, space-node) on
// one host coordinate through the lock directory alone.
//
// A sandbox outlives the worker that leased its range (a worker restart
// or upgrade leaves sandboxes running), and with the worker goes its
// flock. So a lease is also bound to the process that runs in the range
// (Bind writes its owner tag into the lock file: boot id, pid, start
// time): Acquire passes over a range whose tag names a process that is
// still alive, and the next worker takes the range back with Adopt. A
// range whose owner died is free again, whoever held its lock.
package uidlease

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Lease is one held range [First, First+stride).
type Lease struct {
	first uint32
	f     *os.File
}

// First is the first host uid (and gid) of the range.
func (l *Lease) First() uint32 { return l.first }

// Acquire takes the first free range of count ranges of stride uids each,
// starting at first, probing from a spot derived from hint so that
// concurrent callers rarely contend for the same lock file.
func Acquire(dir string, first, count, stride, hint uint32) (*Lease, error) {
	if count == 0 || stride == 0 {
		return nil, errors.New("uidlease: empty range")
	}
	if uint64(first)+uint64(count)*uint64(stride) > 1<<32-2 {
		return nil, fmt.Errorf("uidlease: range %d+%d*%d passes the largest uid", first, count, stride)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("uidlease: lock dir: %w", err)
	}
	for i := uint32(0); i < count; i++ {
		id := first + ((hint+i)%count)*stride
		f, err := os.OpenFile(filepath.Join(dir, strconv.FormatUint(uint64(id), 10)), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, fmt.Errorf("uidlease: lock: %w", err)
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			f.Close()
			if errors.Is(err, unix.EWOULDBLOCK) {
				continue
			}
			return nil, fmt.Errorf("uidlease: lock: %w", err)
		}
		if owner, ok := readTag(f); ok {
			// A tag is left only by a holder that died. Its owner may
			// live (a sandbox outlived its worker), or have died after
			// starting processes of the range the tag does not name (a
			// VMM started just before its worker died, before the tag
			// named it): either way the range is in use.
			if owner.alive() || rangeInUse(id, stride) {
				f.Close()
				continue
			}
		}
		if err := f.Truncate(0); err != nil {
			f.Close()
			return nil, fmt.Errorf("uidlease: lock: %w", err)
		}
		return &Lease{first: id, f: f}, nil
	}
	return nil, fmt.Errorf("uidlease: all %d ranges from %d are in use", count, first)
}

// Release gives the range back: its owner tag is cleared, so the range
// is free even while another process still holds a copy of the lock.
// Idempotent; nil-safe. Call it only once no process runs in the range.
func (l *Lease) Release() {
	if l != nil && l.f != nil {
		_ = l.f.Truncate(0)
		_ = l.f.Close()
		l.f = nil
	}
}

// Detach lets go of the lock and keeps the owner tag: the range stays
// leased for as long as its owner lives, and the next process takes it
// back with Adopt. Idempotent; nil-safe.
func (l *Lease) Detach() {
	if l != nil && l.f != nil {
		_ = l.f.Close()
		l.f = nil
	}
}

// Bind records pid as the process that runs in the range: from now on
// the range stays leased while that process lives, whether or not this
// lease's holder does.
func (l *Lease) Bind(pid int) error {
	if l == nil || l.f == nil {
		return errors.New("uidlease: bind: lease released")
	}
	t, err := tagOf(pid)
	if err != nil {
		return fmt.Errorf("uidlease: bind: %w", err)
	}
	if err := l.f.Truncate(0); err != nil {
		return fmt.Errorf("uidlease: bind: %w", err)
	}
	if _, err := l.f.WriteAt([]byte(t.String()), 0); err != nil {
		return fmt.Errorf("uidlease: bind: %w", err)
	}
	return nil
}

// adoptWait bounds how long Adopt waits for the range's lock, which
// another process may hold for a moment while it reads the tag.
const adoptWait = 5 * time.Second

// ErrNotOwner is Adopt's answer when the range is not bound to the
// process named.
var ErrNotOwner = errors.New("uidlease: range is not bound to that process")

// Adopt takes back the range starting at first whose lease was bound to
// pid by an earlier process (Bind), for as long as pid is that process
// (same start time, this boot). The lease keeps its tag.
func Adopt(dir string, first uint32, pid int) (*Lease, error) {
	want, err := tagOf(pid)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNotOwner, err)
	}
	f, err := os.OpenFile(filepath.Join(dir, strconv.FormatUint(uint64(first), 10)), os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("uidlease: adopt: %w", err)
	}
	deadline := time.Now().Add(adoptWait)
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) || time.Now().After(deadline) {
			f.Close()
			return nil, fmt.Errorf("uidlease: adopt range %d: %w", first, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got, ok := readTag(f); !ok || got != want {
		f.Close()
		return nil, fmt.Errorf("%w (range %d, pid %d)", ErrNotOwner, first, pid)
	}
	return &Lease{first: first, f: f}, nil
}

// rangeInUse reports whether any process runs with a uid in
// [first, first+n). It scans /proc, so Acquire asks it only of a range
// whose holder died without releasing it.
func rangeInUse(first, n uint32) bool {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return true // cannot tell: fail closed
	}
	in := func(v string) bool {
		u, err := strconv.ParseUint(v, 10, 32)
		return err == nil && u >= uint64(first) && u < uint64(first)+uint64(n)
	}
	for _, e := range ents {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/status")
		if err != nil {
			continue // gone meanwhile
		}
		// Real, effective, saved and file-system uids: any in the range.
		for _, line := range strings.Split(string(b), "\n") {
			if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
				for _, f := range strings.Fields(rest) {
					if in(f) {
						return true
					}
				}
				break
			}
		}
	}
	return false
}

// tag names one process of one boot.
type tag struct {
	boot  string
	pid   int
	start uint64
}

func (t tag) String() string { return fmt.Sprintf("%s %d %d\n", t.boot, t.pid, t.start) }

// alive reports whether the process t names still runs.
func (t tag) alive() bool {
	now, err := tagOf(t.pid)
	return err == nil && now == t
}

func tagOf(pid int) (tag, error) {
	boot, err := bootID()
	if err != nil {
		return tag{}, err
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return tag{}, err
	}
	// Field 22 (start time) counted after the last ')': the command name
	// may hold spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return tag{}, errors.New("malformed stat")
	}
	fields := bytes.Fields(b[i+1:])
	if len(fields) < 20 {
		return tag{}, errors.New("malformed stat")
	}
	start, err := strconv.ParseUint(string(fields[19]), 10, 64)
	if err != nil {
		return tag{}, errors.New("malformed stat")
	}
	return tag{boot: boot, pid: pid, start: start}, nil
}

// readTag reads f's owner tag; ok is false for an empty or malformed one.
func readTag(f *os.File) (tag, bool) {
	b := make([]byte, 128)
	n, _ := f.ReadAt(b, 0)
	fields := strings.Fields(string(b[:n]))
	if len(fields) != 3 {
		return tag{}, false
	}
	pid, err1 := strconv.Atoi(fields[1])
	start, err2 := strconv.ParseUint(fields[2], 10, 64)
	if err1 != nil || err2 != nil || pid <= 0 {
		return tag{}, false
	}
	return tag{boot: fields[0], pid: pid, start: start}, true
}

var (
	bootOnce sync.Once
	boot     string
	bootErr  error
)

// bootID is this boot's id: a pid and start time name a process of one
// boot only.
func bootID() (string, error) {
	bootOnce.Do(func() {
		b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
		boot, bootErr = strings.TrimSpace(string(b)), err
	})
	return boot, bootErr
}
