package store

import "time"

// LeaseRenewal is one grant or answered keep-alive of a registration's
// lease.
type LeaseRenewal struct {
	// Lease is the etcd lease id.
	Lease int64
	// Sent is when the request etcd answered was sent (before the grant
	// for a new lease): etcd extended the lease at or after Sent.
	Sent time.Time
	// TTL is the lease's TTL as etcd answered it (etcd may raise a short
	// one to its minimum).
	TTL time.Duration
	// Fresh marks a new lease: the registration was made (again); an
	// earlier lease lapsed.
	Fresh bool
}

// LeaseDeadline is the latest time at which a lease renewed by a request
// sent at sent, of ttl, is certainly still alive in etcd, minus margin:
// etcd extends the lease to ttl from when it handles the renewal, which is
// never before the request was sent. A holder that stops acting at the
// deadline stops before etcd can expire the lease, and so before anyone
// who watches the lease may act on its loss. A margin at or above ttl
// gives a deadline at or before sent: the lease is treated as lost at once.
func LeaseDeadline(sent time.Time, ttl, margin time.Duration) time.Time {
	return sent.Add(ttl - margin)
}

// Deadline is LeaseDeadline of the renewal.
func (l LeaseRenewal) Deadline(margin time.Duration) time.Time {
	return LeaseDeadline(l.Sent, l.TTL, margin)
}

func (r *Registration) renewed(l LeaseRenewal) {
	if r.onRenew != nil {
		r.onRenew(l)
	}
}
