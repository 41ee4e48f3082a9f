package egress

import (
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/spacesbx/space/internal/netpolicy"
)

// learned remembers, per sandbox, which addresses the DNS server returned
// for which allowed names, so a non-TLS, non-HTTP connection (ssh, git) to
// an allowed domain can be recognised by its address.
type learned struct {
	mu sync.Mutex
	m  map[netip.Addr]map[string]time.Time // addr -> name -> expiry
}

func newLearned() *learned { return &learned{m: make(map[netip.Addr]map[string]time.Time)} }

func (l *learned) add(a netip.Addr, name string, ttl time.Duration, now time.Time) {
	ttl = min(max(ttl, learnedMinTTL), learnedMaxTTL)
	a = a.Unmap()
	l.mu.Lock()
	defer l.mu.Unlock()
	names := l.m[a]
	if names == nil {
		if len(l.m) >= learnedMaxAddr {
			l.sweepLocked(now)
			// Still nearly full: forget some at random down to 7/8
			// (amortised; forgetting only costs the sandbox a DNS lookup
			// before its next connect).
			for k := range l.m {
				if len(l.m) < learnedMaxAddr*7/8 {
					break
				}
				delete(l.m, k)
			}
		}
		names = make(map[string]time.Time)
		l.m[a] = names
	}
	if _, ok := names[name]; !ok && len(names) >= learnedMaxName {
		for n, exp := range names {
			if now.After(exp) {
				delete(names, n)
			}
		}
		for n := range names {
			if len(names) < learnedMaxName {
				break
			}
			delete(names, n)
		}
	}
	if exp := now.Add(ttl); exp.After(names[name]) {
		names[name] = exp
	}
}

func (l *learned) sweepLocked(now time.Time) {
	for a, names := range l.m {
		for n, exp := range names {
			if now.After(exp) {
				delete(names, n)
			}
		}
		if len(names) == 0 {
			delete(l.m, a)
		}
	}
}

// allowed returns a name learned for a, unexpired and allowed by pol ("" if
// none); the smallest such name, so the answer does not depend on map order.
func (l *learned) allowed(a netip.Addr, pol *netpolicy.Policy, now time.Time) string {
	l.mu.Lock()
	var names []string
	for n, exp := range l.m[a.Unmap()] {
		if !now.After(exp) {
			names = append(names, n)
		}
	}
	l.mu.Unlock()
	slices.Sort(names)
	for _, n := range names {
		if pol.Name(n).Allow {
			return n
		}
	}
	return ""
}
