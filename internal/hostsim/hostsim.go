// Package hostsim makes a cluster of hosts on one machine for tests: a
// switch (a network namespace of its own holding a Linux bridge) and hosts,
// each a network namespace with one veth to the bridge and its own address
// from a private prefix (default 10.213.0.0/24), whose processes the test
// starts inside it, kills (SIGKILL, the host "lost"), starts again, and cuts
// off the network and back (a partition).
//
// Network safety (as internal/netsim): nothing is created in the caller's
// network namespace. The bridge lives in the switch namespace, both veth
// ends are made there and one end moved into its host, so the prefix is
// connected only inside the switch and the hosts, none of which has any
// other link or route: a host's traffic can reach the other hosts and
// nothing else, and the caller's namespace (its loopback included) is not
// reachable from any host. The test itself talks to the hosts from inside
// one of them (Host.DialContext: the socket is made on a thread that entered
// the host's namespace), never through a route of the caller's. Two Nets of
// one prefix (two test processes) never meet: each has its own switch.
//
// Each host's namespace is bind-mounted at <Dir>/<host>.netns, so an
// operator can enter it (`nsenter --net=<Dir>/w1.netns`), and its processes
// are started with nsenter into it, each in a process group of its own and
// in a cgroup of the host (cgroup v2: the unified hierarchy, also on a
// hybrid host): Kill kills the whole cgroup (cgroup.kill), which catches
// whatever they started, sessions and daemons included.
package hostsim

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"sync"

	"github.com/vishvananda/netlink"

	"github.com/spacesbx/space/internal/errdefs"
)

// DefaultPrefix is the hosts' prefix when Config.Prefix is unset.
var DefaultPrefix = netip.MustParsePrefix("10.213.0.0/24")

// Fixed names.
const (
	bridgeName = "br0"
	hostIfName = "eth0"
	// firstHost is the last octet offset of the first host (.2: .1 is
	// left unused, as a gateway would be).
	firstHost = 2
)

// Config configures New. Zero fields are the defaults.
type Config struct {
	// Prefix is the private IPv4 prefix hosts take their addresses from,
	// in the order they are made (.2, .3, ...). It must be private
	// (RFC 1918) and at most a /29. Default DefaultPrefix.
	Prefix netip.Prefix
	// Dir holds the namespaces' bind mounts and the processes' logs.
	// Default: a new temp dir, removed by Close (a Dir given is kept;
	// only what New made in it is removed).
	Dir string
}

// Validate reports whether the configuration can be used.
func (c Config) Validate() error {
	if c.Prefix.IsValid() {
		if !c.Prefix.Addr().Is4() || !c.Prefix.Addr().IsPrivate() {
			return fmt.Errorf("hostsim: prefix %s: %w: want a private IPv4 prefix (RFC 1918)", c.Prefix, errdefs.ErrInvalid)
		}
		if c.Prefix.Bits() > 29 || c.Prefix.Bits() < 8 {
			return fmt.Errorf("hostsim: prefix %s: %w: want /8 to /29", c.Prefix, errdefs.ErrInvalid)
		}
		if c.Prefix.Masked() != c.Prefix {
			return fmt.Errorf("hostsim: prefix %s: %w: host bits set", c.Prefix, errdefs.ErrInvalid)
		}
	}
	if c.Dir != "" && !filepath.IsAbs(c.Dir) {
		return fmt.Errorf("hostsim: dir %q: %w: want an absolute path", c.Dir, errdefs.ErrInvalid)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if !c.Prefix.IsValid() {
		c.Prefix = DefaultPrefix
	}
	return c
}

// hostName is what a host may be called: it names files and cgroups.
var hostName = regexp.MustCompile(`^[a-z][a-z0-9-]{0,14}$`)

// Net is a switch and its hosts. Its methods are safe for concurrent use.
type Net struct {
	cfg      Config
	dir      string
	ownDir   bool // Dir was made by New
	switchNS string
	sw       *netlink.Handle // netlink socket inside the switch
	bridge   netlink.Link
	cg       *cgroup // parent of the hosts' cgroups

	mu     sync.Mutex
	hosts  map[string]*Host
	order  []string
	closed bool

	closeOnce sync.Once
	closeErr  error
}

// New makes the switch: its namespace and the bridge in it. It needs root
// (CAP_SYS_ADMIN, CAP_NET_ADMIN) and nsenter (util-linux).
func New(cfg Config) (_ *Net, retErr error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	n := &Net{cfg: cfg, dir: cfg.Dir, hosts: map[string]*Host{}}
	defer func() {
		if retErr != nil {
			retErr = errors.Join(retErr, n.teardown())
		}
	}()
	if n.dir == "" {
		d, err := os.MkdirTemp("", "hostsim-")
		if err != nil {
			return nil, fmt.Errorf("hostsim: %w", err)
		}
		n.dir, n.ownDir = d, true
	} else if err := os.MkdirAll(n.dir, 0o700); err != nil {
		return nil, fmt.Errorf("hostsim: %w", err)
	}
	cg, err := newCgroup(fmt.Sprintf("%d.%s", os.Getpid(), filepath.Base(n.dir)))
	if err != nil {
		return nil, err
	}
	n.cg = cg
	n.switchNS = filepath.Join(n.dir, "switch.netns")
	if err := makeNetns(n.switchNS); err != nil {
		return nil, err
	}
	if n.sw, err = handleAt(n.switchNS); err != nil {
		return nil, err
	}
	if err := upLoopback(n.sw); err != nil {
		return nil, err
	}
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: bridgeName}}
	if err := n.sw.LinkAdd(br); err != nil {
		return nil, fmt.Errorf("hostsim: bridge: %w", err)
	}
	if n.bridge, err = n.sw.LinkByName(bridgeName); err != nil {
		return nil, fmt.Errorf("hostsim: bridge: %w", err)
	}
	if err := n.sw.LinkSetUp(n.bridge); err != nil {
		return nil, fmt.Errorf("hostsim: bridge up: %w", err)
	}
	return n, nil
}

// Dir returns the directory of the bind mounts and logs.
func (n *Net) Dir() string { return n.dir }

// Prefix returns the hosts' prefix.
func (n *Net) Prefix() netip.Prefix { return n.cfg.Prefix }

// SwitchNetns returns the path of the switch's namespace (bind mount).
func (n *Net) SwitchNetns() string { return n.switchNS }

// Host returns the host called name, making it on first use: a network
// namespace with eth0 (the next address of the prefix) linked to the
// bridge, and lo, both up. Names are [a-z][a-z0-9-]{0,14}.
func (n *Net) Host(name string) (*Host, error) {
	if !hostName.MatchString(name) || name == "switch" {
		return nil, fmt.Errorf("hostsim: host name %q: %w: want [a-z][a-z0-9-]{0,14}, not \"switch\"", name, errdefs.ErrInvalid)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return nil, fmt.Errorf("hostsim: %w: net closed", errdefs.ErrConflict)
	}
	if h := n.hosts[name]; h != nil {
		return h, nil
	}
	addr, err := n.nextAddr()
	if err != nil {
		return nil, err
	}
	h, err := n.makeHost(name, addr, len(n.order))
	if err != nil {
		return nil, err
	}
	n.hosts[name] = h
	n.order = append(n.order, name)
	return h, nil
}

// Hosts returns the hosts' names in the order they were made.
func (n *Net) Hosts() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]string(nil), n.order...)
}

func (n *Net) nextAddr() (netip.Addr, error) {
	a := n.cfg.Prefix.Addr()
	for range firstHost + len(n.order) {
		a = a.Next()
	}
	last := n.cfg.Prefix.Addr()
	for range (1 << (32 - n.cfg.Prefix.Bits())) - 1 {
		last = last.Next()
	}
	if !n.cfg.Prefix.Contains(a) || a == last { // the broadcast address
		return netip.Addr{}, fmt.Errorf("hostsim: %w: prefix %s is full", errdefs.ErrUnavailable, n.cfg.Prefix)
	}
	return a, nil
}

// Close kills every host's processes, removes the namespaces (and with
// them every link), the cgroups and, when New made it, Dir. It is
// idempotent.
func (n *Net) Close() error {
	n.closeOnce.Do(func() {
		n.mu.Lock()
		n.closed = true
		n.mu.Unlock()
		n.closeErr = n.teardown()
	})
	return n.closeErr
}

func (n *Net) teardown() error {
	var errs []error
	n.mu.Lock()
	names := append([]string(nil), n.order...)
	n.mu.Unlock()
	sort.Strings(names)
	for _, name := range names {
		if err := n.hosts[name].close(); err != nil {
			errs = append(errs, err)
		}
	}
	if n.sw != nil {
		n.sw.Close()
	}
	if n.switchNS != "" {
		if err := removeNetns(n.switchNS); err != nil {
			errs = append(errs, err)
		}
	}
	if n.cg != nil {
		if err := n.cg.remove(); err != nil {
			errs = append(errs, err)
		}
	}
	if n.ownDir && n.dir != "" {
		if err := os.RemoveAll(n.dir); err != nil {
			errs = append(errs, fmt.Errorf("hostsim: %w", err))
		}
	}
	return errors.Join(errs...)
}
