package netpolicy

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
)

func ptr[T any](v T) *T { return &v }

func hdr(h map[string]string) []Rule { return []Rule{{Transform: &Transform{Headers: h}}} }

func list(n int, f func(i int) string) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = f(i)
	}
	return out
}

func TestValidateAccepts(t *testing.T) {
	for _, tc := range []struct {
		name string
		spec Spec
	}{
		{"empty", Spec{}},
		{"internet off", Spec{AllowInternetAccess: ptr(false)}},
		{"ips and cidrs", Spec{AllowOut: []string{"1.1.1.1", "8.8.8.0/24", "2001:4860::/32", "2606:4700::1111", "0.0.0.0/0", "::/0"}}},
		{"cidr with host bits is masked", Spec{AllowOut: []string{"8.8.8.8/24"}, DenyOut: []string{"1.2.3.4/8"}}},
		{"ipv4-mapped", Spec{AllowOut: []string{"::ffff:1.2.3.4", "::ffff:1.2.3.0/120"}}},
		{"domains", Spec{AllowOut: []string{"example.com", "Example.ORG.", "a_b.example.com", "x-y.example", "localhost", "1.2.3.example"}}},
		{"wildcards", Spec{AllowOut: []string{"*.example.com", "*.com", "*.Example.NET."}}},
		{"max allowOut", Spec{AllowOut: list(MaxAllowOut, func(i int) string { return fmt.Sprintf("h%d.example.com", i) })}},
		{"max denyOut", Spec{DenyOut: list(MaxDenyOut, func(i int) string { return fmt.Sprintf("10.0.%d.0/24", i) })}},
		{"rules", Spec{Rules: map[string][]Rule{
			"api.example.com":   hdr(map[string]string{"Authorization": "Bearer ${e2b.secrets.TOKEN}", "x-empty": ""}),
			"*.example.com":     hdr(map[string]string{"X-A": "1"}),
			"1.2.3.4":           hdr(map[string]string{"X-A": "1"}),
			"10.0.0.0/8":        hdr(map[string]string{"X-A": "1"}),
			"nil.example.com":   {{}, {Transform: &Transform{}}},
			"token.example.com": hdr(map[string]string{"!#$%&'*+-.^_`|~09azAZ": "${literal} $ {e2b.secrets.x} $"}),
		}}},
		{"max rules", Spec{Rules: func() map[string][]Rule {
			m := map[string][]Rule{}
			for i := 0; i < MaxRuleKeys; i++ {
				rs := make([]Rule, MaxRulesPerKey)
				for j := range rs {
					h := map[string]string{}
					for k := 0; k < MaxHeaders; k++ {
						h[fmt.Sprintf("X-%d", k)] = "v"
					}
					rs[j] = Rule{Transform: &Transform{Headers: h}}
				}
				m[fmt.Sprintf("h%d.example.com", i)] = rs
			}
			return m
		}()}},
		{"longest header name and value", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{strings.Repeat("x", MaxHeaderNameLen): strings.Repeat("v", MaxHeaderValueLen)})}}},
		{"long name and labels", Spec{AllowOut: []string{strings.Repeat("a", 63) + "." + strings.Repeat("b.", 93) + "com"}}},
		{"proxy host:port", Spec{EgressProxy: &EgressProxy{Address: "proxy.example.com:1080"}}},
		{"proxy ipv6", Spec{EgressProxy: &EgressProxy{Address: "[2001:db8::1]:65535", Username: "u", Password: "p"}}},
		{"proxy user only", Spec{EgressProxy: &EgressProxy{Address: "198.51.100.1:1", Username: strings.Repeat("u", 255)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.spec.Validate(); err != nil {
				t.Fatalf("Validate: %v", err)
			}
			if _, err := Compile(tc.spec, Defaults{}); err != nil {
				t.Fatalf("Compile: %v", err)
			}
		})
	}
}

func TestValidateRejects(t *testing.T) {
	longName := strings.Repeat("abcdefghi.", 25) + "comx" // 254 bytes
	for _, tc := range []struct {
		name string
		spec Spec
		want string // in the error: the offending entry
	}{
		{"too many allowOut", Spec{AllowOut: list(MaxAllowOut+1, func(i int) string { return "1.1.1.1" })}, "allowOut: 257"},
		{"too many denyOut", Spec{DenyOut: list(MaxDenyOut+1, func(i int) string { return "1.1.1.1" })}, "denyOut: 257"},
		{"empty allowOut entry", Spec{AllowOut: []string{""}}, `allowOut[0] ""`},
		{"bad cidr", Spec{AllowOut: []string{"1.2.3.4/33"}}, `allowOut[0] "1.2.3.4/33"`},
		{"bad cidr garbage", Spec{AllowOut: []string{"example.com/24"}}, "bad CIDR"},
		{"bad ipv6", Spec{AllowOut: []string{"2001:db8::g"}}, "bad IP"},
		{"zoned ip", Spec{AllowOut: []string{"fe80::1%eth0"}}, "zoned"},
		{"zoned cidr", Spec{DenyOut: []string{"fe80::1%eth0/64"}}, "denyOut[0]"},
		{"ipv4 leading zero", Spec{AllowOut: []string{"1.2.3.04"}}, "all digits"},
		{"numeric name", Spec{AllowOut: []string{"256.1.1.1"}}, "all digits"},
		{"bad domain char", Spec{AllowOut: []string{"exa mple.com"}}, `allowOut[0] "exa mple.com"`},
		{"bad domain unicode", Spec{AllowOut: []string{"\u212aexample.com"}}, "allowOut[0]"},
		{"empty label", Spec{AllowOut: []string{"a..com"}}, "empty label"},
		{"leading dot", Spec{AllowOut: []string{".example.com"}}, "empty label"},
		{"two trailing dots", Spec{AllowOut: []string{"example.com.."}}, "empty label"},
		{"label too long", Spec{AllowOut: []string{strings.Repeat("a", 64) + ".com"}}, "label longer"},
		{"name too long", Spec{AllowOut: []string{longName}}, "longer than 253"},
		{"bare star", Spec{AllowOut: []string{"*"}}, `bare "*"`},
		{"star dot", Spec{AllowOut: []string{"*."}}, "empty name"},
		{"star dot dot", Spec{AllowOut: []string{"*..com"}}, "empty label"},
		{"wildcard in the middle", Spec{AllowOut: []string{"a.*.com"}}, `single leading "*."`},
		{"double wildcard", Spec{AllowOut: []string{"*.*.com"}}, `single leading "*."`},
		{"star without dot", Spec{AllowOut: []string{"*example.com"}}, `single leading "*."`},
		{"trailing wildcard", Spec{AllowOut: []string{"example.*"}}, `single leading "*."`},
		{"deny entry is a domain", Spec{DenyOut: []string{"example.com"}}, `denyOut[0] "example.com": not an IP or CIDR`},
		{"deny entry is a wildcard", Spec{DenyOut: []string{"*.example.com"}}, "denyOut[0]"},
		{"deny bad cidr", Spec{DenyOut: []string{"10.0.0.0/8", "10.0.0.0/-1"}}, "denyOut[1]"},
		{"too many rule keys", Spec{Rules: func() map[string][]Rule {
			m := map[string][]Rule{}
			for i := 0; i <= MaxRuleKeys; i++ {
				m[fmt.Sprintf("h%d.example.com", i)] = nil
			}
			return m
		}()}, "rules: 65 keys"},
		{"too many rules per key", Spec{Rules: map[string][]Rule{"a.com": make([]Rule, MaxRulesPerKey+1)}}, `rules["a.com"]: 17 rules`},
		{"bad rule key", Spec{Rules: map[string][]Rule{"a b.com": nil}}, `rules["a b.com"]`},
		{"bare star rule key", Spec{Rules: map[string][]Rule{"*": nil}}, `rules["*"]`},
		{"mid wildcard rule key", Spec{Rules: map[string][]Rule{"a.*.com": nil}}, `rules["a.*.com"]`},
		{"bad cidr rule key", Spec{Rules: map[string][]Rule{"10.0.0.0/40": nil}}, `rules["10.0.0.0/40"]`},
		{"duplicate rule key by case", Spec{Rules: map[string][]Rule{"A.com": nil, "a.com.": nil}}, "same host"},
		{"too many headers", Spec{Rules: map[string][]Rule{"a.com": hdr(func() map[string]string {
			h := map[string]string{}
			for i := 0; i <= MaxHeaders; i++ {
				h[fmt.Sprintf("X-%d", i)] = ""
			}
			return h
		}())}}, "33 headers"},
		{"empty header name", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"": "v"})}}, "empty name"},
		{"header name not a token", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X Y": "v"})}}, "token"},
		{"header name with colon", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X:Y": "v"})}}, "token"},
		{"header name with CRLF", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X\r\nY": "v"})}}, "token"},
		{"header name too long", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{strings.Repeat("x", 129): "v"})}}, "longer than 128"},
		{"header value with CR", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X-A": "a\rb"})}}, "CR, LF or NUL"},
		{"header value with LF", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X-A": "a\nEvil: 1"})}}, "CR, LF or NUL"},
		{"header value with NUL", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X-A": "a\x00"})}}, "CR, LF or NUL"},
		{"header value too long", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X-A": strings.Repeat("v", MaxHeaderValueLen+1)})}}, "longer than 8192"},
		{"header twice by case", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"x-a": "1", "X-A": "2"})}}, "set twice"},
		{"framing header", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"content-length": "0"})}}, "may not be set"},
		{"host header", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"Host": "evil.com"})}}, "may not be set"},
		{"transfer-encoding header", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"Transfer-Encoding": "chunked"})}}, "may not be set"},
		{"identity token", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"Authorization": "${e2b.identity.tokens.X}"})}}, "identity"},
		{"unknown placeholder", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X-A": "${e2b.env.X}"})}}, "unknown"},
		{"unterminated placeholder", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X-A": "${e2b.secrets.X"})}}, "unterminated"},
		{"empty secret name", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X-A": "${e2b.secrets.}"})}}, "secret name"},
		{"bad secret name", Spec{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X-A": "${e2b.secrets.a b}"})}}, "secret name"},
		{"fault in a later rule", Spec{Rules: map[string][]Rule{"a.com": {{}, {Transform: &Transform{Headers: map[string]string{"X-A": "\n"}}}}}}, `rules["a.com"][1]`},
		{"proxy no port", Spec{EgressProxy: &EgressProxy{Address: "proxy.example.com"}}, "not host:port"},
		{"proxy url", Spec{EgressProxy: &EgressProxy{Address: "socks5://proxy.example.com:1080"}}, "not host:port"},
		{"proxy empty", Spec{EgressProxy: &EgressProxy{}}, "not host:port"},
		{"proxy port 0", Spec{EgressProxy: &EgressProxy{Address: "proxy.example.com:0"}}, "port not in"},
		{"proxy port too big", Spec{EgressProxy: &EgressProxy{Address: "proxy.example.com:65536"}}, "port not in"},
		{"proxy port name", Spec{EgressProxy: &EgressProxy{Address: "proxy.example.com:socks"}}, "port not in"},
		{"proxy port signed", Spec{EgressProxy: &EgressProxy{Address: "proxy.example.com:+1080"}}, "port not in"},
		{"proxy empty host", Spec{EgressProxy: &EgressProxy{Address: ":1080"}}, "neither an IP"},
		{"proxy bad host", Spec{EgressProxy: &EgressProxy{Address: "a b:1080"}}, "neither an IP"},
		{"proxy zoned host", Spec{EgressProxy: &EgressProxy{Address: "[fe80::1%eth0]:1080"}}, "zoned"},
		{"proxy ipv6 without brackets", Spec{EgressProxy: &EgressProxy{Address: "2001:db8::1:1080"}}, "not host:port"},
		{"proxy username too long", Spec{EgressProxy: &EgressProxy{Address: "p.example:1", Username: strings.Repeat("u", 256)}}, "at most 255"},
		{"proxy password too long", Spec{EgressProxy: &EgressProxy{Address: "p.example:1", Username: "u", Password: strings.Repeat("p", 256)}}, "at most 255"},
		{"proxy password without username", Spec{EgressProxy: &EgressProxy{Address: "p.example:1", Password: "p"}}, "without a username"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.spec.Validate()
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("Validate = %v, want ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate = %q, want it to mention %q", err, tc.want)
			}
			p, cerr := Compile(tc.spec, Defaults{Allow: true})
			if p != nil || !errors.Is(cerr, errdefs.ErrInvalid) {
				t.Errorf("Compile = %v, %v; want nil, ErrInvalid", p, cerr)
			}
		})
	}
}

// Errors never carry header values or proxy credentials: they may be
// secrets and errors end up in logs and API answers.
func TestValidateErrorsHideSecrets(t *testing.T) {
	const secret = "s3cr3t-VALUE"
	for _, s := range []Spec{
		{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X-A": secret + "\n"})}},
		{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X-A": secret + strings.Repeat("v", MaxHeaderValueLen)})}},
		{Rules: map[string][]Rule{"a.com": hdr(map[string]string{"X-A": secret + "${e2b.nope}"})}},
		{EgressProxy: &EgressProxy{Address: "p.example:1", Username: secret, Password: strings.Repeat(secret, 30)}},
		{EgressProxy: &EgressProxy{Address: "p.example:1", Password: secret}},
		{EgressProxy: &EgressProxy{Address: "user:" + secret + "@p.example:1080"}},
		{EgressProxy: &EgressProxy{Address: "socks5://user:" + secret + "@p.example:1080"}},
		{EgressProxy: &EgressProxy{Address: "u:" + secret + "@p.example:0"}},
	} {
		err := s.Validate()
		if err == nil || strings.Contains(err.Error(), secret) {
			t.Errorf("Validate = %v: want an error without the secret", err)
		}
	}
}

func TestCompileRejectsInvalidDefaults(t *testing.T) {
	for _, d := range []Defaults{
		{AllowPrivate: []netipPrefix{{}}},
		{Denied: []netipPrefix{mustPrefix("10.0.0.0/8"), {}}},
	} {
		if _, err := Compile(Spec{}, d); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("Compile(%+v) = %v, want ErrInvalid", d, err)
		}
	}
}

func TestSpecJSON(t *testing.T) {
	in := `{"allow_internet_access":false,"allowOut":["1.1.1.1","*.example.com"],"denyOut":["0.0.0.0/0"],` +
		`"rules":{"api.example.com":[{"transform":{"headers":{"Authorization":"Bearer ${e2b.secrets.T}"}}}]},` +
		`"egressProxy":{"address":"proxy.example.com:1080","username":"u","password":"p"}}`
	var s Spec
	if err := json.Unmarshal([]byte(in), &s); err != nil {
		t.Fatal(err)
	}
	want := Spec{
		AllowInternetAccess: ptr(false),
		AllowOut:            []string{"1.1.1.1", "*.example.com"},
		DenyOut:             []string{"0.0.0.0/0"},
		Rules:               map[string][]Rule{"api.example.com": hdr(map[string]string{"Authorization": "Bearer ${e2b.secrets.T}"})},
		EgressProxy:         &EgressProxy{Address: "proxy.example.com:1080", Username: "u", Password: "p"},
	}
	if !reflect.DeepEqual(s, want) {
		t.Fatalf("Unmarshal = %+v, want %+v", s, want)
	}
	out, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	if string(out) != in {
		t.Errorf("Marshal =\n%s\nwant\n%s", out, in)
	}
	// Unset fields are left out, so a stored empty spec stays "{}", and
	// allow_internet_access=true survives (omitempty on a pointer).
	if out, _ := json.Marshal(Spec{}); string(out) != "{}" {
		t.Errorf("Marshal(Spec{}) = %s", out)
	}
	if out, _ := json.Marshal(Spec{AllowInternetAccess: ptr(true)}); string(out) != `{"allow_internet_access":true}` {
		t.Errorf("Marshal(true) = %s", out)
	}
}

// A Policy's Spec, Proxy and Transform results are copies: changing them
// changes nothing in the policy.
func TestPolicyIsImmutable(t *testing.T) {
	s := Spec{
		AllowInternetAccess: ptr(true),
		AllowOut:            []string{"a.com"},
		DenyOut:             []string{"10.0.0.0/8"},
		Rules:               map[string][]Rule{"a.com": hdr(map[string]string{"X-A": "1"})},
		EgressProxy:         &EgressProxy{Address: "p.example:1"},
	}
	p, err := Compile(s, Defaults{Denied: []netipPrefix{mustPrefix("198.51.100.7/32")}})
	if err != nil {
		t.Fatal(err)
	}
	// The caller's own spec changes after Compile.
	s.AllowOut[0] = "b.com"
	s.Rules["a.com"][0].Transform.Headers["X-A"] = "changed"
	*s.AllowInternetAccess = false
	got := p.Spec()
	got.AllowOut[0] = "c.com"
	got.Rules["a.com"][0].Transform.Headers["X-A"] = "changed"
	got.EgressProxy.Address = "changed:1"
	p.Proxy().Address = "changed:2"
	p.Transform("a.com").Headers["X-A"] = "changed"
	p.Defaults().Denied[0] = mustPrefix("0.0.0.0/0")

	if got := p.Spec(); got.AllowOut[0] != "a.com" || got.Rules["a.com"][0].Transform.Headers["X-A"] != "1" ||
		got.EgressProxy.Address != "p.example:1" || !*got.AllowInternetAccess {
		t.Errorf("Spec changed: %+v", got)
	}
	if tr := p.Transform("a.com"); tr.Headers["X-A"] != "1" {
		t.Errorf("Transform changed: %v", tr.Headers)
	}
	if pr := p.Proxy(); pr.Address != "p.example:1" {
		t.Errorf("Proxy changed: %v", pr.Address)
	}
	if v := p.Name("a.com"); !v.Allow {
		t.Errorf("Name(a.com) = %v", v)
	}
	if v := p.Addr(mustAddr("1.1.1.1")); !v.Allow {
		t.Errorf("Addr(1.1.1.1) = %v", v)
	}
	if d := p.Defaults(); d.Denied[0] != mustPrefix("198.51.100.7/32") {
		t.Errorf("Defaults changed: %v", d.Denied)
	}
}
