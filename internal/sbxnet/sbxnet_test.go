package sbxnet

import (
	"errors"
	"net/netip"
	"strconv"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
)

func TestConfigValidate(t *testing.T) {
	ok := Config{NetnsPath: "/run/space/egress.netns"}
	if err := ok.Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for name, c := range map[string]Config{
		"no path":       {},
		"relative path": {NetnsPath: "egress.netns"},
		"unclean path":  {NetnsPath: "/run/../run/egress.netns"},
		"ipv6 pool":     {NetnsPath: "/x", Pool: netip.MustParsePrefix("fd00::/64")},
		"host bits":     {NetnsPath: "/x", Pool: netip.MustParsePrefix("10.201.0.1/16")},
		"pool too wide": {NetnsPath: "/x", Pool: netip.MustParsePrefix("10.0.0.0/7")},
		"pool /30":      {NetnsPath: "/x", Pool: netip.MustParsePrefix("10.201.0.0/30")},
		"same ports":    {NetnsPath: "/x", ProxyPort: 5000, DNSPort: 5000},
		"same default":  {NetnsPath: "/x", ProxyPort: DefaultDNSPort},
		"mtu too small": {NetnsPath: "/x", MTU: 67},
		"mtu too big":   {NetnsPath: "/x", MTU: 65536},
		"mtu negative":  {NetnsPath: "/x", MTU: -1},
	} {
		if err := c.Validate(); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: Validate = %v, want ErrInvalid", name, err)
		}
	}
}

func TestSlotAddresses(t *testing.T) {
	c := Config{NetnsPath: "/x"}.withDefaults()
	if got := c.maxSlot(); got != 16383 {
		t.Fatalf("maxSlot = %d, want 16383", got)
	}
	for _, tc := range []struct {
		slot     int
		name, gw string
		addr     string
		mac      string
	}{
		{1, "sx1", "10.201.0.5", "10.201.0.6/30", "02:73:00:00:00:01"},
		{2, "sx2", "10.201.0.9", "10.201.0.10/30", "02:73:00:00:00:02"},
		{300, "sx300", "10.201.4.177", "10.201.4.178/30", "02:73:00:00:01:2c"},
		{16383, "sx16383", "10.201.255.253", "10.201.255.254/30", "02:73:00:00:3f:ff"},
	} {
		l, err := c.slotLink(tc.slot)
		if err != nil {
			t.Fatalf("slot %d: %v", tc.slot, err)
		}
		if l.Slot != tc.slot || l.HostName != tc.name || l.Gateway.String() != tc.gw || l.Addr.String() != tc.addr || l.MAC.String() != tc.mac {
			t.Errorf("slot %d = %+v (mac %s)", tc.slot, l, l.MAC)
		}
		if !l.Addr.Contains(l.Gateway) || l.Addr.Masked().Addr() == l.Gateway {
			t.Errorf("slot %d: gateway %s not a host of %s", tc.slot, l.Gateway, l.Addr)
		}
		if l.MAC[0]&0x03 != 0x02 {
			t.Errorf("slot %d: MAC %s not locally administered unicast", tc.slot, l.MAC)
		}
	}
	for _, bad := range []int{-1, 0, 16384} {
		if _, err := c.slotLink(bad); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("slot %d: %v, want ErrInvalid", bad, err)
		}
	}
	small := Config{NetnsPath: "/x", Pool: netip.MustParsePrefix("192.168.7.8/29")}.withDefaults()
	if small.maxSlot() != 1 {
		t.Fatalf("/29 maxSlot = %d", small.maxSlot())
	}
	l, err := small.slotLink(1)
	if err != nil || l.Gateway != netip.MustParseAddr("192.168.7.13") {
		t.Fatalf("/29 slot 1 = %+v, %v", l, err)
	}
}

func TestParseLinkName(t *testing.T) {
	for name, want := range map[string]int{"sx1": 1, "sx16383": 16383, "sx999999999": 999999999} {
		if got, ok := parseLinkName(name); !ok || got != want {
			t.Errorf("%q = %d, %v", name, got, ok)
		}
	}
	for _, name := range []string{"", "sx", "sx0", "sx01", "sx-1", "sx+1", "sx1a", "eth0", "xs1", "sx1234567890", "sx 1", "SX1", "sx١"} {
		if got, ok := parseLinkName(name); ok {
			t.Errorf("%q parsed as %d", name, got)
		}
	}
}

func FuzzParseLinkName(f *testing.F) {
	for _, s := range []string{"sx1", "sx0", "sx01", "sx16383", "eth0", "sx-1", "sx99999999999999999999"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		i, ok := parseLinkName(name)
		if !ok {
			return
		}
		if i < 1 || LinkPrefix+strconv.Itoa(i) != name {
			t.Fatalf("%q parsed as %d", name, i)
		}
	})
}
