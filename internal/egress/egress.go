// Package egress is the worker's transparent egress proxy and DNS server:
// every TCP connection and DNS query a sandbox makes is redirected here (by
// nftables in the worker's egress network namespace), attributed to the
// sandbox by the gateway address it arrived at, and decided against the
// sandbox's netpolicy.Policy. Allowed connections are relayed (or, for TLS
// hosts with header transforms, intercepted), everything else is closed and
// reported. The package fails closed: a connection or query it cannot
// attribute, parse or decide is refused.
package egress

import (
	"bufio"
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacesbx/space/internal/egress/intercept"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/netpolicy"
)

// Config configures a Proxy. The zero value of every field but Defaults is
// usable (see each field's default).
type Config struct {
	// Defaults are the operator's settings; they decide Reserved addresses
	// whatever a sandbox's policy says.
	Defaults netpolicy.Defaults
	// Upstreams are the DNS servers the resolver asks, in order. Default:
	// the nameservers of ResolvConfPath.
	Upstreams []netip.AddrPort
	// ResolvConfPath is read when Upstreams is empty. Default /etc/resolv.conf.
	ResolvConfPath string
	// DialTimeout bounds an outbound connect. Default 10s.
	DialTimeout time.Duration
	// PeekTimeout bounds the wait for a client's first bytes (SNI / Host).
	// Default 5s.
	PeekTimeout time.Duration
	// IdleTimeout closes a relayed connection with no bytes either way for
	// that long. Default 0: none (and then Linux splices without copies).
	IdleTimeout time.Duration
	// RootCAs verify upstream servers when intercepting. nil: system roots.
	RootCAs *x509.CertPool
	// Dial replaces net.Dialer.DialContext for outbound connections (tests).
	// The default dials from the worker's own network namespace.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// Lookup replaces the DNS client for the proxy's own resolution of
	// allowed names (tests). The default asks Upstreams for A and AAAA.
	Lookup func(ctx context.Context, name string) ([]netip.Addr, error)
	// Registerer receives the metrics. nil: none registered.
	Registerer prometheus.Registerer
	// Audit is called synchronously for every denial (connections and DNS)
	// and every connection the proxy could not carry out (dial-failed,
	// resolve-failed); it is called concurrently and must not block. nil: denials are only logged and counted.
	Audit func(Denial)
	// Logger; nil: slog.Default().
	Logger *slog.Logger
}

const (
	defaultResolvConf  = "/etc/resolv.conf"
	defaultDialTimeout = 10 * time.Second
	defaultPeekTimeout = 5 * time.Second
)

// Validate checks the configuration; errors wrap errdefs.ErrInvalid.
func (c Config) Validate() error {
	if c.DialTimeout < 0 || c.PeekTimeout < 0 || c.IdleTimeout < 0 {
		return fmt.Errorf("egress: negative timeout: %w", errdefs.ErrInvalid)
	}
	for _, u := range c.Upstreams {
		if !u.IsValid() || u.Port() == 0 || u.Addr().Zone() != "" && !u.Addr().Is6() {
			return fmt.Errorf("egress: upstream %v: %w", u, errdefs.ErrInvalid)
		}
	}
	for _, set := range [][]netip.Prefix{c.Defaults.AllowPrivate, c.Defaults.Denied} {
		for _, p := range set {
			if !p.IsValid() {
				return fmt.Errorf("egress: prefix %v: %w", p, errdefs.ErrInvalid)
			}
		}
	}
	return nil
}

// Sandbox is what the proxy knows of one sandbox link.
type Sandbox struct {
	ID         string
	Generation uint64
	Policy     *netpolicy.Policy
	// CACertPEM and CAKeyPEM are the per-sandbox interception CA; empty: no
	// interception (transform rules then cannot apply: such TLS connections
	// are passed through untouched).
	CACertPEM []byte
	CAKeyPEM  []byte
}

// Denial is one refused connection or query, for the audit log.
type Denial struct {
	SandboxID  string
	Generation uint64
	Kind       string // "tcp" or "dns"
	Dest       string // "ip:port" for tcp, qname for dns
	Name       string // SNI / Host / qname when known
	Reason     string // netpolicy Verdict.Reason or a proxy reason ("unknown-sandbox", "rebinding", ...)
}

// Proxy is the transparent egress proxy and DNS server of one worker.
type Proxy struct {
	cfg       Config
	log       *slog.Logger
	m         *metrics
	upstreams []netip.AddrPort
	dialer    net.Dialer
	cache     resolveCache

	ctx    context.Context // ends at Close
	cancel context.CancelFunc

	mu      sync.Mutex
	closed  bool
	sbs     map[netip.Addr]*sandbox
	serving map[interface{ Close() error }]struct{} // listeners and sockets to close at Close
	wg      sync.WaitGroup                          // every goroutine the proxy starts
}

// sandbox is the state of one gateway address. sb and icpt are replaced by
// Set; conns holds every connection attributed to it (guarded by Proxy.mu).
type sandbox struct {
	gw      netip.Addr
	sb      Sandbox
	icpt    *intercept.Interceptor
	conns   map[*conn]struct{}
	learned *learned
}

// New makes a Proxy. Without Upstreams it reads ResolvConfPath now, so a
// worker without a resolver fails at start, not at the first query.
func New(cfg Config) (*Proxy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.ResolvConfPath == "" {
		cfg.ResolvConfPath = defaultResolvConf
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = defaultDialTimeout
	}
	if cfg.PeekTimeout == 0 {
		cfg.PeekTimeout = defaultPeekTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	ups := cfg.Upstreams
	if len(ups) == 0 {
		f, err := os.Open(cfg.ResolvConfPath)
		if err != nil {
			return nil, fmt.Errorf("egress: no upstreams and %w: %w", err, errdefs.ErrInvalid)
		}
		ups, err = parseResolvConf(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("egress: %s: %w", cfg.ResolvConfPath, err)
		}
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("egress: metrics: %w", err)
	}
	p := &Proxy{
		cfg:       cfg,
		log:       cfg.Logger.With("component", "egress"),
		m:         m,
		upstreams: ups,
		sbs:       make(map[netip.Addr]*sandbox),
		serving:   make(map[interface{ Close() error }]struct{}),
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	return p, nil
}

// parseResolvConf returns the nameservers of a resolv.conf.
func parseResolvConf(r interface{ Read([]byte) (int, error) }) ([]netip.AddrPort, error) {
	var out []netip.AddrPort
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 || f[0] != "nameserver" {
			continue
		}
		a, err := netip.ParseAddr(f[1])
		if err != nil {
			continue // glibc ignores what it cannot parse too
		}
		out = append(out, netip.AddrPortFrom(a.Unmap(), 53))
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no nameserver: %w", errdefs.ErrInvalid)
	}
	return out, nil
}

// Set installs or replaces the sandbox whose links' gateway address is gw.
// The new policy is in force for every new connection and query when Set
// returns, and live connections it denies are closed before Set returns. A
// different sandbox ID on gw replaces the sandbox: all of the old one's
// connections are closed and its DNS-learned addresses forgotten.
func (p *Proxy) Set(gw netip.Addr, sb Sandbox) error {
	gw = gw.Unmap()
	if !gw.IsValid() || sb.ID == "" || sb.Policy == nil {
		return fmt.Errorf("egress: set %v: gateway, sandbox id and policy required: %w", gw, errdefs.ErrInvalid)
	}
	p.mu.Lock()
	old := p.sbs[gw]
	p.mu.Unlock()
	var icpt *intercept.Interceptor
	if len(sb.CACertPEM) > 0 || len(sb.CAKeyPEM) > 0 {
		if old != nil && old.icpt != nil && old.sb.ID == sb.ID &&
			bytes.Equal(old.sb.CACertPEM, sb.CACertPEM) && bytes.Equal(old.sb.CAKeyPEM, sb.CAKeyPEM) {
			icpt = old.icpt // keep its leaf cache
		} else {
			var err error
			if icpt, err = intercept.New(sb.CACertPEM, sb.CAKeyPEM, p.cfg.RootCAs); err != nil {
				return fmt.Errorf("egress: set %s: interception ca: %w: %w", sb.ID, errdefs.ErrInvalid, err)
			}
		}
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("egress: set %s: proxy closed: %w", sb.ID, errdefs.ErrUnavailable)
	}
	st := p.sbs[gw]
	if st != nil && st.sb.ID != sb.ID {
		for c := range st.conns {
			c.close()
		}
		st = nil
	}
	if st == nil {
		p.sbs[gw] = &sandbox{gw: gw, sb: sb, icpt: icpt, conns: make(map[*conn]struct{}), learned: newLearned()}
		return nil
	}
	st.sb, st.icpt = sb, icpt
	cut := 0
	for c := range st.conns {
		if c.decided && !p.stillAllowedLocked(st, c) {
			c.close()
			cut++
		}
	}
	if cut > 0 {
		p.log.Info("policy update cut connections", "sandbox", sb.ID, "generation", sb.Generation, "cut", cut)
	}
	return nil
}

// Remove forgets gw and closes all of its connections.
func (p *Proxy) Remove(gw netip.Addr) {
	gw = gw.Unmap()
	p.mu.Lock()
	defer p.mu.Unlock()
	st := p.sbs[gw]
	if st == nil {
		return
	}
	delete(p.sbs, gw)
	for c := range st.conns {
		c.close()
	}
}

// Close stops every Serve, closes every connection and waits for every
// goroutine the proxy started.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		p.cancel()
		for s := range p.serving {
			s.Close()
		}
		for _, st := range p.sbs {
			for c := range st.conns {
				c.close()
			}
		}
	}
	p.mu.Unlock()
	p.wg.Wait()
	return nil
}

// goLocked starts f as a goroutine Close waits for; false once closed.
// Callers hold p.mu (so no Add races Close's Wait).
func (p *Proxy) goLocked(f func()) bool {
	if p.closed {
		return false
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		f()
	}()
	return true
}

// serve registers s to be closed at Close; false if already closed.
func (p *Proxy) serve(s interface{ Close() error }) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.serving[s] = struct{}{}
	return true
}

func (p *Proxy) unserve(s interface{ Close() error }) {
	p.mu.Lock()
	delete(p.serving, s)
	p.mu.Unlock()
}

// reservedLocked: denied whatever the policy. A sandbox's gateway counts too,
// since it is the worker itself. Caller holds p.mu.
func (p *Proxy) reservedLocked(pol *netpolicy.Policy, a netip.Addr) bool {
	a = a.Unmap()
	if !a.IsValid() || p.cfg.Defaults.Reserved(a) || pol.Defaults().Reserved(a) {
		return true
	}
	_, gw := p.sbs[a]
	return gw
}

func (p *Proxy) reserved(pol *netpolicy.Policy, a netip.Addr) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.reservedLocked(pol, a)
}

// lookupSandbox returns the current state for gw (nil: unknown).
func (p *Proxy) lookupSandbox(gw netip.Addr) (*sandbox, Sandbox, *intercept.Interceptor) {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := p.sbs[gw.Unmap()]
	if st == nil {
		return nil, Sandbox{}, nil
	}
	return st, st.sb, st.icpt
}

func (p *Proxy) deny(d Denial, metric *prometheus.CounterVec) { p.refuse(d, "deny", metric) }

// refuse counts, logs and reports one refusal; verdict "deny" is the
// policy's, "error" one the proxy could not carry out (dial, resolution).
func (p *Proxy) refuse(d Denial, verdict string, metric *prometheus.CounterVec) {
	metric.WithLabelValues(verdict, d.Reason).Inc()
	p.log.Info("egress denied", "sandbox", d.SandboxID, "generation", d.Generation, "kind", d.Kind,
		"dest", d.Dest, "name", d.Name, "reason", d.Reason)
	if p.cfg.Audit != nil {
		p.cfg.Audit(d)
	}
}

// errClosed: the proxy or the sandbox went away mid-decision.
var errClosed = errors.New("closed")
