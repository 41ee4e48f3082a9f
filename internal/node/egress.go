package node

import (
	"context"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/egress"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/hostaddr"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/netpolicy"
	"github.com/spacesbx/space/internal/sbxmanager"
	"github.com/spacesbx/space/internal/sbxnet"
)

// Egress modes (EgressConfig.Mode).
const (
	// EgressDeny: a sandbox has a link, but nothing gets out unless its
	// network options open it (allowInternetAccess, allowOut). The default.
	EgressDeny = "deny"
	// EgressAllow: a sandbox without network options reaches the internet
	// (E2B's default); options restrict it.
	EgressAllow = "allow"
	// EgressOff: no links at all (loopback only, whatever the options
	// say); for hosts without nftables.
	EgressOff = "off"
)

// EgressConfig is the workers' egress (their links, proxy and resolver).
type EgressConfig struct {
	// Mode is EgressDeny (default), EgressAllow or EgressOff.
	Mode string
	// Pool is each worker's link address pool (default
	// sbxnet.DefaultPool, 10.201.0.0/16): one /30 per sandbox. Every worker has an
	// egress network namespace of its own, so workers share the default.
	Pool netip.Prefix
	// Upstreams are the DNS servers the workers' resolvers ask (default:
	// the host's /etc/resolv.conf).
	Upstreams []netip.AddrPort
	// AllowPrivate are private ranges sandboxes may reach when their
	// policy allows (default none: 10/8, 172.16/12, 192.168/16,
	// 100.64/10 and fc00::/7 are always denied).
	AllowPrivate []netip.Prefix
	// Deny are further ranges no sandbox may reach, whatever its policy
	// (e.g. the control plane's hosts on a cluster). The host's own
	// addresses and the link pool are always denied.
	Deny []netip.Prefix
	// UpstreamCAFile, when set, is a PEM bundle of extra roots the
	// proxy trusts when it intercepts TLS for network.rules (besides the
	// system's).
	UpstreamCAFile string
}

// EgressFlags registers the egress flags of `space up` and space-node on
// fs; call Resolve on the result after fs.Parse.
func EgressFlags(fs *flag.FlagSet) *EgressFlagValues {
	v := &EgressFlagValues{}
	fs.StringVar(&v.mode, "egress", EgressDeny, "sandboxes' network default: deny (nothing gets out unless a sandbox's network options open it), allow (E2B's default: out unless restricted), or off (loopback only, no links)")
	fs.StringVar(&v.pool, "egress-pool", "", "link address pool of each worker's sandboxes, one /30 each (default 10.201.0.0/16)")
	fs.StringVar(&v.dns, "egress-dns", "", "comma-separated DNS servers (ip or ip:port) the sandboxes' resolver asks (default: /etc/resolv.conf)")
	fs.StringVar(&v.allowPrivate, "egress-allow-private", "", "comma-separated private CIDRs sandboxes may reach when their policy allows (default none)")
	fs.StringVar(&v.deny, "egress-deny", "", "comma-separated CIDRs no sandbox may reach, whatever its policy")
	fs.StringVar(&v.caFile, "egress-upstream-ca", "", "PEM file of extra roots trusted for upstream TLS when network.rules intercept HTTPS")
	return v
}

// EgressFlagValues are the raw egress flags.
type EgressFlagValues struct {
	mode, pool, dns, allowPrivate, deny, caFile string
}

// Resolve parses the flags into an EgressConfig.
func (v *EgressFlagValues) Resolve() (EgressConfig, error) {
	c := EgressConfig{Mode: v.mode, UpstreamCAFile: v.caFile}
	var err error
	if v.pool != "" {
		if c.Pool, err = netip.ParsePrefix(v.pool); err != nil {
			return c, fmt.Errorf("--egress-pool: %w", err)
		}
	}
	for _, s := range splitList(v.dns) {
		ap, err := netip.ParseAddrPort(s)
		if err != nil {
			a, aerr := netip.ParseAddr(s)
			if aerr != nil {
				return c, fmt.Errorf("--egress-dns %q: want ip or ip:port", s)
			}
			ap = netip.AddrPortFrom(a, 53)
		}
		c.Upstreams = append(c.Upstreams, ap)
	}
	for _, pair := range []struct {
		flag string
		in   string
		out  *[]netip.Prefix
	}{{"--egress-allow-private", v.allowPrivate, &c.AllowPrivate}, {"--egress-deny", v.deny, &c.Deny}} {
		for _, s := range splitList(pair.in) {
			p, err := netip.ParsePrefix(s)
			if err != nil {
				a, aerr := netip.ParseAddr(s)
				if aerr != nil {
					return c, fmt.Errorf("%s %q: want a CIDR", pair.flag, s)
				}
				p = netip.PrefixFrom(a, a.BitLen())
			}
			*pair.out = append(*pair.out, p.Masked())
		}
	}
	return c, c.Validate()
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// Validate checks c.
func (c EgressConfig) Validate() error {
	switch c.Mode {
	case "", EgressDeny, EgressAllow, EgressOff:
	default:
		return fmt.Errorf("node: %w: egress mode %q: want deny, allow or off", errdefs.ErrInvalid, c.Mode)
	}
	return nil
}

// workerEgress is one worker's egress: its links (sbxnet), its proxy and
// resolver (egress), serving on sockets inside the worker's egress
// network namespace. It implements sbxmanager.Egress; the worker runs
// and closes it.
type workerEgress struct {
	net *sbxnet.Net
	// netnsPath is the egress namespace's bind mount (NetnsPath).
	netnsPath string
	proxy     *egress.Proxy
	host      *hostaddr.Watcher
	defaults  netpolicy.Defaults
	resolver  netip.Addr
	tcp       *net.TCPListener
	udp       *net.UDPConn
	dnsTCP    *net.TCPListener
	log       *slog.Logger
	closeMu   sync.Mutex
	closed    bool
}

// newWorkerEgress opens worker workerID's egress namespace (kept under
// stateDir across restarts, with its sandboxes' links) and its proxy.
func newWorkerEgress(c EgressConfig, stateDir string, reg prometheus.Registerer, aud func(sbxmanager.EgressDenial), log *slog.Logger) (_ *workerEgress, err error) {
	if !c.Pool.IsValid() {
		c.Pool = sbxnet.DefaultPool
	}
	nc := sbxnet.Config{NetnsPath: filepath.Join(stateDir, "egress.netns"), Pool: c.Pool}
	n, err := sbxnet.Open(nc)
	if err != nil {
		return nil, fmt.Errorf("egress namespace: %w", err)
	}
	e := &workerEgress{net: n, netnsPath: nc.NetnsPath, log: log}
	defer func() {
		if err != nil {
			e.closeSockets()
			if e.host != nil {
				e.host.Close()
			}
			n.Close()
		}
	}()
	// Slot 0 is never handed out: its first address names the resolver
	// in every guest (any port-53 packet from a link is redirected to
	// the worker's resolver, whatever its destination).
	e.resolver = c.Pool.Addr().Next()
	denied := append([]netip.Prefix{c.Pool.Masked()}, c.Deny...)
	// The host's own addresses are followed, not listed once: an address
	// the host gains later (a new interface, DHCP, a VPN) is as much the
	// worker's as those it had at start.
	if e.host, err = hostaddr.New(hostaddr.Config{Logger: log}); err != nil {
		return nil, fmt.Errorf("egress: host addresses: %w", err)
	}
	e.defaults = netpolicy.Defaults{Allow: c.Mode == EgressAllow, AllowPrivate: c.AllowPrivate, Denied: denied, Host: e.host}
	var roots *x509.CertPool
	if c.UpstreamCAFile != "" {
		pem, err := os.ReadFile(c.UpstreamCAFile)
		if err != nil {
			return nil, fmt.Errorf("egress upstream CA: %w", err)
		}
		if roots, err = x509.SystemCertPool(); err != nil || roots == nil {
			roots = x509.NewCertPool()
		}
		if !roots.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("egress upstream CA %s: %w: no PEM certificate", c.UpstreamCAFile, errdefs.ErrInvalid)
		}
	}
	if e.tcp, err = n.ListenTCP(); err != nil {
		return nil, fmt.Errorf("egress proxy socket: %w", err)
	}
	if e.udp, e.dnsTCP, err = n.ListenDNS(); err != nil {
		return nil, fmt.Errorf("egress resolver sockets: %w", err)
	}
	e.proxy, err = egress.New(egress.Config{Defaults: e.defaults, Upstreams: c.Upstreams, RootCAs: roots,
		Registerer: reg, Logger: log, Audit: func(d egress.Denial) {
			aud(sbxmanager.EgressDenial{SandboxID: d.SandboxID, Generation: d.Generation, Kind: d.Kind, Dest: d.Dest, Name: d.Name, Reason: d.Reason})
		}})
	if err != nil {
		return nil, fmt.Errorf("egress proxy: %w", err)
	}
	return e, nil
}

func toLink(l sbxnet.Link) sbxmanager.Link {
	return sbxmanager.Link{Slot: l.Slot, Gateway: l.Gateway, Addr: l.Addr, MAC: l.MAC.String()}
}

func (e *workerEgress) AttachNetns(pid int) (sbxmanager.Link, error) {
	l, err := e.net.AttachVeth(pid)
	if err != nil {
		return sbxmanager.Link{}, err
	}
	return toLink(l), nil
}

func (e *workerEgress) AttachTap() (*os.File, sbxmanager.Link, error) {
	f, l, err := e.net.CreateTap()
	if err != nil {
		return nil, sbxmanager.Link{}, err
	}
	return f, toLink(l), nil
}

func (e *workerEgress) Apply(l sbxmanager.Link, route identity.Route, nw spacev1.Network) error {
	pol, err := netpolicy.Compile(nw.Spec, e.defaults)
	if err != nil {
		return err
	}
	return e.proxy.Set(l.Gateway, egress.Sandbox{ID: route.SandboxID, Generation: route.Generation, Policy: pol,
		CACertPEM: []byte(nw.CACert), CAKeyPEM: []byte(nw.CAKey)})
}

func (e *workerEgress) Release(l sbxmanager.Link) error {
	gw := l.Gateway
	if !gw.IsValid() {
		if sl, err := e.net.Slot(l.Slot); err == nil {
			gw = sl.Gateway
		}
	}
	if gw.IsValid() {
		e.proxy.Remove(gw)
	}
	return e.net.Release(l.Slot)
}

func (e *workerEgress) Resolver() netip.Addr { return e.resolver }

// NetnsPath is where the egress namespace is bind-mounted: netgtw dials a
// microVM's service ports there (its taps live in it).
func (e *workerEgress) NetnsPath() string { return e.netnsPath }

func (e *workerEgress) InUse() ([]int, error) { return e.net.InUse() }

// Run serves the proxy and the resolver until ctx ends.
func (e *workerEgress) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	errs := make([]error, 3)
	wg.Add(3)
	// The proxy's sockets close when ctx ends; so does the watcher.
	go func() { defer wg.Done(); errs[0] = e.proxy.ServeTCP(ctx, e.tcp, sbxnet.OriginalDst) }()
	go func() { defer wg.Done(); errs[1] = e.proxy.ServeDNS(ctx, e.udp, e.dnsTCP) }()
	go func() { defer wg.Done(); errs[2] = e.host.Run(ctx) }()
	wg.Wait()
	if ctx.Err() != nil {
		return nil
	}
	return errors.Join(errs...)
}

func (e *workerEgress) closeSockets() {
	for _, c := range []interface{ Close() error }{e.tcp, e.udp, e.dnsTCP} {
		if c != nil && !isNilCloser(c) {
			c.Close()
		}
	}
}

func isNilCloser(c interface{ Close() error }) bool {
	switch v := c.(type) {
	case *net.TCPListener:
		return v == nil
	case *net.UDPConn:
		return v == nil
	}
	return false
}

// Close stops the proxy (its connections end) and closes the sockets; the
// namespace and the sandboxes' links stay for the next start.
func (e *workerEgress) Close() error { return e.close(false) }

// Destroy is Close, and then the namespace and every link are removed:
// the worker stopped its sandboxes, nothing is left to adopt.
func (e *workerEgress) Destroy() error { return e.close(true) }

func (e *workerEgress) close(destroy bool) error {
	e.closeMu.Lock()
	defer e.closeMu.Unlock()
	if e.closed {
		return nil
	}
	e.closed = true
	err := e.proxy.Close()
	e.closeSockets()
	e.host.Close()
	if destroy {
		return errors.Join(err, e.net.Destroy())
	}
	return errors.Join(err, e.net.Close())
}
