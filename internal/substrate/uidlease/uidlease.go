//go:build linux

// Package uidlease hands out host uid ranges that no two running
// instances on a machine share: a range is held by an flock on a file
// named after its first uid, so a crashed holder releases it with its
// last open descriptor and several processes (space up, space-node) on
// one host coordinate through the lock directory alone.
package uidlease

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

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
		return &Lease{first: id, f: f}, nil
	}
	return nil, fmt.Errorf("uidlease: all %d ranges from %d are in use", count, first)
}

// Release gives the range back. Idempotent; nil-safe.
func (l *Lease) Release() {
	if l != nil && l.f != nil {
		_ = l.f.Close()
		l.f = nil
	}
}
