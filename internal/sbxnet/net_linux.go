package sbxnet

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// testHookAttach, set by tests only, runs in AttachVeth after the veth is
// made, to fail an attach half-way.
var testHookAttach func(Link) error

// sandboxIfName is the sandbox side of a veth, in the sandbox's netns.
const sandboxIfName = "eth0"

// Net is a worker's open egress namespace. Its methods are safe for
// concurrent use.
type Net struct {
	cfg Config

	// life is held shared by every operation and exclusively by Close:
	// a netlink.Handle whose sockets are closed silently falls back to
	// the calling thread's namespace (the worker's own), so no operation
	// may run on a closed one.
	life   sync.RWMutex
	closed bool
	ns     netns.NsHandle  // the egress netns
	h      *netlink.Handle // rtnetlink, sockets inside ns

	mu   sync.Mutex
	used map[int]bool
	last int // the slot allocated last: allocation goes round after it
}

// Open creates the egress netns at cfg.NetnsPath, or reopens the one there,
// configures it (lo up, ip_forward=0, IPv6 off, strict rp_filter, ARP
// answered only for the asking link's own address) and
// installs the ruleset, replacing any previous one of ours in the same
// atomic batch. Links already there (sx<N>) keep their slots: sandboxes
// outlive a worker restart.
func Open(cfg Config) (*Net, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ns, err := openOrCreateNetns(cfg.NetnsPath)
	if err != nil {
		return nil, err
	}
	n := &Net{cfg: cfg, ns: ns, used: map[int]bool{}}
	if err := n.setup(); err != nil {
		n.release()
		return nil, err
	}
	return n, nil
}

func (n *Net) setup() error {
	h, err := handleAt(n.ns)
	if err != nil {
		return err
	}
	n.h = h
	lo, err := h.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("sbxnet: egress lo: %w", err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		return fmt.Errorf("sbxnet: egress lo up: %w", err)
	}
	// The defaults go first so links made later inherit them; "all"
	// covers the links already there.
	err = writeSysctls(n.ns, [][2]string{
		{"net/ipv4/ip_forward", "0"},
		{"net/ipv6/conf/default/disable_ipv6", "1"},
		{"net/ipv6/conf/all/disable_ipv6", "1"},
		{"net/ipv4/conf/default/rp_filter", "1"},
		{"net/ipv4/conf/all/rp_filter", "1"},
		// Answer ARP only for the address of the link asked on: a
		// sandbox learns nothing of its neighbours' gateways.
		{"net/ipv4/conf/default/arp_ignore", "1"},
		{"net/ipv4/conf/all/arp_ignore", "1"},
	}, func(k string) bool { return strings.HasPrefix(k, "net/ipv6/") })
	if err != nil {
		return err
	}
	if err := installRuleset(n.ns, n.cfg.ProxyPort, n.cfg.DNSPort); err != nil {
		return err
	}
	slots, err := n.inUse()
	if err != nil {
		return err
	}
	for _, s := range slots {
		n.used[s] = true
		n.last = max(n.last, s)
	}
	return nil
}

// release closes the handles; callers hold life exclusively (or own n
// alone).
func (n *Net) release() {
	n.closed = true
	if n.h != nil {
		n.h.Close()
		n.h = nil
	}
	if n.ns.IsOpen() {
		n.ns.Close()
	}
	n.ns = -1
}

// enter takes a shared hold on n for one operation.
func (n *Net) enter() error {
	n.life.RLock()
	if n.closed {
		n.life.RUnlock()
		return fmt.Errorf("sbxnet: %w: closed", errdefs.ErrConflict)
	}
	return nil
}

func (n *Net) leave() { n.life.RUnlock() }

// Slot returns the addresses of slot i without allocating it.
func (n *Net) Slot(i int) (Link, error) { return n.cfg.slotLink(i) }

// InUse lists the slots whose host link exists now, in order.
func (n *Net) InUse() ([]int, error) {
	if err := n.enter(); err != nil {
		return nil, err
	}
	defer n.leave()
	return n.inUse()
}

func (n *Net) inUse() ([]int, error) {
	links, err := linkList(n.h)
	if err != nil {
		return nil, err
	}
	var out []int
	for _, l := range links {
		if s, ok := parseLinkName(l.Attrs().Name); ok && s <= n.cfg.maxSlot() {
			out = append(out, s)
		}
	}
	slices.Sort(out)
	return out, nil
}

// alloc takes the first free slot after the last one allocated, going
// round, so that an address just released is not handed out again at once.
func (n *Net) alloc() (Link, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	top := n.cfg.maxSlot()
	for k := 1; k <= top; k++ {
		s := (n.last+k-1)%top + 1
		if !n.used[s] {
			n.used[s] = true
			n.last = s
			return n.cfg.slotLink(s)
		}
	}
	return Link{}, fmt.Errorf("sbxnet: %w: all %d slots in use", errdefs.ErrUnavailable, top)
}

func (n *Net) free(slot int) {
	n.mu.Lock()
	delete(n.used, slot)
	n.mu.Unlock()
}

// allocLink allocates a slot whose link name is free in the kernel too, and
// calls mk with it; a name taken behind our back (EEXIST) marks its slot
// used and the next one is tried. On any other failure the slot is freed.
func (n *Net) allocLink(mk func(Link) error) (Link, error) {
	for range 8 {
		l, err := n.alloc()
		if err != nil {
			return Link{}, err
		}
		err = mk(l)
		if err == nil {
			return l, nil
		}
		if !errors.Is(err, unix.EEXIST) || !n.linkExists(l.HostName) {
			n.free(l.Slot)
			return Link{}, err
		}
	}
	return Link{}, fmt.Errorf("sbxnet: %w: link names keep being taken", errdefs.ErrUnavailable)
}

func (n *Net) linkExists(name string) bool {
	_, err := n.h.LinkByName(name)
	return err == nil
}

// AttachVeth allocates a slot and links the network namespace of pid (a
// sandbox's init) to the egress netns: host end "sx<slot>" (made down,
// addressed, brought up last), peer "eth0" made directly in pid's netns
// with the slot's MAC, address and MTU, up, default route via the gateway;
// lo up there too. On any failure everything made is removed and the slot
// freed.
func (n *Net) AttachVeth(pid int) (Link, error) {
	if pid <= 0 {
		return Link{}, fmt.Errorf("sbxnet: %w: pid %d", errdefs.ErrInvalid, pid)
	}
	if err := n.enter(); err != nil {
		return Link{}, err
	}
	defer n.leave()
	target, err := netns.GetFromPid(pid)
	if err != nil {
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ESRCH) {
			return Link{}, fmt.Errorf("sbxnet: netns of pid %d: %w: %w", pid, errdefs.ErrNotFound, err)
		}
		return Link{}, fmt.Errorf("sbxnet: netns of pid %d: %w", pid, err)
	}
	defer target.Close()
	// A sandbox's netns is its own: giving eth0 to the worker's namespace
	// or to the egress one is a caller's bug that would open a path out.
	if target.Equal(n.ns) {
		return Link{}, fmt.Errorf("sbxnet: %w: pid %d is in the egress netns", errdefs.ErrInvalid, pid)
	}
	if self, err := netns.GetFromPath("/proc/self/ns/net"); err == nil {
		same := target.Equal(self)
		self.Close()
		if same {
			return Link{}, fmt.Errorf("sbxnet: %w: pid %d shares the worker's netns", errdefs.ErrInvalid, pid)
		}
	}
	sh, err := handleAt(target)
	if err != nil {
		return Link{}, err
	}
	defer sh.Close()
	if _, err := sh.LinkByName(sandboxIfName); err == nil {
		return Link{}, fmt.Errorf("sbxnet: %w: pid %d's netns already has %s", errdefs.ErrConflict, pid, sandboxIfName)
	}
	return n.allocLink(func(l Link) error { return n.attach(l, target, sh) })
}

func (n *Net) attach(l Link, target netns.NsHandle, sh *netlink.Handle) (err error) {
	attrs := netlink.NewLinkAttrs() // kernel defaults (txqueuelen) where unset
	attrs.Name, attrs.MTU = l.HostName, n.cfg.MTU
	veth := &netlink.Veth{
		LinkAttrs:        attrs,
		PeerTxQLen:       -1,
		PeerName:         sandboxIfName,
		PeerHardwareAddr: l.MAC,
		PeerMTU:          uint32(n.cfg.MTU),
		PeerNamespace:    netlink.NsFd(int(target)),
	}
	if err := n.h.LinkAdd(veth); err != nil {
		return fmt.Errorf("sbxnet: add veth %s: %w", l.HostName, err)
	}
	defer func() {
		if err != nil {
			// The peer goes with it.
			if derr := n.h.LinkDel(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: l.HostName}}); derr != nil {
				err = errors.Join(err, fmt.Errorf("sbxnet: remove %s: %w", l.HostName, derr))
			}
		}
	}()
	host, err := n.h.LinkByName(l.HostName)
	if err != nil {
		return fmt.Errorf("sbxnet: %s: %w", l.HostName, err)
	}
	if testHookAttach != nil {
		if err := testHookAttach(l); err != nil {
			return err
		}
	}
	peer, err := sh.LinkByName(sandboxIfName)
	if err != nil {
		return fmt.Errorf("sbxnet: sandbox %s: %w", sandboxIfName, err)
	}
	if err := sh.AddrAdd(peer, &netlink.Addr{IPNet: ipNet(l.Addr)}); err != nil {
		return fmt.Errorf("sbxnet: sandbox address: %w", err)
	}
	if err := sh.LinkSetUp(peer); err != nil {
		return fmt.Errorf("sbxnet: sandbox %s up: %w", sandboxIfName, err)
	}
	if lo, err := sh.LinkByName("lo"); err != nil {
		return fmt.Errorf("sbxnet: sandbox lo: %w", err)
	} else if err := sh.LinkSetUp(lo); err != nil {
		return fmt.Errorf("sbxnet: sandbox lo up: %w", err)
	}
	if err := sh.RouteAdd(&netlink.Route{LinkIndex: peer.Attrs().Index, Gw: l.Gateway.AsSlice()}); err != nil {
		return fmt.Errorf("sbxnet: sandbox default route: %w", err)
	}
	return n.addressAndUp(host, l)
}

func (n *Net) addressAndUp(host netlink.Link, l Link) error {
	if err := n.h.AddrAdd(host, &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(l.Gateway, 30))}); err != nil {
		return fmt.Errorf("sbxnet: %s address: %w", l.HostName, err)
	}
	if err := n.h.LinkSetUp(host); err != nil {
		return fmt.Errorf("sbxnet: %s up: %w", l.HostName, err)
	}
	return nil
}

// CreateTap allocates a slot and makes tap "sx<slot>" (IFF_TAP|IFF_NO_PI, no
// vnet header) in the egress netns, addressed with the gateway, up, and
// returns its open fd (for QEMU's -netdev tap,fd=). The tap is not
// persistent: it lives while some process holds the fd (or until Release),
// so a VM that dies leaves nothing behind.
func (n *Net) CreateTap() (*os.File, Link, error) {
	if err := n.enter(); err != nil {
		return nil, Link{}, err
	}
	defer n.leave()
	var f *os.File
	l, err := n.allocLink(func(l Link) error {
		var err error
		f, err = n.tap(l)
		return err
	})
	if err != nil {
		return nil, Link{}, err
	}
	return f, l, nil
}

func (n *Net) tap(l Link) (f *os.File, err error) {
	// TUNSETIFF on the name of an existing, unattached persistent tap
	// attaches to it instead of failing: a name taken behind our back
	// must not be adopted.
	if n.linkExists(l.HostName) {
		return nil, fmt.Errorf("sbxnet: make tap %s: %w", l.HostName, unix.EEXIST)
	}
	// The tap is made in the namespace of the thread that opens
	// /dev/net/tun.
	err = inNetns(n.ns, func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("sbxnet: open /dev/net/tun: %w", err)
		}
		ifr, err := unix.NewIfreq(l.HostName)
		if err == nil {
			ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI)
			err = unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr)
		}
		if err != nil {
			unix.Close(fd)
			return fmt.Errorf("sbxnet: make tap %s: %w", l.HostName, err)
		}
		f = os.NewFile(uintptr(fd), "/dev/net/tun")
		return nil
	})
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			if host, lerr := n.h.LinkByName(l.HostName); lerr == nil {
				n.h.LinkDel(host)
			}
			f.Close() // and a non-persistent tap goes with its last fd anyway
			f = nil
		}
	}()
	host, err := n.h.LinkByName(l.HostName)
	if err != nil {
		return nil, fmt.Errorf("sbxnet: %s: %w", l.HostName, err)
	}
	if err := n.h.LinkSetMTU(host, n.cfg.MTU); err != nil {
		return nil, fmt.Errorf("sbxnet: %s mtu: %w", l.HostName, err)
	}
	if err := n.addressAndUp(host, l); err != nil {
		return nil, err
	}
	return f, nil
}

// Release deletes link sx<slot> (a veth's peer goes with it) and frees the
// slot; a link already gone is not an error.
func (n *Net) Release(slot int) error {
	l, err := n.cfg.slotLink(slot)
	if err != nil {
		return err
	}
	if err := n.enter(); err != nil {
		return err
	}
	defer n.leave()
	if err := n.delLink(l.HostName); err != nil {
		return err
	}
	n.free(slot)
	return nil
}

func (n *Net) delLink(name string) error {
	link, err := n.h.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		return fmt.Errorf("sbxnet: find %s: %w", name, err)
	}
	if err := n.h.LinkDel(link); err != nil && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("sbxnet: delete %s: %w", name, err)
	}
	return nil
}

// Close releases n's handles and fds. The netns, its rules and its links
// stay: sandboxes outlive the worker.
func (n *Net) Close() error {
	n.life.Lock()
	defer n.life.Unlock()
	if !n.closed {
		n.release()
	}
	return nil
}

// Destroy deletes every link, the ruleset and the netns bind mount (tests;
// a worker leaving for good with no sandboxes), then closes n.
func (n *Net) Destroy() error {
	n.life.Lock()
	defer n.life.Unlock()
	if n.closed {
		return fmt.Errorf("sbxnet: %w: closed", errdefs.ErrConflict)
	}
	var errs []error
	// Every link the ruleset treats as a sandbox's, whatever pool made it.
	links, err := linkList(n.h)
	errs = append(errs, err)
	for _, l := range links {
		if _, ok := parseLinkName(l.Attrs().Name); ok {
			errs = append(errs, n.delLink(l.Attrs().Name))
		}
	}
	errs = append(errs, deleteRuleset(n.ns))
	n.release()
	if err := unix.Unmount(n.cfg.NetnsPath, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
		errs = append(errs, fmt.Errorf("sbxnet: unmount %s: %w", n.cfg.NetnsPath, err))
	}
	if err := os.Remove(n.cfg.NetnsPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("sbxnet: %w", err))
	}
	return errors.Join(errs...)
}

// linkList lists h's links, dumping again when a concurrent change
// interrupted the dump (its result may miss links).
func linkList(h *netlink.Handle) ([]netlink.Link, error) {
	for try := 0; ; try++ {
		links, err := h.LinkList()
		if errors.Is(err, netlink.ErrDumpInterrupted) && try < 5 {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("sbxnet: list links: %w", err)
		}
		return links, nil
	}
}

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), 32)}
}
