package sbxnet

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// ListenTCP makes the proxy's listener inside the egress netns, on
// 0.0.0.0:ProxyPort.
func (n *Net) ListenTCP() (*net.TCPListener, error) {
	if err := n.enter(); err != nil {
		return nil, err
	}
	defer n.leave()
	var ln *net.TCPListener
	err := inNetns(n.ns, func() error {
		var err error
		ln, err = net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4zero, Port: int(n.cfg.ProxyPort)})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("sbxnet: proxy listener: %w", err)
	}
	return ln, nil
}

// ListenDNS makes the resolver's sockets inside the egress netns, UDP and
// TCP on 0.0.0.0:DNSPort. The UDP socket has IP_PKTINFO on: a packet's
// destination (its link's gateway) names the sandbox that sent it.
func (n *Net) ListenDNS() (*net.UDPConn, *net.TCPListener, error) {
	if err := n.enter(); err != nil {
		return nil, nil, err
	}
	defer n.leave()
	var (
		uc *net.UDPConn
		ln *net.TCPListener
	)
	err := inNetns(n.ns, func() error {
		var err error
		addr := &net.UDPAddr{IP: net.IPv4zero, Port: int(n.cfg.DNSPort)}
		if uc, err = net.ListenUDP("udp4", addr); err != nil {
			return err
		}
		if ln, err = net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4zero, Port: int(n.cfg.DNSPort)}); err != nil {
			uc.Close()
			return err
		}
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("sbxnet: dns listeners: %w", err)
	}
	if err := setPktinfo(uc); err != nil {
		uc.Close()
		ln.Close()
		return nil, nil, err
	}
	return uc, ln, nil
}

func setPktinfo(uc *net.UDPConn) error {
	rc, err := uc.SyscallConn()
	if err != nil {
		return fmt.Errorf("sbxnet: pktinfo: %w", err)
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_PKTINFO, 1)
	}); err != nil {
		return fmt.Errorf("sbxnet: pktinfo: %w", err)
	}
	if serr != nil {
		return fmt.Errorf("sbxnet: pktinfo: %w", serr)
	}
	return nil
}
