package netpolicy

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"
)

func mustCompile(t *testing.T, s Spec, d Defaults) *Policy {
	t.Helper()
	p, err := Compile(s, d)
	if err != nil {
		t.Fatalf("Compile(%+v): %v", s, err)
	}
	return p
}

func TestAddr(t *testing.T) {
	allowDef := Defaults{Allow: true}
	denyDef := Defaults{Allow: false}
	private := Defaults{Allow: true, AllowPrivate: []netip.Prefix{mustPrefix("10.1.0.0/16")}}
	mixed := Spec{AllowOut: []string{"1.1.1.1", "8.8.8.0/24", "2606:4700::/32", "example.com"}, DenyOut: []string{"8.0.0.0/8", "0.0.0.0/0", "::/0"}}
	for _, tc := range []struct {
		name   string
		spec   Spec
		d      Defaults
		ip     string
		allow  bool
		reason string
	}{
		{"default allow", Spec{}, allowDef, "1.2.3.4", true, ReasonDefaultAllow},
		{"default deny", Spec{}, denyDef, "1.2.3.4", false, ReasonDefaultDeny},
		{"default allow v6", Spec{}, allowDef, "2001:db8::1", true, ReasonDefaultAllow},
		{"internet on overrides deny default", Spec{AllowInternetAccess: ptr(true)}, denyDef, "1.2.3.4", true, ReasonDefaultAllow},
		{"internet off overrides allow default", Spec{AllowInternetAccess: ptr(false)}, allowDef, "1.2.3.4", false, ReasonDenyCIDR},
		{"internet off v6", Spec{AllowInternetAccess: ptr(false)}, allowDef, "2001:db8::1", false, ReasonDenyCIDR},
		{"internet off, allowOut wins", Spec{AllowInternetAccess: ptr(false), AllowOut: []string{"1.2.3.4"}}, allowDef, "1.2.3.4", true, ReasonAllowCIDR},
		{"internet off, allowOut v6", Spec{AllowInternetAccess: ptr(false), AllowOut: []string{"2001:db8::/64"}}, allowDef, "2001:db8::9", true, ReasonAllowCIDR},
		{"reserved beats allowOut", Spec{AllowOut: []string{"169.254.169.254", "127.0.0.0/8"}}, allowDef, "169.254.169.254", false, ReasonReserved},
		{"reserved beats allow-all", Spec{AllowOut: []string{"0.0.0.0/0"}}, allowDef, "127.0.0.1", false, ReasonReserved},
		{"reserved mapped", Spec{AllowOut: []string{"0.0.0.0/0", "::/0"}}, allowDef, "::ffff:169.254.169.254", false, ReasonReserved},
		{"reserved nat64", Spec{AllowOut: []string{"::/0"}}, allowDef, "64:ff9b::169.254.169.254", false, ReasonReserved},
		{"private reserved", Spec{AllowOut: []string{"10.0.0.0/8"}}, allowDef, "10.0.0.1", false, ReasonReserved},
		{"private opened", Spec{}, private, "10.1.0.1", true, ReasonDefaultAllow},
		{"private opened, allowOut", Spec{AllowInternetAccess: ptr(false), AllowOut: []string{"10.1.0.1"}}, private, "10.1.0.1", true, ReasonAllowCIDR},
		{"private opened, not covered", Spec{}, private, "10.2.0.1", false, ReasonReserved},
		{"private opened, denyOut", Spec{DenyOut: []string{"10.1.0.0/24"}}, private, "10.1.0.1", false, ReasonDenyCIDR},
		{"invalid addr", Spec{AllowOut: []string{"0.0.0.0/0"}}, allowDef, "", false, ReasonReserved},
		{"allow ip", mixed, allowDef, "1.1.1.1", true, ReasonAllowCIDR},
		{"allow wins over deny", mixed, allowDef, "8.8.8.8", true, ReasonAllowCIDR},
		{"deny outside the allow cidr", mixed, allowDef, "8.8.9.8", false, ReasonDenyCIDR},
		{"deny all v4", mixed, allowDef, "9.9.9.9", false, ReasonDenyCIDR},
		{"allow v6 cidr", mixed, allowDef, "2606:4700::1111", true, ReasonAllowCIDR},
		{"deny all v6", mixed, allowDef, "2001:4860::8888", false, ReasonDenyCIDR},
		{"mapped matches v4 allow", mixed, allowDef, "::ffff:1.1.1.1", true, ReasonAllowCIDR},
		{"mapped matches v4 deny", Spec{DenyOut: []string{"1.1.1.1"}}, allowDef, "::ffff:1.1.1.1", false, ReasonDenyCIDR},
		{"nat64 of a denied v4", Spec{DenyOut: []string{"1.1.1.0/24"}}, allowDef, "64:ff9b::1.1.1.1", false, ReasonDenyCIDR},
		{"nat64 allowed explicitly", Spec{AllowOut: []string{"64:ff9b::/96"}, DenyOut: []string{"1.1.1.0/24"}}, allowDef, "64:ff9b::1.1.1.1", true, ReasonAllowCIDR},
		{"mapped allow entry", Spec{AllowInternetAccess: ptr(false), AllowOut: []string{"::ffff:1.1.1.0/120"}}, allowDef, "1.1.1.7", true, ReasonAllowCIDR},
		{"host bits masked", Spec{AllowInternetAccess: ptr(false), AllowOut: []string{"8.8.8.8/24"}}, allowDef, "8.8.8.200", true, ReasonAllowCIDR},
		{"host bits masked, outside", Spec{AllowInternetAccess: ptr(false), AllowOut: []string{"8.8.8.8/24"}}, allowDef, "8.8.9.1", false, ReasonDenyCIDR},
		{"deny v4 does not deny v6", Spec{DenyOut: []string{"0.0.0.0/0"}}, allowDef, "2001:db8::1", true, ReasonDefaultAllow},
		{"deny v6 does not deny v4", Spec{DenyOut: []string{"::/0"}}, allowDef, "1.2.3.4", true, ReasonDefaultAllow},
		{"domains do not allow addresses", Spec{AllowInternetAccess: ptr(false), AllowOut: []string{"example.com"}}, allowDef, "93.184.216.34", false, ReasonDenyCIDR},
		{"defaults denied", Spec{AllowOut: []string{"198.51.100.0/24"}}, Defaults{Allow: true, Denied: []netip.Prefix{mustPrefix("198.51.100.1/32")}}, "198.51.100.1", false, ReasonReserved},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ip netip.Addr
			if tc.ip != "" {
				ip = netip.MustParseAddr(tc.ip)
			}
			got := mustCompile(t, tc.spec, tc.d).Addr(ip)
			if want := (Verdict{tc.allow, tc.reason}); got != want {
				t.Errorf("Addr(%s) = %+v, want %+v", tc.ip, got, want)
			}
		})
	}
}

func TestName(t *testing.T) {
	p := mustCompile(t, Spec{AllowOut: []string{"example.com", "*.wild.org", "*.COM.", "Mixed.Case.Net.", "under_score.io", "1.1.1.1", "*.a.b.c.d"}}, Defaults{})
	for _, tc := range []struct {
		name  string
		allow bool
	}{
		{"example.com", true},
		{"EXAMPLE.com", true},
		{"example.com.", true},
		{"www.example.com", true}, // via "*.com"
		{"wild.org", false},       // the apex never matches its wildcard
		{"WILD.ORG.", false},
		{"a.wild.org", true},
		{"A.Wild.Org.", true},
		{"a.b.c.wild.org", true}, // any depth
		{"awild.org", false},
		{"wild.org.evil.net", false},
		{"com", false},
		{"mixed.case.net", true},
		{"x.mixed.case.net", false},
		{"case.net", false},
		{"under_score.io", true},
		{"x.a.b.c.d", true},
		{"a.b.c.d", false},
		{"b.c.d", false},
		// Bad names are denied.
		{"", false},
		{".", false},
		{"example.com..", false},
		{"..example.com", false},
		{".example.com", false},
		{"*.example.com", false},
		{"*.wild.org", false},
		{"a b.example.com", false},
		{"example.com:443", false},
		{"www.example.com\x00.evil", false},
		{"\u212a.wild.org", false}, // Kelvin sign: not folded into "k"
		{"k\u0307.wild.org", false},
		{"1.1.1.1", false}, // an IP literal is not a name
		{"[::1]", false},
		{strings.Repeat("a", 64) + ".com", false},
		{strings.Repeat("a.", 126) + "com", false}, // 255 bytes
	} {
		want := Verdict{false, ReasonNoDomainMatch}
		if tc.allow {
			want = Verdict{true, ReasonAllowDomain}
		}
		if got := p.Name(tc.name); got != want {
			t.Errorf("Name(%q) = %+v, want %+v", tc.name, got, want)
		}
	}
	// No domain entries: every name is denied.
	if v := mustCompile(t, Spec{AllowOut: []string{"0.0.0.0/0"}}, Defaults{Allow: true}).Name("example.com"); v.Allow || v.Reason != ReasonNoDomainMatch {
		t.Errorf("Name without domains = %+v", v)
	}
}

func TestAllowListAndHas(t *testing.T) {
	for _, tc := range []struct {
		name                                string
		spec                                Spec
		d                                   Defaults
		allowList, hasDomains, hasTransform bool
	}{
		{"default allow", Spec{}, Defaults{Allow: true}, false, false, false},
		{"default deny", Spec{}, Defaults{}, true, false, false},
		{"internet on", Spec{AllowInternetAccess: ptr(true)}, Defaults{}, false, false, false},
		{"internet off", Spec{AllowInternetAccess: ptr(false)}, Defaults{Allow: true}, true, false, false},
		{"deny all v4", Spec{DenyOut: []string{"0.0.0.0/0"}}, Defaults{Allow: true}, true, false, false},
		{"deny all v6", Spec{DenyOut: []string{"::/0"}}, Defaults{Allow: true}, true, false, false},
		{"deny all v4 with host bits", Spec{DenyOut: []string{"1.2.3.4/0"}}, Defaults{Allow: true}, true, false, false},
		{"deny some", Spec{DenyOut: []string{"0.0.0.0/1", "128.0.0.0/1"}}, Defaults{Allow: true}, false, false, false},
		{"domains", Spec{AllowOut: []string{"1.1.1.1", "example.com"}}, Defaults{Allow: true}, false, true, false},
		{"wildcard domain", Spec{AllowOut: []string{"*.example.com"}}, Defaults{Allow: true}, false, true, false},
		{"ips only", Spec{AllowOut: []string{"1.1.1.1", "::1"}}, Defaults{}, true, false, false},
		{"transform", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X-A": "1"})}}, Defaults{Allow: true}, false, false, true},
		{"wildcard transform", Spec{Rules: map[string][]Rule{"*.a.com": hdr(map[string]string{"X-A": "1"})}}, Defaults{Allow: true}, false, false, true},
		{"rules without headers", Spec{Rules: map[string][]Rule{"a.com": {{}, {Transform: &Transform{}}}}}, Defaults{Allow: true}, false, false, false},
		{"rules keyed by ip only", Spec{Rules: map[string][]Rule{"1.2.3.4": hdr(map[string]string{"X-A": "1"}), "10.0.0.0/8": hdr(map[string]string{"X-A": "1"})}}, Defaults{Allow: true}, false, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := mustCompile(t, tc.spec, tc.d)
			if got := p.AllowList(); got != tc.allowList {
				t.Errorf("AllowList = %v", got)
			}
			if got := p.HasDomains(); got != tc.hasDomains {
				t.Errorf("HasDomains = %v", got)
			}
			if got := p.HasTransforms(); got != tc.hasTransform {
				t.Errorf("HasTransforms = %v", got)
			}
		})
	}
}

func TestTransform(t *testing.T) {
	p := mustCompile(t, Spec{Rules: map[string][]Rule{
		"api.example.com": {
			{Transform: &Transform{Headers: map[string]string{"authorization": "first", "x-one": "1"}}},
			{},
			{Transform: &Transform{Headers: map[string]string{"AUTHORIZATION": "second", "X-Two": "2"}}},
		},
		"*.example.com":      hdr(map[string]string{"X-Scope": "example"}),
		"*.deep.example.com": hdr(map[string]string{"X-Scope": "deep"}),
		"*.COM":              hdr(map[string]string{"X-Scope": "com"}),
		"Exact.Org.":         hdr(map[string]string{"X-Scope": "exact"}),
		"empty.example.com":  {{}},
		"1.2.3.4":            hdr(map[string]string{"X-Scope": "ip"}),
		"10.0.0.0/8":         hdr(map[string]string{"X-Scope": "cidr"}),
	}}, Defaults{})
	for _, tc := range []struct {
		host string
		want map[string]string // nil: no transform
	}{
		{"api.example.com", map[string]string{"Authorization": "second", "X-One": "1", "X-Two": "2"}}, // exact over wildcard, merged in order
		{"API.Example.COM.", map[string]string{"Authorization": "second", "X-One": "1", "X-Two": "2"}},
		{"v2.api.example.com", map[string]string{"X-Scope": "example"}}, // exact keys do not cover subdomains
		{"www.example.com", map[string]string{"X-Scope": "example"}},
		{"a.b.example.com", map[string]string{"X-Scope": "example"}},
		{"x.deep.example.com", map[string]string{"X-Scope": "deep"}}, // longest wildcard
		{"y.x.deep.example.com", map[string]string{"X-Scope": "deep"}},
		{"deep.example.com", map[string]string{"X-Scope": "example"}}, // the apex of *.deep is a subdomain of *.example
		{"example.com", map[string]string{"X-Scope": "com"}},
		{"other.com", map[string]string{"X-Scope": "com"}},
		{"empty.example.com", map[string]string{"X-Scope": "example"}}, // a key without headers is no transform
		{"com", nil},
		{"exact.org", map[string]string{"X-Scope": "exact"}},
		{"sub.exact.org", nil},
		{"org", nil},
		{"1.2.3.4", nil}, // IP keys never match
		{"10.0.0.1", nil},
		{"", nil},
		{"bad host.com", nil},
		{"*.example.com", nil},
		{"api.example.com:443", nil},
	} {
		got := p.Transform(tc.host)
		if tc.want == nil {
			if got != nil {
				t.Errorf("Transform(%q) = %v, want nil", tc.host, got.Headers)
			}
			continue
		}
		if got == nil || !reflect.DeepEqual(got.Headers, tc.want) {
			t.Errorf("Transform(%q) = %v, want %v", tc.host, got, tc.want)
		}
	}
	if p.Proxy() != nil {
		t.Error("Proxy() != nil without egressProxy")
	}
}

func TestString(t *testing.T) {
	p := mustCompile(t, Spec{
		Rules:       map[string][]Rule{"a.com": hdr(map[string]string{"X-A": "s3cr3t"})},
		EgressProxy: &EgressProxy{Address: "p.example:1", Username: "us3r", Password: "pa55"},
	}, Defaults{})
	s := p.String()
	for _, secret := range []string{"s3cr3t", "us3r", "pa55"} {
		if strings.Contains(s, secret) {
			t.Errorf("String() = %q holds %q", s, secret)
		}
	}
}
