// Package sbxnet holds a worker's egress network namespace: the namespace
// itself (bind-mounted so that it, and the sandboxes' links in it, outlive
// the worker process), the nftables ruleset that sends every TCP connection
// arriving on a sandbox link to the worker's egress proxy and every DNS
// packet to its resolver while forwarding nothing, and the links themselves
// (a veth per namespace sandbox, a tap per microVM), each with a /30 of the
// pool.
//
// The proxy and the resolver listen inside that namespace (ListenTCP,
// ListenDNS) but the process never moves a thread of its own there for
// longer than it takes to make a socket or a handle, and a thread that could
// not be moved back is left to die with its goroutine rather than reused.
package sbxnet

import (
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spacesbx/space/internal/errdefs"
)

// Defaults of Config.
const (
	DefaultProxyPort uint16 = 15001
	DefaultDNSPort   uint16 = 15053
	DefaultMTU              = 1500
)

// DefaultPool is Config.Pool's default.
var DefaultPool = netip.MustParsePrefix("10.201.0.0/16")

// LinkPrefix starts the name of every sandbox link in the egress
// namespace; the ruleset matches it (iifname "sx*"), so nothing else there
// may be named so.
const LinkPrefix = "sx"

// TableName is the nftables table (family inet) this package owns in the
// egress namespace.
const TableName = "space_egress"

// Config configures a worker's egress namespace.
type Config struct {
	// NetnsPath is where the egress netns is bind-mounted (e.g.
	// <state>/egress.netns); an absolute path. It and the sandboxes' links
	// in it outlive the worker process; Open reopens it.
	NetnsPath string
	// Pool is where the links' addresses come from (IPv4 only, a /8 to a
	// /29); one /30 per slot, slot 0 unused. Default DefaultPool.
	Pool netip.Prefix
	// ProxyPort is where every TCP connection from a link is redirected.
	// Default DefaultProxyPort.
	ProxyPort uint16
	// DNSPort is where every port-53 packet (udp and tcp) from a link is
	// redirected. Default DefaultDNSPort.
	DNSPort uint16
	// MTU of every link, both ends. Default DefaultMTU.
	MTU int
}

func (c Config) withDefaults() Config {
	if !c.Pool.IsValid() {
		c.Pool = DefaultPool
	}
	if c.ProxyPort == 0 {
		c.ProxyPort = DefaultProxyPort
	}
	if c.DNSPort == 0 {
		c.DNSPort = DefaultDNSPort
	}
	if c.MTU == 0 {
		c.MTU = DefaultMTU
	}
	return c
}

// Validate checks c with its defaults applied.
func (c Config) Validate() error {
	c = c.withDefaults()
	switch {
	case c.NetnsPath == "":
		return fmt.Errorf("sbxnet: %w: no netns path", errdefs.ErrInvalid)
	case !filepath.IsAbs(c.NetnsPath) || filepath.Clean(c.NetnsPath) != c.NetnsPath:
		return fmt.Errorf("sbxnet: %w: netns path %q is not a clean absolute path", errdefs.ErrInvalid, c.NetnsPath)
	case !c.Pool.Addr().Is4():
		return fmt.Errorf("sbxnet: %w: pool %s is not IPv4", errdefs.ErrInvalid, c.Pool)
	case c.Pool.Masked() != c.Pool:
		return fmt.Errorf("sbxnet: %w: pool %s has host bits set", errdefs.ErrInvalid, c.Pool)
	case c.Pool.Bits() < 8 || c.Pool.Bits() > 29:
		// A /30 per slot and slot 0 unused: a /29 holds one slot. Wider
		// than a /8 is no pool a host needs.
		return fmt.Errorf("sbxnet: %w: pool %s must be a /8 to a /29", errdefs.ErrInvalid, c.Pool)
	case c.ProxyPort == c.DNSPort:
		return fmt.Errorf("sbxnet: %w: proxy and dns port are both %d", errdefs.ErrInvalid, c.ProxyPort)
	case c.MTU < 68 || c.MTU > 65535:
		return fmt.Errorf("sbxnet: %w: mtu %d out of [68, 65535]", errdefs.ErrInvalid, c.MTU)
	}
	return nil
}

// maxSlot is the highest slot of the pool.
func (c Config) maxSlot() int { return 1<<(32-c.Pool.Bits())/4 - 1 }

// Link is one sandbox's link into the egress namespace.
type Link struct {
	Slot int
	// HostName is the interface name in the egress netns: "sx<slot>".
	HostName string
	// Gateway is the worker's side (the host end's address): the
	// sandbox's default route and its resolver.
	Gateway netip.Addr
	// Addr is the sandbox's address, with the /30.
	Addr netip.Prefix
	// MAC is the sandbox side's MAC (locally administered, derived from
	// the slot).
	MAC net.HardwareAddr
}

// slotLink computes slot i's addresses; i must be in [1, maxSlot].
func (c Config) slotLink(i int) (Link, error) {
	if i < 1 || i > c.maxSlot() {
		return Link{}, fmt.Errorf("sbxnet: %w: slot %d out of [1, %d]", errdefs.ErrInvalid, i, c.maxSlot())
	}
	b := c.Pool.Addr().As4()
	base := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
	at := func(off uint32) netip.Addr {
		v := base + 4*uint32(i) + off
		return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
	}
	return Link{
		Slot:     i,
		HostName: LinkPrefix + strconv.Itoa(i),
		Gateway:  at(1),
		Addr:     netip.PrefixFrom(at(2), 30),
		// 0x02: locally administered, unicast. A sandbox's MAC is seen
		// only on its own point-to-point link, so the slot alone is unique
		// enough.
		MAC: net.HardwareAddr{0x02, 0x73, byte(i >> 24), byte(i >> 16), byte(i >> 8), byte(i)},
	}, nil
}

// parseLinkName returns the slot of a link named by this package
// ("sx<slot>", decimal, no leading zero), or false for any other name.
func parseLinkName(name string) (int, bool) {
	d, ok := strings.CutPrefix(name, LinkPrefix)
	if !ok || d == "" || len(d) > 9 || d[0] == '0' {
		return 0, false
	}
	for _, r := range d {
		if r < '0' || r > '9' {
			return 0, false
		}
	}
	i, err := strconv.Atoi(d)
	if err != nil {
		return 0, false
	}
	return i, true
}
