// Package netpolicy holds a sandbox's outbound network policy: the
// E2B-compatible Spec as users write it, its validation, and the compiled
// Policy that the worker's egress proxy and DNS server consult for every
// connection and query. It is pure (no I/O, no goroutines) so that every
// verdict can be table-tested and fuzzed; the addresses a sandbox may never
// reach whatever its policy says (loopback, link-local and cloud metadata,
// private ranges the operator has not opened...) are decided here too, in
// one place, by Defaults.Reserved.
package netpolicy

import (
	"fmt"
	"maps"
	"net"
	"net/netip"
	"net/textproto"
	"strconv"
	"strings"

	"github.com/spacesbx/space/internal/errdefs"
)

// Spec is the E2B network configuration as stored and sent to workers.
// JSON names are E2B's.
type Spec struct {
	// AllowInternetAccess, when set, replaces the operator's default
	// (Defaults.Allow); false behaves like denyOut 0.0.0.0/0 and ::/0.
	AllowInternetAccess *bool `json:"allow_internet_access,omitempty"`
	// AllowOut lists what is reachable whatever DenyOut says: CIDRs, IPs,
	// domains and "*.domain" wildcards (subdomains at any depth, never
	// the apex).
	AllowOut []string `json:"allowOut,omitempty"`
	// DenyOut lists CIDRs and IPs only: a name cannot be denied reliably
	// (a sandbox can reach the same address under another name).
	DenyOut []string `json:"denyOut,omitempty"`
	// Rules maps a host pattern (exact name or "*.suffix"; IPs and CIDRs
	// are accepted and kept but never matched) to the rules applied to
	// requests for it.
	Rules map[string][]Rule `json:"rules,omitempty"`
	// EgressProxy chains outbound connections through a SOCKS5 proxy.
	EgressProxy *EgressProxy `json:"egressProxy,omitempty"`
}

// Rule is one rule for a host pattern.
type Rule struct {
	Transform *Transform `json:"transform,omitempty"`
}

// Transform holds the request headers set on intercepted requests.
// Values may reference secrets as ${e2b.secrets.NAME}.
type Transform struct {
	Headers map[string]string `json:"headers,omitempty"`
}

// EgressProxy is an upstream SOCKS5 proxy.
type EgressProxy struct {
	Address  string `json:"address"` // host:port of a SOCKS5 proxy
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
}

// Limits enforced by Validate. They bound the work a policy costs per
// connection and the size of what is stored per sandbox; the SOCKS5 ones
// are the protocol's (RFC 1929 length bytes).
const (
	MaxAllowOut        = 256
	MaxDenyOut         = 256
	MaxRuleKeys        = 64
	MaxRulesPerKey     = 16
	MaxHeaders         = 32
	MaxHeaderNameLen   = 128
	MaxHeaderValueLen  = 8 << 10
	MaxNameLen         = 253
	MaxLabelLen        = 63
	MaxProxyCredential = 255
)

// framingHeaders may not be set by a transform: they decide how the
// upstream frames the request (overriding them smuggles a second request
// past the proxy) or are hop-by-hop, and Host would let a transform send
// the request to another virtual host than the one the policy allowed.
var framingHeaders = map[string]bool{
	"Host": true, "Content-Length": true, "Transfer-Encoding": true, "Connection": true,
	"Upgrade": true, "Te": true, "Trailer": true, "Keep-Alive": true, "Proxy-Connection": true,
}

// Validate checks syntax and limits; errors wrap errdefs.ErrInvalid and
// name the offending entry (never a header value or a proxy credential,
// which may be secrets).
func (s Spec) Validate() error {
	_, err := compileSpec(s)
	return err
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("netpolicy: %s: %w", fmt.Sprintf(format, args...), errdefs.ErrInvalid)
}

// quote quotes user input for an error message, cut short: an entry may
// be up to 8 KiB of junk.
func quote(s string) string {
	if len(s) > 80 {
		s = s[:80] + "..."
	}
	return strconv.Quote(s)
}

// compiledSpec is a validated Spec in normalised form.
type compiledSpec struct {
	allowNets []netip.Prefix
	denyNets  []netip.Prefix
	exact     map[string]bool // allowOut domains
	wild      map[string]bool // allowOut "*.d" entries, by d
	// transforms by normalised name key and by wildcard suffix; only keys
	// whose merged transform sets at least one header.
	exactT map[string]*Transform
	wildT  map[string]*Transform
}

func compileSpec(s Spec) (*compiledSpec, error) {
	c := &compiledSpec{exact: map[string]bool{}, wild: map[string]bool{}, exactT: map[string]*Transform{}, wildT: map[string]*Transform{}}
	if len(s.AllowOut) > MaxAllowOut {
		return nil, invalid("allowOut: %d entries, at most %d", len(s.AllowOut), MaxAllowOut)
	}
	if len(s.DenyOut) > MaxDenyOut {
		return nil, invalid("denyOut: %d entries, at most %d", len(s.DenyOut), MaxDenyOut)
	}
	for i, e := range s.AllowOut {
		if p, ok, err := parseNet(e); err != nil {
			return nil, invalid("allowOut[%d] %s: %v", i, quote(e), err)
		} else if ok {
			c.allowNets = append(c.allowNets, p)
			continue
		}
		d, wildcard, err := parsePattern(e)
		if err != nil {
			return nil, invalid("allowOut[%d] %s: not an IP, CIDR or domain: %v", i, quote(e), err)
		}
		if wildcard {
			c.wild[d] = true
		} else {
			c.exact[d] = true
		}
	}
	for i, e := range s.DenyOut {
		p, ok, err := parseNet(e)
		if err != nil {
			return nil, invalid("denyOut[%d] %s: %v", i, quote(e), err)
		}
		if !ok {
			return nil, invalid("denyOut[%d] %s: not an IP or CIDR (domains cannot be denied, only left out of allowOut)", i, quote(e))
		}
		c.denyNets = append(c.denyNets, p)
	}
	if err := c.compileRules(s.Rules); err != nil {
		return nil, err
	}
	if s.EgressProxy != nil {
		if err := validateProxy(*s.EgressProxy); err != nil {
			return nil, err
		}
	}
	return c, nil
}

func (c *compiledSpec) compileRules(rules map[string][]Rule) error {
	if len(rules) > MaxRuleKeys {
		return invalid("rules: %d keys, at most %d", len(rules), MaxRuleKeys)
	}
	seen := make(map[string]string, len(rules))
	// Sorted so that the error for a spec with several faults is always
	// the same one.
	for _, key := range sortedKeys(rules) {
		list := rules[key]
		if len(list) > MaxRulesPerKey {
			return invalid("rules[%s]: %d rules, at most %d", quote(key), len(list), MaxRulesPerKey)
		}
		norm, wildcard, isName, err := parseRuleKey(key)
		if err != nil {
			return invalid("rules[%s]: not a host name, \"*.\" wildcard, IP or CIDR: %v", quote(key), err)
		}
		if other, dup := seen[norm]; dup {
			return invalid("rules[%s]: same host as rules[%s]", quote(key), quote(other))
		}
		seen[norm] = key
		merged := map[string]string{}
		for j, r := range list {
			if r.Transform == nil {
				continue
			}
			h, err := validateHeaders(r.Transform.Headers)
			if err != nil {
				return invalid("rules[%s][%d]: %v", quote(key), j, err)
			}
			maps.Copy(merged, h) // later rules override earlier ones
		}
		if !isName || len(merged) == 0 {
			continue
		}
		t := &Transform{Headers: merged}
		if wildcard {
			c.wildT[norm[len("*."):]] = t
		} else {
			c.exactT[norm] = t
		}
	}
	return nil
}

// validateHeaders checks one transform's headers and returns them keyed
// by canonical name.
func validateHeaders(h map[string]string) (map[string]string, error) {
	if len(h) > MaxHeaders {
		return nil, fmt.Errorf("%d headers, at most %d", len(h), MaxHeaders)
	}
	out := make(map[string]string, len(h))
	for _, name := range sortedKeys(h) {
		if err := validHeaderName(name); err != nil {
			return nil, fmt.Errorf("header %s: %v", quote(name), err)
		}
		canon := textproto.CanonicalMIMEHeaderKey(name)
		if framingHeaders[canon] {
			return nil, fmt.Errorf("header %s: may not be set by a transform", quote(name))
		}
		if _, dup := out[canon]; dup {
			return nil, fmt.Errorf("header %s: set twice (names are case-insensitive)", quote(name))
		}
		v := h[name]
		if err := validHeaderValue(v); err != nil {
			return nil, fmt.Errorf("header %s value: %v", quote(name), err)
		}
		if _, err := scanPlaceholders(v, nil); err != nil {
			return nil, fmt.Errorf("header %s value: %v", quote(name), err)
		}
		out[canon] = v
	}
	return out, nil
}

// validHeaderName: an RFC 7230 token.
func validHeaderName(name string) error {
	if name == "" {
		return fmt.Errorf("empty name")
	}
	if len(name) > MaxHeaderNameLen {
		return fmt.Errorf("name longer than %d bytes", MaxHeaderNameLen)
	}
	for i := 0; i < len(name); i++ {
		if !isTokenChar(name[i]) {
			return fmt.Errorf("byte %d of the name is not a token character", i)
		}
	}
	return nil
}

func isTokenChar(b byte) bool {
	switch {
	case 'a' <= b && b <= 'z', 'A' <= b && b <= 'Z', '0' <= b && b <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", b) >= 0
}

// validHeaderValue refuses what would end the header early (CR, LF: a
// second header or request injected) or be cut by a C string (NUL).
// Values are never quoted in errors: they may hold secrets.
func validHeaderValue(v string) error {
	if len(v) > MaxHeaderValueLen {
		return fmt.Errorf("longer than %d bytes", MaxHeaderValueLen)
	}
	if strings.ContainsAny(v, "\r\n\x00") {
		return fmt.Errorf("contains CR, LF or NUL")
	}
	return nil
}

func validateProxy(p EgressProxy) error {
	// An address written as a URL with credentials ("user:pass@host:1080")
	// is not echoed back.
	addr := quote(p.Address)
	if strings.Contains(p.Address, "@") {
		addr = "(redacted: contains '@')"
	}
	host, port, err := net.SplitHostPort(p.Address)
	if err != nil {
		return invalid("egressProxy address %s: not host:port", addr)
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil || n == 0 {
		return invalid("egressProxy address %s: port not in 1-65535", addr)
	}
	if a, err := netip.ParseAddr(host); err == nil {
		if a.Zone() != "" {
			return invalid("egressProxy address %s: zoned address", addr)
		}
	} else if _, err := normalizeName(host); err != nil {
		return invalid("egressProxy address %s: host is neither an IP nor a DNS name: %v", addr, err)
	}
	if len(p.Username) > MaxProxyCredential || len(p.Password) > MaxProxyCredential {
		return invalid("egressProxy: username and password are at most %d bytes each", MaxProxyCredential)
	}
	if p.Username == "" && p.Password != "" {
		return invalid("egressProxy: a password without a username")
	}
	return nil
}

// clone returns a deep copy: a Policy hands out its Spec and must not let
// a caller change what it was compiled from.
func (s Spec) clone() Spec {
	out := s
	if s.AllowInternetAccess != nil {
		v := *s.AllowInternetAccess
		out.AllowInternetAccess = &v
	}
	out.AllowOut = cloneSlice(s.AllowOut)
	out.DenyOut = cloneSlice(s.DenyOut)
	if s.Rules != nil {
		out.Rules = make(map[string][]Rule, len(s.Rules))
		for k, list := range s.Rules {
			var cl []Rule
			if list != nil {
				cl = make([]Rule, len(list))
			}
			for i, r := range list {
				if r.Transform != nil {
					cl[i].Transform = r.Transform.clone()
				}
			}
			out.Rules[k] = cl
		}
	}
	if s.EgressProxy != nil {
		p := *s.EgressProxy
		out.EgressProxy = &p
	}
	return out
}

func (t *Transform) clone() *Transform {
	if t == nil {
		return nil
	}
	return &Transform{Headers: maps.Clone(t.Headers)}
}

func cloneSlice(s []string) []string {
	if s == nil {
		return nil
	}
	return append([]string{}, s...)
}
