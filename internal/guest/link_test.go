package guest

import (
	"bufio"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/testenv"
)

// inNewNetns runs fn on a locked thread in a new network namespace,
// which goes with fn's files; the thread then goes back to its own (or,
// failing that, stays locked and ends).
func inNewNetns(t *testing.T, fn func() error) error {
	t.Helper()
	testenv.RequireRoot(t, "creates network namespaces")
	errc := make(chan error, 1)
	go func() { errc <- inNewNetnsOnThisThread(fn) }() // sends once its thread is back
	return <-errc
}

func inNewNetnsOnThisThread(fn func() error) error {
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer unix.Close(orig)
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("unshare: %w", err)
	}
	defer func() {
		if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		}
	}()
	return fn()
}

// newTap creates a tap named name with mac in the calling thread's
// network namespace; the device lives while the returned file is open.
func newTap(name string, mac net.HardwareAddr) (*os.File, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, err
	}
	f := os.NewFile(uintptr(fd), name)
	if mac != nil {
		i, err := net.InterfaceByName(name)
		if err == nil {
			var nl *rtnl
			if nl, err = openNetlink(); err == nil {
				err = nl.setLink(i.Index, false, 0, mac)
				nl.close()
			}
		}
		if err != nil {
			f.Close()
			return nil, err
		}
	}
	return f, nil
}

// defaultRoutes reads the calling thread's namespace's IPv4 default
// routes as "<iface> <gateway>".
func defaultRoutes() ([]string, error) {
	f, err := os.Open("/proc/thread-self/net/route")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fl := strings.Fields(sc.Text())
		if len(fl) < 8 || fl[1] != "00000000" || fl[7] != "00000000" {
			continue
		}
		b, err := hex.DecodeString(fl[2])
		if err != nil || len(b) != 4 {
			return nil, fmt.Errorf("route line %q", sc.Text())
		}
		out = append(out, fmt.Sprintf("%s %d.%d.%d.%d", fl[0], b[3], b[2], b[1], b[0])) // host order: little endian
	}
	return out, sc.Err()
}

// linkState is what configureLink set, as seen from the namespace.
func linkState(name string) (string, error) {
	i, err := net.InterfaceByName(name)
	if err != nil {
		return "", err
	}
	addrs, err := i.Addrs()
	if err != nil {
		return "", err
	}
	var as []string
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil {
			as = append(as, a.String())
		}
	}
	slices.Sort(as)
	routes, err := defaultRoutes()
	if err != nil {
		return "", err
	}
	lo, err := net.InterfaceByName("lo")
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("up=%v lo=%v mtu=%d mac=%s addrs=%v routes=%v", i.Flags&net.FlagUp != 0, lo.Flags&net.FlagUp != 0,
		i.MTU, i.HardwareAddr, as, routes), nil
}

func TestConfigureLink(t *testing.T) {
	err := inNewNetns(t, func() error {
		tap, err := newTap("eth0", net.HardwareAddr{0x02, 0x53, 0x50, 0, 0, 0xff})
		if err != nil {
			return err
		}
		defer tap.Close()
		// A template's NIC: another MAC than the activation's. It is given
		// the wanted one.
		n := &NetworkConfig{Address: "10.201.0.6/30", Gateway: "10.201.0.5", DNS: "10.201.0.5", MAC: "02:53:50:00:00:01", MTU: 1400}
		for range 2 { // idempotent
			if err := configureLink(n); err != nil {
				return err
			}
		}
		want := "up=true lo=true mtu=1400 mac=02:53:50:00:00:01 addrs=[10.201.0.6/30] routes=[eth0 10.201.0.5]"
		if got, err := linkState("eth0"); err != nil || got != want {
			return fmt.Errorf("after the first activation: %s, %v; want %s", got, err, want)
		}
		// A neighbour entry of the gateway (another worker's tap, as after
		// a restore) does not survive an activation.
		if err := addNeighbour("eth0", "10.201.0.5", net.HardwareAddr{0x02, 0xee, 0, 0, 0, 1}); err != nil {
			return err
		}
		if arp, _ := os.ReadFile("/proc/thread-self/net/arp"); !strings.Contains(string(arp), "02:ee:00:00:00:01") {
			return fmt.Errorf("test neighbour not added: %s", arp)
		}
		if err := configureLink(n); err != nil {
			return err
		}
		if arp, _ := os.ReadFile("/proc/thread-self/net/arp"); strings.Contains(string(arp), "02:ee:00:00:00:01") {
			return fmt.Errorf("stale neighbour kept: %s", arp)
		}

		// A move: new address and gateway, the old ones go.
		n2 := &NetworkConfig{Address: "10.201.0.10/30", Gateway: "10.201.0.9", DNS: "10.201.0.9", MAC: "02:53:50:00:00:02"}
		if err := configureLink(n2); err != nil {
			return err
		}
		want = "up=true lo=true mtu=1400 mac=02:53:50:00:00:02 addrs=[10.201.0.10/30] routes=[eth0 10.201.0.9]"
		if got, err := linkState("eth0"); err != nil || got != want {
			return fmt.Errorf("after the move: %s, %v; want %s", got, err, want)
		}

		// A move within the same subnet: the new address is not lost with
		// the old one (a secondary goes with its primary).
		n5 := &NetworkConfig{Address: "10.201.0.9/30", Gateway: "10.201.0.10", DNS: "10.201.0.10", MAC: "02:53:50:00:00:02"}
		if err := configureLink(n5); err != nil {
			return err
		}
		want = "up=true lo=true mtu=1400 mac=02:53:50:00:00:02 addrs=[10.201.0.9/30] routes=[eth0 10.201.0.10]"
		if got, err := linkState("eth0"); err != nil || got != want {
			return fmt.Errorf("after a move in the subnet: %s, %v; want %s", got, err, want)
		}
		if err := configureLink(n2); err != nil {
			return err
		}

		// Two Ethernet NICs and none with the MAC: which one is not
		// guessed.
		tap2, err := newTap("eth1", nil)
		if err != nil {
			return err
		}
		defer tap2.Close()
		n3 := *n2
		n3.MAC = "02:53:50:00:00:03"
		if err := configureLink(&n3); err == nil || !strings.Contains(err.Error(), "2 Ethernet interfaces") {
			return fmt.Errorf("two NICs, no MAC match: err = %v", err)
		}
		// With the MAC it finds its NIC among several.
		if err := configureLink(n2); err != nil {
			return fmt.Errorf("two NICs, MAC match: %w", err)
		}
		// An unreachable gateway is an error, not a silent half-setup.
		n4 := *n2
		n4.Gateway = "10.9.9.9"
		if err := configureLink(&n4); err == nil {
			return fmt.Errorf("gateway off link accepted")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestConfigureLinkNoNIC(t *testing.T) {
	err := inNewNetns(t, func() error {
		n := &NetworkConfig{Address: "10.201.0.6/30", Gateway: "10.201.0.5", DNS: "10.201.0.5", MAC: "02:53:50:00:00:01"}
		if err := configureLink(n); err == nil || !strings.Contains(err.Error(), "0 Ethernet interfaces") {
			return fmt.Errorf("no NIC: err = %v", err)
		}
		// lo came up all the same.
		if lo, err := net.InterfaceByName("lo"); err != nil || lo.Flags&net.FlagUp == 0 {
			return fmt.Errorf("lo: %v %v", lo, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestNetlinkAttrPadding(t *testing.T) {
	b := attr(nil, 3, []byte("abcde"))
	if len(b) != 12 || b[0] != 9 || b[2] != 3 || string(b[4:9]) != "abcde" {
		t.Fatalf("attr = %v", b)
	}
}

// addNeighbour adds a reachable (not permanent) ARP entry.
func addNeighbour(ifname, ip string, mac net.HardwareAddr) error {
	i, err := net.InterfaceByName(ifname)
	if err != nil {
		return err
	}
	nl, err := openNetlink()
	if err != nil {
		return err
	}
	defer nl.close()
	// struct ndmsg { u8 family, pad1; u16 pad2; s32 ifindex; u16 state; u8 flags, type; }
	b := []byte{unix.AF_INET, 0, 0, 0}
	b = binary.NativeEndian.AppendUint32(b, uint32(i.Index))
	b = binary.NativeEndian.AppendUint16(b, unix.NUD_REACHABLE)
	b = append(b, 0, 0)
	b = attr(b, unix.NDA_DST, net.ParseIP(ip).To4())
	b = attr(b, unix.NDA_LLADDR, mac)
	return nl.do(unix.RTM_NEWNEIGH, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, b)
}
