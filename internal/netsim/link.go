package netsim

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// ensureUnreachable makes sure the caller's namespace routes all of the range
// to nowhere. Unreachable rather than blackhole: a dial then fails at once
// with "no route to host" instead of an opaque EINVAL. The route is added
// with NLM_F_EXCL (never replaced: another process may have added it, and
// it must stay for every Internet on the machine) and never removed.
func ensureUnreachable(h *netlink.Handle) error {
	dst := prefixIPNet(simRange)
	err := h.RouteAdd(&netlink.Route{
		Dst:      dst,
		Type:     unix.RTN_UNREACHABLE,
		Table:    unix.RT_TABLE_MAIN,
		Protocol: unix.RTPROT_STATIC,
	})
	if err == nil {
		return nil
	}
	if errors.Is(err, unix.EPERM) {
		return fmt.Errorf("netsim: route %s unreachable: %w: %w (needs CAP_NET_ADMIN)", simRange, errdefs.ErrDenied, err)
	}
	if !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("netsim: route %s unreachable: %w", simRange, err)
	}
	// A route of metric 0 for the prefix exists (ours from an earlier
	// Start or another process, or someone else's): it is the one used,
	// so it must be one that sends nothing.
	routes, err := h.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Dst: dst, Table: unix.RT_TABLE_MAIN},
		netlink.RT_FILTER_DST|netlink.RT_FILTER_TABLE)
	if err != nil {
		return fmt.Errorf("netsim: list routes for %s: %w", simRange, err)
	}
	for _, r := range routes {
		if r.Priority != 0 || r.Dst == nil || r.Dst.String() != simRange.String() {
			continue
		}
		switch r.Type {
		case unix.RTN_UNREACHABLE, unix.RTN_BLACKHOLE, unix.RTN_PROHIBIT:
			return nil
		}
		return fmt.Errorf("netsim: %w: %s is routed (%s), not unreachable: refusing to risk test traffic leaving the machine",
			errdefs.ErrConflict, simRange, r)
	}
	return fmt.Errorf("netsim: %w: adding the unreachable route for %s failed with EEXIST but no such route is listed",
		errdefs.ErrConflict, simRange)
}

func prefixIPNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// subnet returns the /24 of index k: 198.18.k.0/24, then 198.19.(k-256).0/24.
func subnet(k int) netip.Prefix {
	a := simRange.Addr().As4()
	a[1] += byte(k / 256)
	a[2] = byte(k % 256)
	return netip.PrefixFrom(netip.AddrFrom4(a), 24)
}

func addrIn(p netip.Prefix, last byte) netip.Addr {
	a := p.Addr().As4()
	a[3] = last
	return netip.AddrFrom4(a)
}

// nsThread is one OS thread in a new network namespace, running functions
// sent to it. It is never handed back to the Go scheduler: its goroutine
// ends locked, so the runtime ends the thread, and no other goroutine can
// ever run in the internet's namespace by accident.
type nsThread struct {
	fns  chan func()
	done chan struct{}
}

type nsResult struct {
	f   *os.File
	err error
}

// newNSThread starts the thread and returns it with a descriptor of its
// namespace (which holds the namespace; nothing is bind-mounted).
func newNSThread() (*nsThread, *os.File, error) {
	t := &nsThread{fns: make(chan func()), done: make(chan struct{})}
	ready := make(chan nsResult, 1)
	go t.main(ready, nil)
	r := <-ready
	if r.err != nil {
		<-t.done
		return nil, nil, r.err
	}
	return t, r.f, nil
}

// main is the thread's goroutine. The process's main thread is never
// ended by the runtime (a goroutine exiting locked to it wedges it
// instead, in the namespace for good), so on it main keeps it locked
// while a new goroutine locks a thread of its own (which therefore is not
// the main thread), and then gives the main thread back untouched.
func (t *nsThread) main(ready chan<- nsResult, locked chan<- struct{}) {
	runtime.LockOSThread() // never unlocked once in the namespace, see nsThread
	if unix.Gettid() == unix.Getpid() {
		handed := make(chan struct{})
		go t.main(ready, handed)
		<-handed
		runtime.UnlockOSThread()
		return
	}
	if locked != nil {
		close(locked)
	}
	defer close(t.done)
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		if errors.Is(err, unix.EPERM) {
			err = fmt.Errorf("%w: %w (needs CAP_SYS_ADMIN)", errdefs.ErrDenied, err)
		}
		ready <- nsResult{err: fmt.Errorf("netsim: unshare network namespace: %w", err)}
		return
	}
	f, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		ready <- nsResult{err: fmt.Errorf("netsim: open network namespace: %w", err)}
		return
	}
	ready <- nsResult{f: f}
	for fn := range t.fns {
		fn()
	}
}

// run runs fn on the thread, inside the namespace.
func (t *nsThread) run(fn func() error) error {
	errc := make(chan error, 1)
	t.fns <- func() { errc <- fn() }
	return <-errc
}

// stop ends the thread and waits for it.
func (t *nsThread) stop() {
	close(t.fns)
	<-t.done
}

// createLink creates the veth "nsim<k>" for the first free k, its peer
// named eth0 directly in the namespace ns (so the peer's name never
// collides in the caller's namespace). EEXIST on the caller's side means
// another Internet (of this or another process) holds that k.
func createLink(h *netlink.Handle, ns *os.File) (int, netlink.Link, error) {
	for k := 0; k < MaxInternets; k++ {
		name := fmt.Sprintf("%s%d", linkPrefix, k)
		veth := &netlink.Veth{
			LinkAttrs:     netlink.LinkAttrs{Name: name},
			PeerName:      "eth0",
			PeerNamespace: netlink.NsFd(int(ns.Fd())),
		}
		err := h.LinkAdd(veth)
		runtime.KeepAlive(ns)
		if errors.Is(err, unix.EEXIST) {
			continue
		}
		if err != nil {
			return 0, nil, fmt.Errorf("netsim: create veth %s: %w", name, err)
		}
		link, err := h.LinkByName(name)
		if err != nil {
			_ = h.LinkDel(veth)
			return 0, nil, fmt.Errorf("netsim: find veth %s: %w", name, err)
		}
		return k, link, nil
	}
	return 0, nil, fmt.Errorf("netsim: %w: all %d links %s<k> exist", errdefs.ErrUnavailable, MaxInternets, linkPrefix)
}

// configureRoot gives the caller's side .1/24 (its connected route is the
// only route the caller needs) and brings it up.
func configureRoot(h *netlink.Handle, link netlink.Link, p netip.Prefix) error {
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: net.IP(addrIn(p, rootOctet).AsSlice()), Mask: net.CIDRMask(24, 32)}}
	if err := h.AddrAdd(link, addr); err != nil {
		return fmt.Errorf("netsim: address %s on %s: %w", addr, link.Attrs().Name, err)
	}
	if err := h.LinkSetUp(link); err != nil {
		return fmt.Errorf("netsim: up %s: %w", link.Attrs().Name, err)
	}
	return nil
}

// configureInside runs on the namespace's thread: the hosts and the DNS
// address on eth0, eth0 and lo up.
func configureInside(p netip.Prefix, addrs []netip.Addr) error {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE) // its socket lives in the thread's namespace
	if err != nil {
		return fmt.Errorf("netsim: netlink in namespace: %w", err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("netsim: namespace lo: %w", err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		return fmt.Errorf("netsim: namespace lo up: %w", err)
	}
	eth, err := h.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("netsim: namespace eth0: %w", err)
	}
	for _, a := range addrs {
		na := &netlink.Addr{IPNet: &net.IPNet{IP: net.IP(a.AsSlice()), Mask: net.CIDRMask(p.Bits(), 32)}}
		if err := h.AddrAdd(eth, na); err != nil {
			return fmt.Errorf("netsim: namespace address %s: %w", a, err)
		}
	}
	if err := h.LinkSetUp(eth); err != nil {
		return fmt.Errorf("netsim: namespace eth0 up: %w", err)
	}
	return nil
}

// checkRoutes fails closed unless every address of the Internet is routed
// through its own veth in the caller's namespace (a more specific route of
// someone else's, or a policy rule, would send test traffic elsewhere).
func checkRoutes(h *netlink.Handle, linkIndex int, addrs []netip.Addr) error {
	for _, a := range addrs {
		routes, err := h.RouteGet(net.IP(a.AsSlice()))
		if err != nil {
			return fmt.Errorf("netsim: route to %s: %w", a, err)
		}
		if len(routes) == 0 || routes[0].LinkIndex != linkIndex || routes[0].Gw != nil {
			return fmt.Errorf("netsim: %w: %s is not routed directly through the internet's link (%v)",
				errdefs.ErrConflict, a, routes)
		}
	}
	return nil
}
