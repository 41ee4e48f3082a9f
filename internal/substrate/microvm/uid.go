//go:build linux

package microvm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// uidLease is a host uid held for one instance: an flock on
// <UIDLockDir>/<uid> that lives as long as the open file (released by
// release or when the holding process dies).
type uidLease struct {
	uid uint32
	f   *os.File
}

// leaseUID takes the first free uid of [first, first+count), starting at
// a spot derived from hint so concurrent starts rarely contend.
func leaseUID(dir string, first, count uint32, hint uint32) (*uidLease, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("microvm: uid lock dir: %w", err)
	}
	for i := uint32(0); i < count; i++ {
		uid := first + (hint+i)%count
		f, err := os.OpenFile(filepath.Join(dir, strconv.FormatUint(uint64(uid), 10)), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, fmt.Errorf("microvm: uid lock: %w", err)
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			f.Close()
			if errors.Is(err, unix.EWOULDBLOCK) {
				continue
			}
			return nil, fmt.Errorf("microvm: uid lock: %w", err)
		}
		return &uidLease{uid: uid, f: f}, nil
	}
	return nil, fmt.Errorf("microvm: all %d uids from %d are in use", count, first)
}

func (l *uidLease) release() {
	if l != nil && l.f != nil {
		_ = l.f.Close()
		l.f = nil
	}
}
