//go:build !linux

package sbxnet

import (
	"fmt"
	"net"
	"net/netip"
	"os"

	"github.com/spacesbx/space/internal/errdefs"
)

var errNeedLinux = fmt.Errorf("sbxnet: %w: egress networking needs Linux", errdefs.ErrUnavailable)

// Net is unavailable outside Linux.
type Net struct{}

// Open fails outside Linux.
func Open(Config) (*Net, error) { return nil, errNeedLinux }

// ListenTCP fails outside Linux.
func (*Net) ListenTCP() (*net.TCPListener, error) { return nil, errNeedLinux }

// ListenDNS fails outside Linux.
func (*Net) ListenDNS() (*net.UDPConn, *net.TCPListener, error) { return nil, nil, errNeedLinux }

// AttachVeth fails outside Linux.
func (*Net) AttachVeth(int) (Link, error) { return Link{}, errNeedLinux }

// CreateTap fails outside Linux.
func (*Net) CreateTap() (*os.File, Link, error) { return nil, Link{}, errNeedLinux }

// Slot fails outside Linux.
func (*Net) Slot(int) (Link, error) { return Link{}, errNeedLinux }

// InUse fails outside Linux.
func (*Net) InUse() ([]int, error) { return nil, errNeedLinux }

// Release fails outside Linux.
func (*Net) Release(int) error { return errNeedLinux }

// Close does nothing.
func (*Net) Close() error { return nil }

// Destroy fails outside Linux.
func (*Net) Destroy() error { return errNeedLinux }

// OriginalDst fails outside Linux.
func OriginalDst(net.Conn) (netip.AddrPort, error) { return netip.AddrPort{}, errNeedLinux }
