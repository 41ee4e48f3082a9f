package netpolicy

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
)

// normalizeName lower-cases a DNS name, drops one trailing dot and checks
// its syntax: at most 253 bytes, labels of 1-63 bytes of [a-z0-9-_], and
// a last label that is not all digits (so "1.2.3.4" or "010.1.1.1" is
// never taken for a name). Only ASCII is lower-cased: strings.ToLower
// would fold the Kelvin sign into "k" and let a name that the upstream
// sees differently match an allowed one.
func normalizeName(n string) (string, error) {
	n = strings.TrimSuffix(n, ".")
	if n == "" {
		return "", errors.New("empty name")
	}
	if len(n) > MaxNameLen {
		return "", fmt.Errorf("name longer than %d bytes", MaxNameLen)
	}
	b := []byte(n)
	labelStart, digitsOnly := 0, true
	for i := 0; i <= len(b); i++ {
		if i == len(b) || b[i] == '.' {
			switch l := i - labelStart; {
			case l == 0:
				return "", errors.New("empty label")
			case l > MaxLabelLen:
				return "", fmt.Errorf("label longer than %d bytes", MaxLabelLen)
			}
			if i == len(b) && digitsOnly {
				return "", errors.New("last label is all digits")
			}
			labelStart, digitsOnly = i+1, true
			continue
		}
		c := b[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
			b[i] = c
		}
		switch {
		case '0' <= c && c <= '9':
		case 'a' <= c && c <= 'z', c == '-', c == '_':
			digitsOnly = false
		default:
			return "", fmt.Errorf("byte %d is not a letter, digit, '-' or '_'", i)
		}
	}
	return string(b), nil
}

// parsePattern parses a domain or a "*.domain" wildcard (a single leading
// "*." only, followed by at least one label: "*.com" is allowed, as E2B
// allows broad wildcards). It returns the normalised domain without "*.".
func parsePattern(e string) (d string, wildcard bool, err error) {
	rest, wildcard := strings.CutPrefix(e, "*.")
	if e == "*" {
		return "", false, errors.New(`a bare "*" is not a pattern (allow 0.0.0.0/0 and ::/0 instead)`)
	}
	if strings.Contains(rest, "*") {
		return "", false, errors.New(`"*" only as a single leading "*."`)
	}
	d, err = normalizeName(rest)
	return d, wildcard, err
}

// parseNet parses an IP or CIDR entry. ok is false (and err nil) when e
// is neither and may be a name. A CIDR with host bits set is masked
// (lenient, as the SDK's users write "8.8.8.8/24"); IPv4-mapped forms are
// unmapped so that they match the IPv4 addresses they denote.
func parseNet(e string) (p netip.Prefix, ok bool, err error) {
	if strings.Contains(e, "/") {
		p, err = netip.ParsePrefix(e)
		if err != nil {
			return netip.Prefix{}, false, fmt.Errorf("bad CIDR: %v", err)
		}
		return canonPrefix(p), true, nil
	}
	a, err := netip.ParseAddr(e)
	if err != nil {
		if strings.Contains(e, ":") {
			// No name has a colon: this was meant as an address.
			return netip.Prefix{}, false, fmt.Errorf("bad IP: %v", err)
		}
		return netip.Prefix{}, false, nil
	}
	if a.Zone() != "" {
		return netip.Prefix{}, false, errors.New("zoned address")
	}
	return canonPrefix(netip.PrefixFrom(a, a.BitLen())), true, nil
}

// canonPrefix masks p and unmaps an IPv4-mapped prefix.
func canonPrefix(p netip.Prefix) netip.Prefix {
	if a := p.Addr(); a.Is4In6() && p.Bits() >= 96 {
		p = netip.PrefixFrom(a.Unmap(), p.Bits()-96)
	}
	return p.Masked()
}

// parseRuleKey parses a rules key: a name, a "*." wildcard, an IP or a
// CIDR. norm is the key in normal form ("*.d" for a wildcard, the masked
// prefix for an IP or CIDR); isName is false for an IP or CIDR.
func parseRuleKey(key string) (norm string, wildcard, isName bool, err error) {
	p, ok, err := parseNet(key)
	if err != nil {
		return "", false, false, err
	}
	if ok {
		return p.String(), false, false, nil
	}
	d, wildcard, err := parsePattern(key)
	if err != nil {
		return "", false, false, err
	}
	if wildcard {
		return "*." + d, true, true, nil
	}
	return d, false, true, nil
}

func sortedKeys[M ~map[string]V, V any](m M) []string {
	return slices.Sorted(maps.Keys(m))
}
