// Package hostaddr follows the addresses of the network namespace a
// process runs in, so that a check made at connection time knows every
// address the host has now, not only those it had at start: the egress
// proxy must never connect a sandbox to the host itself, and a host gains
// addresses while it runs (a new interface, DHCP, a VPN, a test's
// simulated internet).
//
// The set is kept from a netlink address subscription. It fails closed:
// until the first listing has completed, and from a lost subscription
// until a new one is listening and the addresses are listed again,
// Contains answers true for every address.
package hostaddr

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// Config configures a Watcher.
type Config struct {
	// NetnsPath names the network namespace to follow. Default
	// /proc/self/ns/net: the process's own (its main thread's), whatever
	// namespace the calling goroutine's thread happens to be in.
	NetnsPath string
	// Resync lists the addresses again this often even without an event,
	// in case an event was lost without the subscription reporting an
	// error. Default 30s.
	Resync time.Duration
	// Logger; nil: slog.Default().
	Logger *slog.Logger
}

// Validate checks c.
func (c Config) Validate() error {
	if c.Resync < 0 {
		return fmt.Errorf("hostaddr: negative resync interval %v", c.Resync)
	}
	return nil
}

const (
	defaultNetns  = "/proc/self/ns/net"
	defaultResync = 30 * time.Second
	// retryMax bounds the wait between attempts to subscribe again.
	retryMax = 5 * time.Second
)

// Watcher holds the current address set. Contains is safe for concurrent
// use; Run owns the subscription.
type Watcher struct {
	cfg Config
	log *slog.Logger
	ns  netns.NsHandle
	// set is nil while the set is unknown (fail closed).
	set atomic.Pointer[map[netip.Addr]struct{}]

	mu      sync.Mutex // orders listing against event application
	closeMu sync.Once
}

// New opens the namespace and lists its addresses once, so that the
// Watcher is complete when New returns; Run keeps it current.
func New(cfg Config) (*Watcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.NetnsPath == "" {
		cfg.NetnsPath = defaultNetns
	}
	if cfg.Resync == 0 {
		cfg.Resync = defaultResync
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	ns, err := netns.GetFromPath(cfg.NetnsPath)
	if err != nil {
		return nil, fmt.Errorf("hostaddr: open %s: %w", cfg.NetnsPath, err)
	}
	w := &Watcher{cfg: cfg, log: cfg.Logger, ns: ns}
	if err := w.relist(); err != nil {
		ns.Close()
		return nil, err
	}
	return w, nil
}

// Contains reports whether ip is (or may be) one of the namespace's
// addresses: true for every address while the set is unknown.
func (w *Watcher) Contains(ip netip.Addr) bool {
	m := w.set.Load()
	if m == nil {
		return true
	}
	_, ok := (*m)[ip.Unmap().WithZone("")]
	return ok
}

// Addrs returns the current set (nil while unknown).
func (w *Watcher) Addrs() []netip.Addr {
	m := w.set.Load()
	if m == nil {
		return nil
	}
	out := make([]netip.Addr, 0, len(*m))
	for a := range *m {
		out = append(out, a)
	}
	return out
}

// relist replaces the set with a fresh dump of the namespace's addresses.
func (w *Watcher) relist() error {
	h, err := netlink.NewHandleAt(w.ns)
	if err != nil {
		return fmt.Errorf("hostaddr: netlink: %w", err)
	}
	defer h.Close()
	addrs, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return fmt.Errorf("hostaddr: list addresses: %w", err)
	}
	m := make(map[netip.Addr]struct{}, len(addrs))
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			m[ip.Unmap()] = struct{}{}
		}
	}
	w.mu.Lock()
	w.set.Store(&m)
	w.mu.Unlock()
	return nil
}

// add puts ip in the set at once, before the listing that follows an
// event: a new address is denied from the moment its event is read.
func (w *Watcher) add(ip netip.Addr) {
	w.mu.Lock()
	defer w.mu.Unlock()
	old := w.set.Load()
	if old == nil {
		return // unknown: already all denied
	}
	if _, ok := (*old)[ip]; ok {
		return
	}
	m := make(map[netip.Addr]struct{}, len(*old)+1)
	for a := range *old {
		m[a] = struct{}{}
	}
	m[ip] = struct{}{}
	w.set.Store(&m)
}

// Run follows the namespace until ctx ends. A lost subscription makes the
// set unknown (every address contained) until a new subscription is
// listening and a listing has completed.
func (w *Watcher) Run(ctx context.Context) error {
	wait := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := w.follow(ctx)
		if ctx.Err() != nil {
			return nil
		}
		w.set.Store(nil)
		w.log.Warn("host address subscription lost; denying every address until it is back", "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		wait = min(2*wait, retryMax)
	}
	return nil
}

var errClosed = errors.New("hostaddr: subscription closed")

// follow subscribes, lists, then applies events until the subscription
// fails or ctx ends.
func (w *Watcher) follow(ctx context.Context) error {
	done := make(chan struct{})
	ch := make(chan netlink.AddrUpdate, 64)
	// netlink's receiving goroutine ends once done closes its socket, but
	// it may be blocked sending an update: drain until it closes ch.
	subscribed := false
	defer func() {
		close(done)
		if subscribed {
			for range ch {
			}
		}
	}()
	errc := make(chan error, 1)
	err := netlink.AddrSubscribeWithOptions(ch, done, netlink.AddrSubscribeOptions{
		Namespace:         &w.ns,
		ReceiveBufferSize: 1 << 20,
		ErrorCallback: func(err error) {
			select {
			case errc <- err:
			default:
			}
		},
	})
	if err != nil {
		return fmt.Errorf("subscribe: %w", err)
	}
	subscribed = true
	// Listing after subscribing: an address added in between is in the
	// listing or in an event, never in neither.
	if err := w.relist(); err != nil {
		return err
	}
	t := time.NewTicker(w.cfg.Resync)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-errc:
			return err
		case <-t.C:
			if err := w.relist(); err != nil {
				return err
			}
		case u, ok := <-ch:
			if !ok {
				return errClosed
			}
			if ip, ok := netip.AddrFromSlice(u.LinkAddress.IP); ok && u.NewAddr {
				w.add(ip.Unmap())
			}
			// A removal is taken only from a listing, which also
			// covers events the channel's buffer may have dropped.
			if err := w.relist(); err != nil {
				return err
			}
		}
	}
}

// Close releases the namespace handle; call it after Run has returned.
func (w *Watcher) Close() error {
	var err error
	w.closeMu.Do(func() {
		if w.ns.IsOpen() {
			err = w.ns.Close()
		}
	})
	return err
}
