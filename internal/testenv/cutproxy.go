package testenv

import (
	"io"
	"net"
	"sync"
	"testing"
)

// CutProxy is a loopback TCP proxy to one address that a test can cut
// (every connection through it is closed, and new ones are closed as soon
// as they are accepted) and heal: a network partition between a client
// and a server in one process (a worker and etcd, say).
type CutProxy struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]bool
	wg    sync.WaitGroup
}

// NewCutProxy listens on 127.0.0.1 and forwards to target until the test
// ends.
func NewCutProxy(t testing.TB, target string) *CutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &CutProxy{ln: ln, target: target, conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

// Addr is the proxy's host:port.
func (p *CutProxy) Addr() string { return p.ln.Addr().String() }

// Cut closes every connection through the proxy and refuses new ones
// until Heal.
func (p *CutProxy) Cut() {
	p.mu.Lock()
	p.cut = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
}

// Heal forwards new connections again.
func (p *CutProxy) Heal() {
	p.mu.Lock()
	p.cut = false
	p.mu.Unlock()
}

func (p *CutProxy) close() {
	p.ln.Close()
	p.Cut()
	p.wg.Wait()
}

// track adds c to the open connections unless the proxy is cut.
func (p *CutProxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut {
		return false
	}
	for _, c := range cs {
		p.conns[c] = true
	}
	return true
}

func (p *CutProxy) untrack(cs ...net.Conn) {
	p.mu.Lock()
	for _, c := range cs {
		delete(p.conns, c)
		c.Close()
	}
	p.mu.Unlock()
}

func (p *CutProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.mu.Lock()
			cut := p.cut
			p.mu.Unlock()
			if cut {
				c.Close()
				return
			}
			u, err := net.Dial("tcp", p.target)
			if err != nil {
				c.Close()
				return
			}
			if !p.track(c, u) {
				c.Close()
				u.Close()
				return
			}
			done := make(chan struct{}, 2)
			go func() { io.Copy(u, c); done <- struct{}{} }()
			go func() { io.Copy(c, u); done <- struct{}{} }()
			<-done
			p.untrack(c, u)
			<-done
		}()
	}
}
