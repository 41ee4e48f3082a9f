package netpolicy

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// Verdict reasons.
const (
	ReasonReserved      = "reserved"
	ReasonAllowCIDR     = "allow-cidr"
	ReasonDenyCIDR      = "deny-cidr"
	ReasonDefaultAllow  = "default-allow"
	ReasonDefaultDeny   = "default-deny"
	ReasonAllowDomain   = "allow-domain"
	ReasonNoDomainMatch = "no-domain-match"
)

// Verdict is one decision and why (the reason labels metrics and audit
// records).
type Verdict struct {
	Allow  bool
	Reason string // one of the Reason constants
}

// Policy is a compiled Spec under the operator's Defaults. It is
// immutable, and safe for concurrent use: what it hands out is a copy.
type Policy struct {
	spec     Spec
	defaults Defaults
	c        *compiledSpec
	base     bool // AllowInternetAccess, else Defaults.Allow
	denyAll  bool // allow_internet_access=false: denyOut 0.0.0.0/0 + ::/0
}

// Compile validates s (as Validate) and d (every prefix valid) and
// compiles them.
func Compile(s Spec, d Defaults) (*Policy, error) {
	c, err := compileSpec(s)
	if err != nil {
		return nil, err
	}
	nd := Defaults{Allow: d.Allow, Host: d.Host}
	for _, l := range []struct {
		name string
		in   []netip.Prefix
		out  *[]netip.Prefix
	}{{"allowPrivate", d.AllowPrivate, &nd.AllowPrivate}, {"denied", d.Denied, &nd.Denied}} {
		for i, p := range l.in {
			if !p.IsValid() {
				return nil, invalid("defaults %s[%d]: invalid prefix", l.name, i)
			}
			*l.out = append(*l.out, canonPrefix(p))
		}
	}
	p := &Policy{spec: s.clone(), defaults: nd, c: c, base: d.Allow}
	if s.AllowInternetAccess != nil {
		p.base = *s.AllowInternetAccess
		p.denyAll = !*s.AllowInternetAccess
	}
	return p, nil
}

// Addr decides by address alone: Reserved -> deny "reserved"; in an
// allowOut CIDR/IP -> allow "allow-cidr"; in a denyOut CIDR/IP (or
// allow_internet_access=false) -> deny "deny-cidr"; else the base,
// "default-allow" or "default-deny". Allow wins over deny, as in E2B. An
// IPv4-mapped address is decided as the IPv4 address; a NAT64-style one
// is also denied when the IPv4 address it embeds is.
func (p *Policy) Addr(ip netip.Addr) Verdict {
	if p.defaults.Reserved(ip) {
		return Verdict{false, ReasonReserved}
	}
	ip = canonAddr(ip)
	if containsAddr(p.c.allowNets, ip) {
		return Verdict{true, ReasonAllowCIDR}
	}
	if p.denyAll || containsAddr(p.c.denyNets, ip) || slices.ContainsFunc(embeddedV4(ip), func(a netip.Addr) bool {
		return containsAddr(p.c.denyNets, a)
	}) {
		return Verdict{false, ReasonDenyCIDR}
	}
	if p.base {
		return Verdict{true, ReasonDefaultAllow}
	}
	return Verdict{false, ReasonDefaultDeny}
}

// Name decides a domain name (lower-cased, trailing dot dropped): allow
// "allow-domain" if an allowOut domain matches exactly or a "*.d" entry
// matches a subdomain at any depth (never the apex d); otherwise deny
// "no-domain-match". A name that is not a valid DNS name (an IP literal
// included) is denied.
func (p *Policy) Name(name string) Verdict {
	n, err := normalizeName(name)
	if err != nil {
		return Verdict{false, ReasonNoDomainMatch}
	}
	if p.c.exact[n] {
		return Verdict{true, ReasonAllowDomain}
	}
	for s := n; ; {
		i := strings.IndexByte(s, '.')
		if i < 0 {
			break
		}
		s = s[i+1:]
		if p.c.wild[s] {
			return Verdict{true, ReasonAllowDomain}
		}
	}
	return Verdict{false, ReasonNoDomainMatch}
}

// AllowList reports whether only what allowOut lists is reachable (the
// base is deny, or denyOut covers 0.0.0.0/0 or ::/0): names outside the
// domain allow-list must then not resolve.
func (p *Policy) AllowList() bool {
	if !p.base || p.denyAll {
		return true
	}
	return slices.ContainsFunc(p.c.denyNets, func(q netip.Prefix) bool { return q.Bits() == 0 })
}

// HasDomains reports whether allowOut has at least one domain entry.
func (p *Policy) HasDomains() bool {
	return len(p.c.exact)+len(p.c.wild) > 0
}

// Transform returns the header transform for host (lower-cased, trailing
// dot dropped): the exact key first, then the longest matching "*.suffix"
// key (subdomains only). A key's rules are merged in order (later headers
// override earlier); header names are canonical
// (textproto.CanonicalMIMEHeaderKey). nil if none, or if host is not a
// valid name (rules keyed by IP or CIDR never match). The result is the
// caller's to keep.
func (p *Policy) Transform(host string) *Transform {
	n, err := normalizeName(host)
	if err != nil {
		return nil
	}
	if t := p.c.exactT[n]; t != nil {
		return t.clone()
	}
	// Walking from the longest suffix down finds the longest wildcard.
	for s := n; ; {
		i := strings.IndexByte(s, '.')
		if i < 0 {
			return nil
		}
		s = s[i+1:]
		if t := p.c.wildT[s]; t != nil {
			return t.clone()
		}
	}
}

// HasTransforms reports whether any name key sets a header.
func (p *Policy) HasTransforms() bool {
	return len(p.c.exactT)+len(p.c.wildT) > 0
}

// Proxy returns the upstream SOCKS5 proxy, nil when none.
func (p *Policy) Proxy() *EgressProxy {
	if p.spec.EgressProxy == nil {
		return nil
	}
	e := *p.spec.EgressProxy
	return &e
}

// Spec returns (a copy of) the spec the policy was compiled from.
func (p *Policy) Spec() Spec { return p.spec.clone() }

// Defaults returns (a copy of) the defaults the policy was compiled
// with, prefixes in canonical form.
func (p *Policy) Defaults() Defaults {
	d := p.defaults
	d.AllowPrivate = slices.Clone(d.AllowPrivate)
	d.Denied = slices.Clone(d.Denied)
	return d
}

// String describes the policy for logs, without header values or proxy
// credentials.
func (p *Policy) String() string {
	return fmt.Sprintf("netpolicy{base=%v allowNets=%d denyNets=%d domains=%d transforms=%d proxy=%v}",
		p.base && !p.denyAll, len(p.c.allowNets), len(p.c.denyNets), len(p.c.exact)+len(p.c.wild),
		len(p.c.exactT)+len(p.c.wildT), p.spec.EgressProxy != nil)
}
