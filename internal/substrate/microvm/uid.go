//go:build linux

package microvm

import (
	"fmt"

	"github.com/spacesbx/space/internal/substrate/uidlease"
)

// uidLease is a host uid held for one instance (internal/substrate/uidlease
// with ranges of one uid).
type uidLease struct {
	uid uint32
	l   *uidlease.Lease
}

// leaseUID takes the first free uid of [first, first+count), starting at
// a spot derived from hint so concurrent starts rarely contend.
func leaseUID(dir string, first, count uint32, hint uint32) (*uidLease, error) {
	l, err := uidlease.Acquire(dir, first, count, 1, hint)
	if err != nil {
		return nil, fmt.Errorf("microvm: %w", err)
	}
	return &uidLease{uid: l.First(), l: l}, nil
}

func (l *uidLease) release() {
	if l != nil {
		l.l.Release()
	}
}
