// Package scheduler places sandboxes on workers: among the live workers with
// free capacity it takes K random candidates and keeps the least loaded
// ("best of K", K=2 by default), which spreads load nearly as well as a
// global minimum while avoiding a herd on the single emptiest worker when
// the view of load is stale.
//
// It is pure: no I/O, randomness injected.
package scheduler

import (
	"fmt"
	"math/rand/v2"
	"sync"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

// Worker states that accept placements.
const StateReady = "ready"

// DefaultK is the number of random candidates compared.
const DefaultK = 2

// ErrNoCapacity is returned when no live worker has free capacity. It is an
// errdefs.ErrUnavailable: a later try may find room.
var ErrNoCapacity = errdefs.Message(errdefs.ErrUnavailable, "no worker with free capacity")

// Scheduler picks workers. It is safe for concurrent use.
type Scheduler struct {
	k  int
	mu sync.Mutex
	r  *rand.Rand
}

// New returns a best-of-k scheduler (k <= 0 means DefaultK). src seeds the
// random choices; nil uses a random seed.
func New(k int, src rand.Source) *Scheduler {
	if k <= 0 {
		k = DefaultK
	}
	if src == nil {
		src = rand.NewPCG(rand.Uint64(), rand.Uint64())
	}
	return &Scheduler{k: k, r: rand.New(src)}
}

// Eligible reports whether w may take one more sandbox: state ready, a
// declared capacity (> 0) and load below it.
func Eligible(w spacev1.Worker) bool {
	return w.State == StateReady && w.Capacity > 0 && w.Load < w.Capacity && w.NodeURL != ""
}

// less orders by load ratio, then absolute load, then id (deterministic).
func less(a, b spacev1.Worker) bool {
	// a.Load/a.Capacity < b.Load/b.Capacity without floating point.
	l, r := int64(a.Load)*int64(b.Capacity), int64(b.Load)*int64(a.Capacity)
	if l != r {
		return l < r
	}
	if a.Load != b.Load {
		return a.Load < b.Load
	}
	return a.ID < b.ID
}

// Pick chooses a worker among workers, skipping ids in exclude (e.g. a
// worker that just failed an install). It returns an error wrapping
// ErrNoCapacity when none is eligible.
func (s *Scheduler) Pick(workers []spacev1.Worker, exclude ...string) (spacev1.Worker, error) {
	cands := make([]spacev1.Worker, 0, len(workers))
outer:
	for _, w := range workers {
		for _, x := range exclude {
			if w.ID == x {
				continue outer
			}
		}
		if Eligible(w) {
			cands = append(cands, w)
		}
	}
	if len(cands) == 0 {
		return spacev1.Worker{}, fmt.Errorf("%w (%d registered, none ready below capacity)", ErrNoCapacity, len(workers))
	}
	k := min(s.k, len(cands))
	s.mu.Lock()
	// Partial Fisher-Yates: the first k entries become a uniform sample.
	for i := 0; i < k; i++ {
		j := i + s.r.IntN(len(cands)-i)
		cands[i], cands[j] = cands[j], cands[i]
	}
	s.mu.Unlock()
	best := cands[0]
	for _, w := range cands[1:k] {
		if less(w, best) {
			best = w
		}
	}
	return best, nil
}
