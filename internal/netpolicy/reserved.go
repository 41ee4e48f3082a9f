package netpolicy

import (
	"net/netip"
	"slices"
)

// Defaults are the operator's settings.
type Defaults struct {
	// Allow is --egress allow|deny: the base when AllowInternetAccess is
	// unset.
	Allow bool
	// AllowPrivate lists the private ranges the operator opens
	// (otherwise always denied). It opens only what is private: listing
	// 0.0.0.0/0 does not open loopback or link-local.
	AllowPrivate []netip.Prefix
	// Denied lists extra always-denied prefixes (worker and control-plane
	// addresses, the link pool).
	Denied []netip.Prefix
	// Host holds the worker's own addresses as they are now (it gains
	// and loses them while it runs), always denied like Denied. nil:
	// none beyond Denied.
	Host AddrSet
}

// AddrSet is a set of addresses that may change over time
// (hostaddr.Watcher). Contains is called concurrently, with canonical
// (unmapped, zoneless) addresses.
type AddrSet interface {
	Contains(netip.Addr) bool
}

func mustPrefixes(s ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(s))
	for i, p := range s {
		out[i] = netip.MustParsePrefix(p)
	}
	return out
}

// alwaysReserved can never be reached from a sandbox. The documentation
// and benchmark ranges (192.0.2/24, 198.51.100/24, 203.0.113/24,
// 198.18/15, 2001:db8::/32) are left out on purpose: tests use them as
// "the internet".
var alwaysReserved = mustPrefixes(
	"0.0.0.0/8",      // "this network", incl. unspecified
	"127.0.0.0/8",    // loopback
	"169.254.0.0/16", // link-local, incl. cloud metadata 169.254.169.254
	"192.0.0.0/24",   // IETF protocol assignments
	"224.0.0.0/4",    // multicast
	"240.0.0.0/4",    // reserved, incl. broadcast 255.255.255.255
	"::/96",          // unspecified, loopback and deprecated IPv4-compatible addresses
	"64:ff9b:1::/48", // local-use NAT64 (RFC 8215): whatever it embeds is local
	"fe80::/10",      // link-local
	"fec0::/10",      // deprecated site-local
	"ff00::/8",       // multicast
)

// privateRanges are denied unless Defaults.AllowPrivate covers the address.
var privateRanges = mustPrefixes(
	"10.0.0.0/8",
	"172.16.0.0/12",
	"192.168.0.0/16",
	"100.64.0.0/10", // carrier-grade NAT, also used by clouds internally
	"fc00::/7",      // unique local
)

// Forms of IPv6 address that carry an IPv4 address a gateway may reach
// in its place: each is checked as the IPv4 address it embeds too.
var (
	nat64WellKnown = netip.MustParsePrefix("64:ff9b::/96")    // RFC 6052
	ipv4Translated = netip.MustParsePrefix("::ffff:0:0:0/96") // RFC 2765 (SIIT)
	sixToFour      = netip.MustParsePrefix("2002::/16")       // RFC 3056: v4 in bytes 2-5
	teredo         = netip.MustParsePrefix("2001::/32")       // RFC 4380: server in bytes 4-7
)

// embeddedV4 returns the IPv4 addresses an IPv6 address embeds.
func embeddedV4(ip netip.Addr) []netip.Addr {
	if !ip.Is6() {
		return nil
	}
	b := ip.As16()
	switch {
	case nat64WellKnown.Contains(ip), ipv4Translated.Contains(ip):
		return []netip.Addr{netip.AddrFrom4([4]byte(b[12:16]))}
	case sixToFour.Contains(ip):
		return []netip.Addr{netip.AddrFrom4([4]byte(b[2:6]))}
	case teredo.Contains(ip):
		// The server in clear, the client obfuscated (bits inverted).
		var c [4]byte
		for i := range c {
			c[i] = ^b[12+i]
		}
		return []netip.Addr{netip.AddrFrom4([4]byte(b[4:8])), netip.AddrFrom4(c)}
	}
	return nil
}

// canonAddr unmaps an IPv4-mapped address and drops a zone.
func canonAddr(ip netip.Addr) netip.Addr {
	return ip.Unmap().WithZone("")
}

// Reserved reports whether ip is denied whatever the policy: unspecified,
// loopback, link-local (169.254/16 incl. metadata 169.254.169.254,
// fe80::/10), multicast, broadcast, 0/8, 240/4, 192.0.0.0/24, the IPv4
// addresses embedded in IPv4-mapped, NAT64, SIIT, 6to4 and Teredo forms,
// d.Denied, d.Host, and the private ranges (10/8, 172.16/12, 192.168/16,
// 100.64/10, fc00::/7) unless inside d.AllowPrivate. An invalid address
// is reserved (fail closed).
func (d Defaults) Reserved(ip netip.Addr) bool {
	if !ip.IsValid() {
		return true
	}
	ip = canonAddr(ip)
	if d.reserved1(ip) {
		return true
	}
	return slices.ContainsFunc(embeddedV4(ip), d.reserved1)
}

func (d Defaults) reserved1(ip netip.Addr) bool {
	if containsAddr(alwaysReserved, ip) || containsAddr(d.Denied, ip) || d.Host != nil && d.Host.Contains(ip) {
		return true
	}
	return containsAddr(privateRanges, ip) && !containsAddr(d.AllowPrivate, ip)
}

// containsAddr reports whether any prefix holds ip (canonical). The
// prefixes are canonicalised on the fly so that Defaults built by hand
// with IPv4-mapped prefixes still match.
func containsAddr(ps []netip.Prefix, ip netip.Addr) bool {
	for _, p := range ps {
		if canonPrefix(p).Contains(ip) {
			return true
		}
	}
	return false
}
