package store

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/testenv"
)

func TestLeaseDeadline(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	cases := []struct {
		ttl, margin time.Duration
		want        time.Time
	}{
		{10 * time.Second, 2500 * time.Millisecond, t0.Add(7500 * time.Millisecond)},
		{10 * time.Second, 0, t0.Add(10 * time.Second)},
		{2 * time.Second, 500 * time.Millisecond, t0.Add(1500 * time.Millisecond)},
		// A margin at or above the TTL: lost at once (at or before the send).
		{time.Second, time.Second, t0},
		{time.Second, 3 * time.Second, t0.Add(-2 * time.Second)},
	}
	for _, c := range cases {
		if got := LeaseDeadline(t0, c.ttl, c.margin); !got.Equal(c.want) {
			t.Errorf("LeaseDeadline(t0, %s, %s) = %s, want %s", c.ttl, c.margin, got, c.want)
		}
		if got := (LeaseRenewal{Sent: t0, TTL: c.ttl}).Deadline(c.margin); !got.Equal(c.want) {
			t.Errorf("Deadline: %s, want %s", got, c.want)
		}
	}
}

// renewals collects a registration's renewals.
type renewals struct {
	mu  sync.Mutex
	all []LeaseRenewal
}

func (r *renewals) add(l LeaseRenewal) { r.mu.Lock(); r.all = append(r.all, l); r.mu.Unlock() }
func (r *renewals) list() []LeaseRenewal {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]LeaseRenewal(nil), r.all...)
}
func (r *renewals) last() LeaseRenewal { l := r.list(); return l[len(l)-1] }

// A worker's client cut off from etcd (a proxy between them closes every
// connection) gets no renewal answered; etcd expires the lease no earlier
// than the last answered renewal's send time + TTL (the deadline the
// worker fences at is before that); healed, the registration is made
// again under a new lease (Fresh).
func TestRegistrationRenewalsAcrossAPartition(t *testing.T) {
	srv := openTest(t, t.TempDir())
	t.Cleanup(func() { srv.Close() })
	proxy := testenv.NewCutProxy(t, strings.TrimPrefix(srv.Endpoints()[0], "http://"))
	ctx := context.Background()
	cli, err := Open(ctx, Config{Endpoints: []string{"http://" + proxy.Addr()}, DialTimeout: 2 * time.Second, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	var rn renewals
	const ttl = 2 * time.Second
	before := time.Now()
	reg, err := cli.RegisterWorkerObserved(ctx, spacev1.Worker{ID: "w1", NodeURL: "http://n1"}, ttl, rn.add)
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Close()
	first := rn.list()
	if len(first) != 1 || !first[0].Fresh || first[0].TTL != ttl || first[0].Sent.Before(before) || first[0].Lease == 0 {
		t.Fatalf("first renewal (the grant) %+v", first)
	}
	// Renewals every third of the TTL, each after the one before.
	deadline := time.Now().Add(10 * time.Second)
	for len(rn.list()) < 4 {
		if time.Now().After(deadline) {
			t.Fatalf("renewals: %+v", rn.list())
		}
		time.Sleep(50 * time.Millisecond)
	}
	all := rn.list()
	for i := 1; i < len(all); i++ {
		if all[i].Fresh || all[i].Lease != all[0].Lease || !all[i].Sent.After(all[i-1].Sent) || all[i].TTL != ttl {
			t.Fatalf("renewal %d: %+v after %+v", i, all[i], all[i-1])
		}
	}

	proxy.Cut()
	cutAt := time.Now()
	n := len(rn.list())
	// The entry vanishes when etcd expires the lease: never before the
	// last answered renewal's send time + TTL.
	for {
		if _, err := srv.GetWorker(ctx, "w1"); errors.Is(err, errdefs.ErrNotFound) {
			break
		}
		if time.Since(cutAt) > 15*time.Second {
			t.Fatal("lease of a cut-off worker never expired")
		}
		time.Sleep(20 * time.Millisecond)
	}
	gone := time.Now()
	last := rn.last()
	if gone.Before(last.Deadline(0)) {
		t.Fatalf("etcd expired the lease at %s, before the last renewal's send time + ttl %s", gone, last.Deadline(0))
	}
	if got := len(rn.list()); got > n+1 { // at most one answer in flight at the cut
		t.Fatalf("renewals answered while cut: %d -> %d", n, got)
	}

	proxy.Heal()
	deadline = time.Now().Add(20 * time.Second)
	for !rn.last().Fresh || rn.last().Lease == last.Lease {
		if time.Now().After(deadline) {
			t.Fatalf("not registered again after the heal: %+v", rn.last())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := srv.GetWorker(ctx, "w1"); err != nil {
		t.Fatalf("entry after registering again: %v", err)
	}
}
