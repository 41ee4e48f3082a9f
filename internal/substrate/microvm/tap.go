//go:build linux

package microvm

import (
	"fmt"
	"net"
	"os"
	"runtime"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
)

// The NIC (see the package doc, "The network"). Every VM has the same
// one, a virtio-net device, whatever its backend: a template's saved
// state must load into its clones and a saved state into its restore,
// and QEMU checks the device set, not the backends (netdevs are not part
// of the migrated state). The backend is Spec.Network.Tap when given.
// Otherwise, when the substrate runs as root, it is a tap of its own in a
// network namespace of its own where nothing else lives (the frames the
// guest sends go nowhere); without root, where no namespace can be made,
// the NIC has no backend at all (QEMU drops its frames) — what the guest
// sees is the same device either way.
//
// The guest negotiates its virtio-net features with the backend once,
// at boot, and the features travel with the state: a backend with a
// virtio-net header (IFF_VNET_HDR) offers offloads a backend without one
// cannot honour, so a clone of a template booted on one could not load
// on the other. Every backend is therefore a plain IFF_TAP|IFF_NO_PI
// tap, and a Spec.Network.Tap with any other flags is refused (as far
// as TUNGETIFF tells: kernels 6.x report IFF_NO_PI whatever was set).

// defaultMAC is the NIC's MAC when Spec.Network gives none (templates,
// sandboxes without egress): locally administered, unicast. The guest
// agent gives its NIC the activation's MAC (a clone keeps its template's
// MAC, which is part of the migrated state).
var defaultMAC = net.HardwareAddr{0x02, 0x53, 0x50, 0x41, 0x43, 0x45} // "\x02SPACE"

// netdevID is the NIC's backend id on QEMU's command line.
const netdevID = "n0"

// tunDevice is the tun/tap clone device.
const tunDevice = "/dev/net/tun"

// checkMAC accepts a unicast Ethernet address.
func checkMAC(mac net.HardwareAddr) error {
	if len(mac) != 6 {
		return fmt.Errorf("microvm: network: MAC %q is not an Ethernet address: %w", mac, errdefs.ErrInvalid)
	}
	if mac[0]&1 != 0 {
		return fmt.Errorf("microvm: network: MAC %s is a multicast address: %w", mac, errdefs.ErrInvalid)
	}
	return nil
}

// checkNetwork validates a Spec.Network: a tap that is one (IFF_TAP,
// IFF_NO_PI, no IFF_VNET_HDR, see above) and a unicast MAC when set.
func checkNetwork(n *substrate.Network) error {
	if n == nil {
		return nil
	}
	if n.Tap == nil {
		return fmt.Errorf("microvm: network: no tap device: %w", errdefs.ErrInvalid)
	}
	if n.MAC != nil {
		if err := checkMAC(n.MAC); err != nil {
			return err
		}
	}
	flags, err := tapFlags(n.Tap)
	if err != nil {
		return fmt.Errorf("microvm: network: %s is not a tun/tap device: %w: %w", n.Tap.Name(), errdefs.ErrInvalid, err)
	}
	const want = unix.IFF_TAP | unix.IFF_NO_PI
	if flags&(unix.IFF_TUN|unix.IFF_TAP|unix.IFF_NO_PI|unix.IFF_VNET_HDR|unix.IFF_MULTI_QUEUE) != want {
		return fmt.Errorf("microvm: network: device flags %#x, want exactly IFF_TAP|IFF_NO_PI (no vnet header, one queue): %w", flags, errdefs.ErrInvalid)
	}
	return nil
}

// tapFlags returns the tun/tap flags of the device f is attached to.
func tapFlags(f *os.File) (uint16, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	ifr, err := unix.NewIfreq("")
	if err != nil {
		return 0, err
	}
	var ierr error
	if err := rc.Control(func(fd uintptr) { ierr = unix.IoctlIfreq(int(fd), unix.TUNGETIFF, ifr) }); err != nil {
		return 0, err
	}
	if ierr != nil {
		return 0, ierr
	}
	return ifr.Uint16(), nil
}

// throwawayTap returns a tap device in a new network namespace of its
// own, made on a locked thread that goes back to its namespace afterwards
// (the new one is reachable through nothing but the tap, which keeps it,
// and the device, alive while the file, or QEMU's copy of it, is open).
func throwawayTap() (*os.File, error) {
	f, err := tapInNewNetns(unix.IFF_TAP | unix.IFF_NO_PI)
	if err != nil {
		return nil, fmt.Errorf("microvm: throwaway tap: %w", err)
	}
	return f, nil
}

// tapInNewNetns makes a tun/tap device with flags, "tap0", in a new
// network namespace (see throwawayTap), on a goroutine of its own so
// that the thread it locks is not the caller's.
func tapInNewNetns(flags uint16) (*os.File, error) {
	type result struct {
		f   *os.File
		err error
	}
	c := make(chan result, 1)
	go func() { // sends once the thread is back (or locked for good)
		f, err := tapOnThisThread(flags)
		c <- result{f, err}
	}()
	r := <-c
	return r.f, r.err
}

// tapOnThisThread locks the calling goroutine's thread, moves it into a
// new network namespace, makes the tap there and moves it back. It stays
// locked when it cannot go back: the runtime then ends the thread with
// the goroutine (or, the main thread, parks it for good), so no other
// goroutine ever runs in the new namespace.
func tapOnThisThread(flags uint16) (f *os.File, err error) {
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("network namespace: %w", err)
	}
	defer unix.Close(orig)
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("new network namespace: %w", err)
	}
	defer func() {
		if serr := unix.Setns(orig, unix.CLONE_NEWNET); serr == nil {
			runtime.UnlockOSThread()
		} else if err == nil {
			f.Close()
			f, err = nil, fmt.Errorf("back to the network namespace: %w", serr)
		}
	}()
	fd, err := unix.Open(tunDevice, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	ifr, err := unix.NewIfreq("tap0")
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	ifr.SetUint16(flags)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("TUNSETIFF: %w", err)
	}
	return os.NewFile(uintptr(fd), "throwaway-tap"), nil
}

// nicFor returns the NIC's backend and MAC for spec: Spec.Network's tap
// (not owned: own is false), else a throwaway tap (owned) as root, else
// none (nil).
func (s *Substrate) nicFor(n *substrate.Network) (tap *os.File, own bool, mac net.HardwareAddr, err error) {
	if n != nil {
		mac = n.MAC
		if mac == nil {
			mac = defaultMAC
		}
		return n.Tap, false, mac, nil
	}
	if !s.asRoot {
		return nil, false, defaultMAC, nil
	}
	tap, err = throwawayTap()
	if err != nil {
		return nil, false, nil, err
	}
	return tap, true, defaultMAC, nil
}
