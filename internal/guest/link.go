package guest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// The VM's NIC, configured over rtnetlink with x/sys/unix alone (the
// agent keeps its imports small): lo up; the NIC named by its MAC up with
// the MTU, the address (replacing any other IPv4 address an earlier
// activation gave it) and the default route via the gateway.
//
// A clone of a template, or a state restored on another worker, continues
// a guest whose NIC got its address from the machine it was booted on
// (virtio-net's MAC is part of the migrated state), so the NIC with the
// wanted MAC is often not there: the only Ethernet NIC is then the one,
// and it is given the wanted MAC first.

// configureLink applies n (validated) to the NIC of this network
// namespace.
func configureLink(n *NetworkConfig) error {
	prefix, err := netip.ParsePrefix(n.Address)
	if err != nil {
		return fmt.Errorf("network: %w", err)
	}
	gw, err := netip.ParseAddr(n.Gateway)
	if err != nil {
		return fmt.Errorf("network: %w", err)
	}
	var mac net.HardwareAddr
	if n.MAC != "" {
		if mac, err = net.ParseMAC(n.MAC); err != nil {
			return fmt.Errorf("network: %w", err)
		}
	}
	nl, err := openNetlink()
	if err != nil {
		return err
	}
	defer nl.close()
	if lo, err := net.InterfaceByName("lo"); err == nil {
		if err := nl.setLink(lo.Index, true, 0, nil); err != nil {
			return fmt.Errorf("network: lo up: %w", err)
		}
	}
	ifi, setMAC, err := findNIC(mac)
	if err != nil {
		return err
	}
	// Down first, every time: that flushes the neighbour cache, whose
	// entries a restored guest may hold for a gateway address that now
	// belongs to another worker's tap (the guest's clock, which ages
	// them, stood still while the state was saved); and the MAC changes
	// only while the link is down. The default route goes with it and is
	// added again below.
	if err := nl.setLink(ifi.Index, false, 0, nil); err != nil {
		return fmt.Errorf("network: %s down: %w", ifi.Name, err)
	}
	if setMAC {
		if err := nl.setLink(ifi.Index, false, 0, mac); err != nil {
			return fmt.Errorf("network: %s: set mac %s: %w", ifi.Name, mac, err)
		}
	}
	if err := nl.setLink(ifi.Index, true, n.MTU, nil); err != nil {
		return fmt.Errorf("network: %s up: %w", ifi.Name, err)
	}
	// Other addresses go first: added next to an old one of the same
	// subnet, the new address would be a secondary, which the kernel
	// removes with the primary.
	addrs, err := ifi.Addrs()
	if err != nil {
		return fmt.Errorf("network: %s: addresses: %w", ifi.Name, err)
	}
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok || ipn.IP.To4() == nil {
			continue
		}
		ip, _ := netip.AddrFromSlice(ipn.IP.To4())
		ones, _ := ipn.Mask.Size()
		if p := netip.PrefixFrom(ip, ones); p != prefix {
			if err := nl.addr(unix.RTM_DELADDR, ifi.Index, p); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
				return fmt.Errorf("network: %s: remove %s: %w", ifi.Name, p, err)
			}
		}
	}
	if err := nl.addr(unix.RTM_NEWADDR, ifi.Index, prefix); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("network: %s: add %s: %w", ifi.Name, prefix, err)
	}
	if err := nl.defaultRoute(ifi.Index, gw); err != nil {
		return fmt.Errorf("network: %s: default route via %s: %w", ifi.Name, gw, err)
	}
	return nil
}

// findNIC returns the interface with mac, or else the only Ethernet
// interface, with setMAC true when its MAC must change (mac nil: the only
// Ethernet interface as it is).
func findNIC(mac net.HardwareAddr) (ifi *net.Interface, setMAC bool, err error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, false, fmt.Errorf("network: interfaces: %w", err)
	}
	var ether []net.Interface
	for _, i := range ifs {
		if mac != nil && bytes.Equal(i.HardwareAddr, mac) {
			return &i, false, nil
		}
		if i.Flags&net.FlagLoopback == 0 && len(i.HardwareAddr) == 6 {
			ether = append(ether, i)
		}
	}
	if len(ether) != 1 {
		return nil, false, fmt.Errorf("network: no interface has mac %s and there are %d Ethernet interfaces, not one", mac, len(ether))
	}
	return &ether[0], mac != nil, nil
}

// rtnl is a NETLINK_ROUTE socket for requests acknowledged one by one.
type rtnl struct {
	fd  int
	seq atomic.Uint32
}

func openNetlink() (*rtnl, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("network: netlink: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("network: netlink: %w", err)
	}
	// A reply that never comes must not hang an activation.
	tv := unix.Timeval{Sec: 5}
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("network: netlink: %w", err)
	}
	return &rtnl{fd: fd}, nil
}

func (nl *rtnl) close() { unix.Close(nl.fd) }

// attr appends one rtattr (type t, payload v, padded to 4 bytes).
func attr(b []byte, t uint16, v []byte) []byte {
	l := unix.SizeofRtAttr + len(v)
	b = binary.NativeEndian.AppendUint16(b, uint16(l))
	b = binary.NativeEndian.AppendUint16(b, t)
	b = append(b, v...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// do sends one request (message type typ, flags besides REQUEST|ACK,
// body) and returns the kernel's verdict.
func (nl *rtnl) do(typ, flags uint16, body []byte) error {
	seq := nl.seq.Add(1)
	msg := make([]byte, 0, unix.SizeofNlMsghdr+len(body))
	msg = binary.NativeEndian.AppendUint32(msg, uint32(unix.SizeofNlMsghdr+len(body)))
	msg = binary.NativeEndian.AppendUint16(msg, typ)
	msg = binary.NativeEndian.AppendUint16(msg, flags|unix.NLM_F_REQUEST|unix.NLM_F_ACK)
	msg = binary.NativeEndian.AppendUint32(msg, seq)
	msg = binary.NativeEndian.AppendUint32(msg, 0)
	msg = append(msg, body...)
	if err := unix.Sendto(nl.fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 8192)
	for {
		n, _, err := unix.Recvfrom(nl.fd, buf, 0)
		if err != nil {
			if errors.Is(err, unix.EAGAIN) {
				return fmt.Errorf("netlink: no answer: %w", os.ErrDeadlineExceeded)
			}
			return err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		for _, m := range msgs {
			if m.Header.Seq != seq || m.Header.Type != unix.NLMSG_ERROR {
				continue
			}
			if len(m.Data) < 4 {
				return errors.New("netlink: short error message")
			}
			if errno := int32(binary.NativeEndian.Uint32(m.Data)); errno != 0 {
				return unix.Errno(-errno)
			}
			return nil
		}
	}
}

// setLink sets index up or down and, when given, its MTU and MAC.
func (nl *rtnl) setLink(index int, up bool, mtu int, mac net.HardwareAddr) error {
	var flags uint32
	if up {
		flags = unix.IFF_UP
	}
	// struct ifinfomsg { u8 family, pad; u16 type; s32 index; u32 flags, change; }
	b := make([]byte, 0, 64)
	b = append(b, unix.AF_UNSPEC, 0, 0, 0)
	b = binary.NativeEndian.AppendUint32(b, uint32(int32(index)))
	b = binary.NativeEndian.AppendUint32(b, flags)
	b = binary.NativeEndian.AppendUint32(b, unix.IFF_UP)
	if mtu > 0 {
		b = attr(b, unix.IFLA_MTU, binary.NativeEndian.AppendUint32(nil, uint32(mtu)))
	}
	if mac != nil {
		b = attr(b, unix.IFLA_ADDRESS, mac)
	}
	return nl.do(unix.RTM_NEWLINK, 0, b)
}

// addr adds (RTM_NEWADDR) or removes (RTM_DELADDR) an IPv4 address.
func (nl *rtnl) addr(typ uint16, index int, p netip.Prefix) error {
	// struct ifaddrmsg { u8 family, prefixlen, flags, scope; u32 index; }
	b := make([]byte, 0, 32)
	b = append(b, unix.AF_INET, byte(p.Bits()), 0, unix.RT_SCOPE_UNIVERSE)
	b = binary.NativeEndian.AppendUint32(b, uint32(index))
	a := p.Addr().AsSlice()
	b = attr(b, unix.IFA_LOCAL, a)
	b = attr(b, unix.IFA_ADDRESS, a)
	if typ == unix.RTM_NEWADDR {
		brd := p.Masked().Addr().As4()
		for i := p.Bits(); i < 32; i++ {
			brd[i/8] |= 0x80 >> (i % 8)
		}
		if p.Bits() < 31 {
			b = attr(b, unix.IFA_BROADCAST, brd[:])
		}
		return nl.do(typ, unix.NLM_F_CREATE|unix.NLM_F_EXCL, b)
	}
	return nl.do(typ, 0, b)
}

// defaultRoute makes the main table's IPv4 default route go via gw on
// index, replacing an earlier one.
func (nl *rtnl) defaultRoute(index int, gw netip.Addr) error {
	// struct rtmsg { u8 family, dst_len, src_len, tos, table, protocol, scope, type; u32 flags; }
	b := make([]byte, 0, 32)
	b = append(b, unix.AF_INET, 0, 0, 0, unix.RT_TABLE_MAIN, unix.RTPROT_BOOT, unix.RT_SCOPE_UNIVERSE, unix.RTN_UNICAST)
	b = binary.NativeEndian.AppendUint32(b, 0)
	g := gw.As4()
	b = attr(b, unix.RTA_GATEWAY, g[:])
	b = attr(b, unix.RTA_OIF, binary.NativeEndian.AppendUint32(nil, uint32(index)))
	return nl.do(unix.RTM_NEWROUTE, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, b)
}
