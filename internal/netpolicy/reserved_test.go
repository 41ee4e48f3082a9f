package netpolicy

import (
	"net/netip"
	"testing"
)

func TestReserved(t *testing.T) {
	var none Defaults
	opened := Defaults{AllowPrivate: []netip.Prefix{
		mustPrefix("10.1.0.0/16"), mustPrefix("fd00:1::/32"), mustPrefix("::ffff:192.168.7.0/120"),
		// An operator who opens "everything" still opens only private ranges.
		mustPrefix("0.0.0.0/0"), mustPrefix("::/0"),
	}}
	narrow := Defaults{AllowPrivate: []netip.Prefix{mustPrefix("10.1.0.0/16"), mustPrefix("fd00:1::/32"), mustPrefix("::ffff:192.168.7.0/120")}}
	denied := Defaults{
		AllowPrivate: []netip.Prefix{mustPrefix("10.0.0.0/8")},
		Denied:       []netip.Prefix{mustPrefix("203.0.113.0/28"), mustPrefix("10.9.0.0/16"), mustPrefix("2001:db8:5::/48"), mustPrefix("::ffff:198.51.100.9/128")},
	}
	for _, tc := range []struct {
		ip   string
		d    Defaults
		want bool
	}{
		// IPv4 always reserved.
		{"0.0.0.0", none, true},
		{"0.1.2.3", none, true},
		{"127.0.0.1", none, true},
		{"127.255.255.254", none, true},
		{"169.254.169.254", none, true},
		{"169.254.0.1", none, true},
		{"192.0.0.8", none, true},
		{"224.0.0.1", none, true},
		{"239.255.255.250", none, true},
		{"240.0.0.1", none, true},
		{"255.255.255.255", none, true},
		// Private ranges, reserved unless opened.
		{"10.0.0.1", none, true},
		{"172.16.0.1", none, true},
		{"172.31.255.255", none, true},
		{"192.168.1.1", none, true},
		{"100.64.0.1", none, true},
		{"100.127.255.255", none, true},
		// The internet and the documentation/benchmark ranges are not.
		{"1.1.1.1", none, false},
		{"8.8.8.8", none, false},
		{"172.15.255.255", none, false},
		{"172.32.0.0", none, false},
		{"100.63.255.255", none, false},
		{"100.128.0.0", none, false},
		{"169.253.255.255", none, false},
		{"192.0.1.1", none, false},
		{"192.0.2.1", none, false},
		{"198.51.100.1", none, false},
		{"203.0.113.1", none, false},
		{"198.18.0.1", none, false},
		{"198.19.255.255", none, false},
		{"223.255.255.255", none, false},
		// IPv6.
		{"::", none, true},
		{"::1", none, true},
		{"::127.0.0.1", none, true}, // deprecated IPv4-compatible
		{"fe80::1", none, true},
		{"fe80::1%eth0", none, true},
		{"febf::1", none, true},
		{"fec0::1", none, true},
		{"ff02::1", none, true},
		{"fc00::1", none, true},
		{"fd12:3456::1", none, true},
		{"2606:4700:4700::1111", none, false},
		{"2001:db8::1", none, false},
		// IPv4-mapped: unmapped first.
		{"::ffff:169.254.169.254", none, true},
		{"::ffff:127.0.0.1", none, true},
		{"::ffff:10.0.0.1", none, true},
		{"::ffff:0.0.0.0", none, true},
		{"::ffff:1.1.1.1", none, false},
		// NAT64 and other IPv6 forms embedding an IPv4 address.
		{"64:ff9b::169.254.169.254", none, true},
		{"64:ff9b::a9fe:a9fe", none, true},
		{"64:ff9b::127.0.0.1", none, true},
		{"64:ff9b::10.0.0.1", none, true},
		{"64:ff9b::1.1.1.1", none, false},
		{"64:ff9b:1::1.1.1.1", none, true}, // local-use NAT64
		{"::ffff:0:169.254.169.254", none, true},
		{"::ffff:0:1.1.1.1", none, false},
		{"2002:a9fe:a9fe::1", none, true}, // 6to4 of 169.254.169.254
		{"2002:7f00:1::1", none, true},
		{"2002:101:101::1", none, false},
		{"2001:0:a9fe:a9fe::1", none, true},           // Teredo server 169.254.169.254
		{"2001:0:101:101:0:0:f5fe:f5fe", none, true},  // Teredo client 10.1.10.1 (inverted)
		{"2001:0:101:101:0:0:fefe:fefe", none, false}, // Teredo 1.1.1.1 / 1.1.1.1
		{"2001:4860::8888", none, false},
		// AllowPrivate opens only what it covers.
		{"10.1.2.3", narrow, false},
		{"::ffff:10.1.2.3", narrow, false},
		{"64:ff9b::10.1.2.3", narrow, false},
		{"10.2.0.1", narrow, true},
		{"192.168.7.9", narrow, false}, // opened by a mapped prefix
		{"192.168.8.9", narrow, true},
		{"fd00:1::5", narrow, false},
		{"fd00:2::5", narrow, true},
		{"172.16.0.1", narrow, true},
		// ... and never what is not private, even when it lists everything.
		{"127.0.0.1", opened, true},
		{"169.254.169.254", opened, true},
		{"::ffff:169.254.169.254", opened, true},
		{"64:ff9b::169.254.169.254", opened, true},
		{"::1", opened, true},
		{"fe80::1", opened, true},
		{"224.0.0.1", opened, true},
		{"172.20.0.1", opened, false},
		{"fc00::1", opened, false},
		// Denied wins over AllowPrivate and applies to every form.
		{"10.1.0.1", denied, false},
		{"10.9.0.1", denied, true},
		{"::ffff:10.9.0.1", denied, true},
		{"64:ff9b::10.9.0.1", denied, true},
		{"203.0.113.5", denied, true},
		{"203.0.113.16", denied, false},
		{"2001:db8:5::1", denied, true},
		{"2001:db8:6::1", denied, false},
		{"198.51.100.9", denied, true}, // denied by a mapped prefix
		{"198.51.100.10", denied, false},
	} {
		if got := tc.d.Reserved(netip.MustParseAddr(tc.ip)); got != tc.want {
			t.Errorf("%+v.Reserved(%s) = %v, want %v", tc.d, tc.ip, got, tc.want)
		}
	}
	if !none.Reserved(netip.Addr{}) {
		t.Error("the zero Addr is not reserved")
	}
}

type fixedSet map[netip.Addr]bool

func (f fixedSet) Contains(a netip.Addr) bool { return f[a] }

// Defaults.Host is always denied, in every form that embeds the address,
// and carried into compiled policies.
func TestReservedHost(t *testing.T) {
	host := fixedSet{netip.MustParseAddr("198.51.100.7"): true, netip.MustParseAddr("2001:db8::7"): true}
	d := Defaults{Allow: true, Host: host}
	for _, a := range []string{"198.51.100.7", "::ffff:198.51.100.7", "64:ff9b::c633:6407", "2002:c633:6407::1", "2001:db8::7"} {
		if !d.Reserved(netip.MustParseAddr(a)) {
			t.Errorf("%s not reserved though it is the host's", a)
		}
	}
	if d.Reserved(netip.MustParseAddr("198.51.100.8")) {
		t.Error("198.51.100.8 reserved though the host does not have it")
	}
	p, err := Compile(Spec{AllowOut: []string{"198.51.100.0/24"}}, d)
	if err != nil {
		t.Fatal(err)
	}
	if v := p.Addr(netip.MustParseAddr("198.51.100.7")); v.Allow || v.Reason != "reserved" {
		t.Errorf("a compiled policy allowing the host's range: %+v", v)
	}
	if p.Defaults().Host == nil {
		t.Error("Policy.Defaults dropped Host")
	}
}
