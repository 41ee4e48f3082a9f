// Package vmchantest provides test doubles for code that speaks vmchan
// over a virtio-serial port: a fake port whose host side can be attached,
// detached and swapped, and a socketpair helper. Tests only.
package vmchantest

import (
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Socketpair returns two connected stream sockets.
func Socketpair(t testing.TB) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conv := func(fd int) net.Conn {
		f := os.NewFile(uintptr(fd), "sp")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	return conv(fds[0]), conv(fds[1])
}

// Port emulates a virtio-serial port in the guest: reads return io.EOF
// while no host is connected, writes are dropped then; the host side can
// be swapped without the guest noticing (as after a VM restore).
type Port struct {
	mu     sync.Mutex
	cur    net.Conn
	closed bool
}

func (p *Port) conn() net.Conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cur
}

// Attach connects a new host; the old connection is closed.
func (p *Port) Attach(c net.Conn) {
	p.mu.Lock()
	old := p.cur
	p.cur = c
	p.mu.Unlock()
	if old != nil {
		old.Close()
	}
}

func (p *Port) Read(b []byte) (int, error) {
	c := p.conn()
	if c == nil {
		if p.isClosed() {
			return 0, net.ErrClosed
		}
		return 0, io.EOF
	}
	n, err := c.Read(b)
	if err != nil && p.conn() != c {
		return n, nil // swapped: the next read goes to the new host
	}
	if err != nil && !p.isClosed() {
		return n, io.EOF
	}
	return n, err
}

func (p *Port) Write(b []byte) (int, error) {
	c := p.conn()
	if c == nil {
		return len(b), nil
	}
	n, err := c.Write(b)
	if err != nil && !p.isClosed() && !errors.Is(err, os.ErrDeadlineExceeded) {
		return len(b), nil // dropped, like virtio-serial without a host
	}
	return n, err
}

func (p *Port) SetWriteDeadline(t time.Time) error {
	if c := p.conn(); c != nil {
		return c.SetWriteDeadline(t)
	}
	return nil
}

func (p *Port) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

func (p *Port) Close() error {
	p.mu.Lock()
	p.closed = true
	c := p.cur
	p.cur = nil
	p.mu.Unlock()
	if c != nil {
		c.Close()
	}
	return nil
}
