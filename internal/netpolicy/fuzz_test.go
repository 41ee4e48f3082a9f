package netpolicy

import (
	"encoding/json"
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
)

// FuzzSpecJSON: whatever JSON a user sends, Validate and Compile return
// a typed error or a policy, never panic; a compiled policy decides any
// address and name without panicking, and never allows a reserved one.
func FuzzSpecJSON(f *testing.F) {
	for _, s := range []string{
		`{}`,
		`{"allow_internet_access":false,"allowOut":["1.1.1.1","*.example.com","example.org"],"denyOut":["0.0.0.0/0","::/0"]}`,
		`{"allowOut":["8.8.8.8/24","::ffff:1.2.3.0/120","2001:db8::/32","*.com"],"denyOut":["10.0.0.0/8"]}`,
		`{"rules":{"api.example.com":[{"transform":{"headers":{"Authorization":"Bearer ${e2b.secrets.T}"}}}],"*.x.com":[{},{"transform":{}}],"1.2.3.4":[]}}`,
		`{"egressProxy":{"address":"[2001:db8::1]:1080","username":"u","password":"p"}}`,
		`{"allowOut":["*","*.","a.*.com","fe80::1%eth0"],"denyOut":["example.com"]}`,
		`{"rules":{"a.com":[{"transform":{"headers":{"X":"a\r\nb","content-length":"1"}}}]}}`,
	} {
		f.Add([]byte(s), []byte{1, 1, 1, 1}, "www.example.com", true)
	}
	f.Add([]byte(`{"allowOut":["::/0"]}`), []byte{0, 0x64, 0xff, 0x9b, 0, 0, 0, 0, 0, 0, 0, 0, 169, 254, 169, 254}, "", false)
	f.Fuzz(func(t *testing.T, data, ipb []byte, name string, allow bool) {
		var s Spec
		if json.Unmarshal(data, &s) != nil {
			return
		}
		d := Defaults{Allow: allow, AllowPrivate: []netip.Prefix{mustPrefix("10.1.0.0/16")}}
		verr := s.Validate()
		p, cerr := Compile(s, d)
		if (verr == nil) != (cerr == nil) {
			t.Fatalf("Validate = %v but Compile = %v", verr, cerr)
		}
		if cerr != nil {
			if !errors.Is(cerr, errdefs.ErrInvalid) || p != nil {
				t.Fatalf("Compile = %v, %v: want nil, ErrInvalid", p, cerr)
			}
			return
		}
		var ip netip.Addr
		switch len(ipb) {
		case 4:
			ip = netip.AddrFrom4([4]byte(ipb))
		case 16:
			ip = netip.AddrFrom16([16]byte(ipb))
		}
		v := p.Addr(ip)
		if d.Reserved(ip) && v != (Verdict{false, ReasonReserved}) {
			t.Fatalf("Addr(%v) = %+v for a reserved address", ip, v)
		}
		if ip.Is4() && p.Addr(netip.AddrFrom16(ip.As16())) != v {
			t.Fatalf("Addr(%v) differs from its IPv4-mapped form", ip)
		}
		n := p.Name(name)
		if n.Allow {
			if _, err := normalizeName(name); err != nil {
				t.Fatalf("Name(%q) allowed a bad name", name)
			}
		}
		if tr := p.Transform(name); tr != nil && len(tr.Headers) == 0 {
			t.Fatalf("Transform(%q) is empty, not nil", name)
		}
		_ = p.AllowList()
		_ = p.HasDomains()
		_ = p.HasTransforms()
		_ = p.Proxy()
		_ = p.String()
		_ = s.SecretRefs()
		// What compiled survives its own JSON.
		b, err := json.Marshal(p.Spec())
		if err != nil {
			t.Fatal(err)
		}
		var back Spec
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatal(err)
		}
		if _, err := Compile(back, d); err != nil {
			t.Fatalf("round-tripped spec no longer compiles: %v", err)
		}
		// Resolving with a clean secret keeps the spec valid and leaves
		// no placeholder behind.
		r, err := s.ResolveSecrets(func(string) (string, bool) { return "v", true })
		if err != nil {
			t.Fatalf("ResolveSecrets of a valid spec: %v", err)
		}
		if _, err := Compile(r, d); err != nil {
			t.Fatalf("resolved spec no longer compiles: %v", err)
		}
		for _, list := range r.Rules {
			for _, rule := range list {
				if rule.Transform == nil {
					continue
				}
				for _, hv := range rule.Transform.Headers {
					if strings.Contains(hv, placeholderOpen) {
						t.Fatalf("placeholder left in %q", hv)
					}
				}
			}
		}
	})
}

// FuzzName: Name never panics, allows only valid names, and decides a
// name the same whatever its case and with or without a trailing dot.
func FuzzName(f *testing.F) {
	for _, s := range []string{"example.com", "a.wild.org", "wild.org", "WWW.Example.COM.", "", ".", "..", "*.wild.org",
		"1.1.1.1", "\u212a.wild.org", "a..b", strings.Repeat("a", 64) + ".org", "x_y.io", "-.org"} {
		f.Add(s)
	}
	p, err := Compile(Spec{
		AllowOut: []string{"example.com", "*.wild.org", "*.io", "under_score.net"},
		Rules:    map[string][]Rule{"*.wild.org": hdr(map[string]string{"X-A": "1"}), "example.com": hdr(map[string]string{"X-B": "1"})},
	}, Defaults{})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, name string) {
		v := p.Name(name)
		if v.Reason != ReasonAllowDomain && v.Reason != ReasonNoDomainMatch || v.Allow != (v.Reason == ReasonAllowDomain) {
			t.Fatalf("Name(%q) = %+v", name, v)
		}
		norm, err := normalizeName(name)
		if v.Allow && err != nil {
			t.Fatalf("Name(%q) allowed a bad name: %v", name, err)
		}
		if err == nil {
			if again, err := normalizeName(norm); err != nil || again != norm {
				t.Fatalf("normalizeName not idempotent on %q: %q, %v", norm, again, err)
			}
			if p.Name(norm) != v || p.Name(strings.ToUpper(norm)) != v || p.Name(norm+".") != v {
				t.Fatalf("Name(%q) depends on case or a trailing dot", name)
			}
			if (p.Transform(name) == nil) != (p.Transform(strings.ToUpper(norm)+".") == nil) {
				t.Fatalf("Transform(%q) depends on case or a trailing dot", name)
			}
		}
	})
}
