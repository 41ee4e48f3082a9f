package sbxnet

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// soOriginalDst is SO_ORIGINAL_DST (linux/netfilter_ipv4.h), which x/sys
// does not name.
const soOriginalDst = 80

// OriginalDst returns a redirected TCP connection's original destination
// (getsockopt SO_ORIGINAL_DST, IPv4): where the sandbox meant to connect
// before the ruleset sent it to the proxy. A connection that was not
// redirected has none (ErrNotFound).
func OriginalDst(c net.Conn) (netip.AddrPort, error) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("sbxnet: original destination: %w: %T is not a socket", errdefs.ErrInvalid, c)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("sbxnet: original destination: %w", err)
	}
	var (
		mreq *unix.IPv6Mreq // 16 bytes: the size of the sockaddr_in the kernel writes
		gerr error
	)
	if err := rc.Control(func(fd uintptr) {
		mreq, gerr = unix.GetsockoptIPv6Mreq(int(fd), unix.IPPROTO_IP, soOriginalDst)
	}); err != nil {
		return netip.AddrPort{}, fmt.Errorf("sbxnet: original destination: %w", err)
	}
	if gerr != nil {
		if errors.Is(gerr, unix.ENOENT) {
			return netip.AddrPort{}, fmt.Errorf("sbxnet: original destination: %w: connection was not redirected", errdefs.ErrNotFound)
		}
		return netip.AddrPort{}, fmt.Errorf("sbxnet: original destination: %w", gerr)
	}
	return parseSockaddrIn(mreq.Multiaddr[:])
}

// parseSockaddrIn decodes a struct sockaddr_in (family in host order, port
// and address in network order).
func parseSockaddrIn(b []byte) (netip.AddrPort, error) {
	if len(b) < 8 {
		return netip.AddrPort{}, fmt.Errorf("sbxnet: original destination: %w: %d bytes", errdefs.ErrInvalid, len(b))
	}
	if fam := binary.NativeEndian.Uint16(b[0:2]); fam != unix.AF_INET {
		return netip.AddrPort{}, fmt.Errorf("sbxnet: original destination: %w: address family %d", errdefs.ErrInvalid, fam)
	}
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[4:8])), binary.BigEndian.Uint16(b[2:4])), nil
}
