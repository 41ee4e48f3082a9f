package edge

import (
	"context"
	"crypto/sha256"
	"net/url"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/identity"
)

// cacheKey identifies one cached authorization. The caller's token is
// kept only as a SHA-256 digest.
type cacheKey struct {
	sandbox  string
	purpose  capability.Purpose
	port     int
	protocol string
	caller   [32]byte
}

func keyFor(t target, callerToken string) cacheKey {
	return cacheKey{t.sandbox, t.purpose, t.port, t.protocol, sha256.Sum256([]byte(callerToken))}
}

// entry is an immutable cached route; replacements install a new entry.
type entry struct {
	route   identity.Route
	token   string
	expires time.Time
	node    *url.URL
	// authorizedUntil bounds the caller's authorization. It is set by a
	// caller-authorized response only; renewals and repairs may shorten
	// it but never extend it.
	authorizedUntil time.Time
	// mask is the sandbox's maskRequestHost (service ports).
	mask string
}

func newEntry(cr *spacev1.CapabilityResponse, authorizedUntil time.Time) *entry {
	node, _ := url.Parse(cr.NodeURL) // validated by fetchCapability
	return &entry{route: cr.Route, token: cr.Token, expires: cr.ExpiresAt, node: node, authorizedUntil: authorizedUntil, mask: cr.MaskRequestHost}
}

// capAuthorization applies a response's AuthorizedUntil to an existing
// bound: it can only shorten it.
func capAuthorization(bound time.Time, cr *spacev1.CapabilityResponse) time.Time {
	if !cr.AuthorizedUntil.IsZero() && cr.AuthorizedUntil.Before(bound) {
		return cr.AuthorizedUntil
	}
	return bound
}

// newRouteCache is the route cache: at most max entries, the least
// recently used evicted first (entries nobody asks for, expired ones among
// them, age out). It is not safe for concurrent use: e.mu guards it,
// because replaceIf, deleteIf and resolve compare and act under one lock.
func newRouteCache(max int) *simplelru.LRU[cacheKey, *entry] {
	c, err := simplelru.NewLRU[cacheKey, *entry](max, nil)
	if err != nil {
		panic(err) // max > 0: Validate and the default ensure it
	}
	return c
}

func (e *Edge) load(k cacheKey) *entry {
	e.mu.Lock()
	defer e.mu.Unlock()
	ent, _ := e.cache.Peek(k)
	return ent
}

// store installs ent unconditionally (a fresh caller authorization).
func (e *Edge) store(k cacheKey, ent *entry) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.cache.Add(k, ent)
}

// replaceIf installs ent only if the cache still holds an entry for the
// same route as old (compare-and-swap on the route). It reports whether it
// replaced. A late rejection of an older route therefore never evicts a
// newer entry, and an evicted entry is not resurrected.
func (e *Edge) replaceIf(k cacheKey, old, ent *entry) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	cur, ok := e.cache.Peek(k)
	if !ok || cur.route != old.route {
		return false
	}
	e.cache.Add(k, ent)
	return true
}

func (e *Edge) deleteIf(k cacheKey, old *entry) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if cur, ok := e.cache.Peek(k); ok && cur == old {
		e.cache.Remove(k)
	}
}

// flight is one in-progress control-plane resolution for a cache key;
// concurrent misses for the same key (same caller token) wait for it.
type flight struct {
	done chan struct{}
	ent  *entry
	err  error
}

// usable reports whether ent can be forwarded without asking the control
// plane (the test resolve applies to a cached entry).
func (e *Edge) usable(ent *entry) bool {
	now := e.cfg.Clock()
	return now.Before(ent.authorizedUntil) && now.Before(ent.expires.Add(-e.cfg.RenewBefore))
}

// resolve returns a usable route for the request: the cached one, a renewed
// one (edge key, same authorization bound) or a freshly authorized one
// (caller's token). Concurrent resolutions of one key are coalesced.
func (e *Edge) resolve(ctx context.Context, k cacheKey, t target, callerToken string) (*entry, error) {
	now := e.cfg.Clock()
	e.mu.Lock()
	ent, _ := e.cache.Get(k)
	if ent != nil && e.usable(ent) {
		e.mu.Unlock()
		return ent, nil
	}
	if f, ok := e.inflight[k]; ok {
		e.mu.Unlock()
		select {
		case <-f.done:
			return f.ent, f.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	f := &flight{done: make(chan struct{})}
	e.inflight[k] = f
	e.mu.Unlock()
	// The leader's cancellation must not fail the requests waiting on it.
	lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cpTimeout())
	f.ent, f.err = e.resolveSlow(lctx, k, t, callerToken, ent, now)
	cancel()
	e.mu.Lock()
	delete(e.inflight, k)
	e.mu.Unlock()
	close(f.done)
	return f.ent, f.err
}

func (e *Edge) resolveSlow(ctx context.Context, k cacheKey, t target, callerToken string, ent *entry, now time.Time) (*entry, error) {
	if ent != nil && now.Before(ent.authorizedUntil) {
		cr, err := e.fetchCapability(ctx, t, "", true)
		if err == nil {
			ne := newEntry(cr, capAuthorization(ent.authorizedUntil, cr))
			e.metrics.renewals.Inc()
			e.replaceIf(k, ent, ne)
			return ne, nil
		}
		if isNotFound(err) {
			e.deleteIf(k, ent)
			return nil, err
		}
		if ctx.Err() == nil && now.Before(ent.expires) {
			// The control plane is unavailable but the capability is
			// still valid: use it; the next request renews again.
			e.log.Warn("capability renewal failed; using current capability", "sandbox", t.sandbox, "err", err)
			return ent, nil
		}
		return nil, err
	}
	cr, err := e.fetchCapability(ctx, t, callerToken, false)
	if err != nil {
		if ent != nil {
			e.deleteIf(k, ent)
		}
		return nil, err
	}
	until := cr.AuthorizedUntil
	if until.IsZero() {
		until = cr.ExpiresAt
	}
	ne := newEntry(cr, until)
	e.store(k, ne)
	return ne, nil
}

// repair resolves the current route after the node answered RefreshRoute
// for old. The result keeps old's authorization bound and replaces the
// cache entry only if it still holds old's route.
func (e *Edge) repair(ctx context.Context, k cacheKey, t target, old *entry) (*entry, error) {
	cr, err := e.fetchCapability(ctx, t, "", true)
	if err != nil {
		if isNotFound(err) {
			e.deleteIf(k, old)
		}
		return nil, err
	}
	ne := newEntry(cr, capAuthorization(old.authorizedUntil, cr))
	replaced := e.replaceIf(k, old, ne)
	e.log.Info("route repaired", "sandbox", t.sandbox, "purpose", t.purpose,
		"rejected", old.route.String(), "current", ne.route.String(), "cache_replaced", replaced)
	return ne, nil
}
