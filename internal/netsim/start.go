package netsim

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// testHookStart, when set (tests), runs at each stage of Start; an error
// makes Start fail there.
var testHookStart func(n *Internet, stage string) error

func runTestHook(n *Internet, stage string) error {
	if testHookStart == nil {
		return nil
	}
	return testHookStart(n, stage)
}

// closeTimeout bounds how long Close waits for servers and handlers.
const closeTimeout = 5 * time.Second

// Start creates a network namespace ("the internet") linked to the
// caller's namespace by a veth and serves in it on every host address:
// HTTP :80, HTTPS :443 (a certificate for every zone name and host
// address, signed by the Internet's own CA), TCP echo :7, discard :9
// (counts bytes), chargen :19 (writes until closed), and DNS :53 (UDP and
// TCP; also on the DNS address, .53). HTTP(S) paths: "/" answers "hello
// from <host addr>", "/echo" an EchoReply, "/bytes?n=N" N bytes, "/hold" a
// byte every HoldInterval until the client goes away. See the package doc
// for addressing. It needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root); it takes
// a few milliseconds.
func Start(opts Options) (_ *Internet, retErr error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	if opts.Hosts == 0 {
		opts.Hosts = DefaultHosts
	}
	zone := make(map[string][]netip.Addr, len(opts.Zone))
	for name, addrs := range opts.Zone {
		norm, _ := normalizeName(name) // validated
		if len(addrs) > 0 {
			zone[norm] = append(zone[norm], unmapAll(addrs)...)
		}
	}

	root, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netsim: netlink: %w", err)
	}
	n := &Internet{
		root:     root,
		zone:     zone,
		accepted: make(map[int]int),
		tcpConns: make(map[*trackedConn]struct{}),
	}
	defer func() {
		if retErr != nil {
			retErr = errors.Join(retErr, n.teardown())
		}
	}()

	// First of all: whatever happens below, no address of the range can
	// leave through the default route.
	if err := ensureUnreachable(root); err != nil {
		return nil, err
	}

	thread, nsFile, err := newNSThread()
	if err != nil {
		return nil, err
	}
	defer thread.stop()
	n.nsFile = nsFile

	k, link, err := createLink(root, nsFile)
	if err != nil {
		return nil, err
	}
	n.index, n.linkName, n.linkIndex = k, link.Attrs().Name, link.Attrs().Index
	n.prefix = subnet(k)
	n.rootAddr = addrIn(n.prefix, rootOctet)
	for i := range opts.Hosts {
		n.hosts = append(n.hosts, addrIn(n.prefix, byte(firstHostOctet+i)))
	}
	n.dnsAddr = addrIn(n.prefix, dnsOctet)
	inside := append(append([]netip.Addr(nil), n.hosts...), n.dnsAddr)

	if err := configureRoot(root, link, n.prefix); err != nil {
		return nil, err
	}
	if err := thread.run(func() error { return configureInside(n.prefix, inside) }); err != nil {
		return nil, err
	}
	if err := checkRoutes(root, n.linkIndex, inside); err != nil {
		return nil, err
	}
	if err := runTestHook(n, "link"); err != nil {
		return nil, err
	}

	if n.ca, err = newAuthority(n.linkName); err != nil {
		return nil, err
	}
	n.caPool = x509.NewCertPool()
	n.caPool.AddCert(n.ca.cert)
	if err := n.setupTLS(); err != nil {
		return nil, err
	}

	// Sockets keep the namespace they were created in: make them on the
	// namespace's thread, serve them from ordinary goroutines.
	var ls listenSet
	if err := thread.run(func() error { return ls.listen(n.hosts, n.dnsAddr) }); err != nil {
		ls.closeAll()
		return nil, err
	}
	if err := runTestHook(n, "listen"); err != nil {
		ls.closeAll()
		return nil, err
	}
	if err := n.serve(&ls); err != nil {
		return nil, err
	}
	if err := runTestHook(n, "serve"); err != nil {
		return nil, err
	}
	return n, nil
}

// listenSet holds the sockets made inside the namespace.
type listenSet struct {
	tcp    map[int][]net.Listener // by port
	dnsUDP []net.PacketConn
	dnsTCP []net.Listener
}

func (s *listenSet) listen(hosts []netip.Addr, dnsAddr netip.Addr) error {
	s.tcp = make(map[int][]net.Listener)
	for _, port := range []int{PortHTTP, PortHTTPS, PortEcho, PortDiscard, PortChargen} {
		for _, h := range hosts {
			l, err := net.Listen("tcp4", netip.AddrPortFrom(h, uint16(port)).String())
			if err != nil {
				return fmt.Errorf("netsim: listen %s:%d: %w", h, port, err)
			}
			s.tcp[port] = append(s.tcp[port], l)
		}
	}
	// DNS on the DNS address and on every host (a host is a server of
	// the internet like any: a test can check that a query sent to it
	// directly was redirected elsewhere and never arrived).
	for _, a := range append([]netip.Addr{dnsAddr}, hosts...) {
		ap := netip.AddrPortFrom(a, PortDNS).String()
		pc, err := net.ListenPacket("udp4", ap)
		if err != nil {
			return fmt.Errorf("netsim: listen udp %s: %w", ap, err)
		}
		s.dnsUDP = append(s.dnsUDP, pc)
		l, err := net.Listen("tcp4", ap)
		if err != nil {
			return fmt.Errorf("netsim: listen tcp %s: %w", ap, err)
		}
		s.dnsTCP = append(s.dnsTCP, l)
	}
	return nil
}

func (s *listenSet) closeAll() {
	for _, ls := range s.tcp {
		for _, l := range ls {
			_ = l.Close()
		}
	}
	s.closeDNS()
}

func (s *listenSet) closeDNS() {
	for _, pc := range s.dnsUDP {
		_ = pc.Close()
	}
	for _, l := range s.dnsTCP {
		_ = l.Close()
	}
}

func (n *Internet) setupTLS() error {
	// The default certificate covers every host address and the names the
	// zone had at Start; a name added later gets its own at first use.
	names := make([]string, 0, len(n.zone))
	for name := range n.zone {
		names = append(names, name)
	}
	def, err := n.ca.issue(names, n.hosts)
	if err != nil {
		return err
	}
	n.tlsCfg = &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"h2", "http/1.1"},
		GetCertificate: func(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
			name, err := normalizeName(hello.ServerName)
			if err != nil {
				return def, nil // no or odd SNI: the address certificate
			}
			if _, ok := n.lookupZone(name); !ok {
				return def, nil // not a name of this internet: the client sees a mismatch
			}
			return n.ca.forName(name)
		},
	}
	return nil
}

// serve starts every server on the sockets of ls (which it then owns).
func (n *Internet) serve(ls *listenSet) error {
	errLog := slog.NewLogLogger(slog.Default().Handler(), slog.LevelDebug)
	n.httpSrv = &http.Server{
		Handler:           n.handler(),
		ReadHeaderTimeout: 10 * time.Second,
		TLSConfig:         n.tlsCfg,
		ErrorLog:          errLog,
		ConnState: func(_ net.Conn, st http.ConnState) {
			// StateNew runs on the Serve goroutine (counted in n.wg), so
			// every Add happens before Close's Wait.
			switch st {
			case http.StateNew:
				n.httpWG.Add(1)
			case http.StateClosed, http.StateHijacked:
				n.httpWG.Done()
			}
		},
	}
	for port, lls := range ls.tcp {
		for _, l := range lls {
			cl := &countingListener{Listener: l, n: n, port: port}
			switch port {
			case PortHTTP:
				n.goServe(func() { _ = n.httpSrv.Serve(cl) })
			case PortHTTPS:
				tl := tls.NewListener(cl, n.tlsCfg)
				n.goServe(func() { _ = n.httpSrv.Serve(tl) })
			default:
				n.addListener(l)
				n.goServe(func() { n.acceptLoop(cl, tcpService(port, n)) })
			}
		}
	}

	h := dns.HandlerFunc(n.serveDNS)
	var srvs []*dns.Server
	for _, pc := range ls.dnsUDP {
		srvs = append(srvs, &dns.Server{PacketConn: pc, Handler: h, Net: "udp"})
	}
	for _, l := range ls.dnsTCP {
		srvs = append(srvs, &dns.Server{Listener: &countingListener{Listener: l, n: n, port: PortDNS}, Handler: h, Net: "tcp",
			ReadTimeout: 5 * time.Second, IdleTimeout: func() time.Duration { return 5 * time.Second }})
	}
	for _, s := range srvs {
		started := make(chan struct{})
		s.NotifyStartedFunc = func() { close(started) }
		failed := make(chan error, 1)
		n.goServe(func() {
			if err := s.ActivateAndServe(); err != nil {
				failed <- err
			}
		})
		// Shutdown refuses a server that has not started: wait for it.
		select {
		case <-started:
			n.dnsSrvs = append(n.dnsSrvs, s)
		case err := <-failed:
			ls.closeDNS() // ends the servers already started too (Close shuts them down)
			return fmt.Errorf("netsim: dns %s: %w", s.Net, err)
		}
	}
	return nil
}

func (n *Internet) goServe(fn func()) {
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		fn()
	}()
}

func (n *Internet) addListener(l closer) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.listeners = append(n.listeners, l)
}

// countingListener counts accepted connections per port.
type countingListener struct {
	net.Listener
	n    *Internet
	port int
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	n := l.n
	n.mu.Lock()
	defer n.mu.Unlock()
	n.accepted[l.port]++
	if n.closed {
		abort(c)
		return nil, net.ErrClosed
	}
	tc := &trackedConn{Conn: c, n: n}
	n.tcpConns[tc] = struct{}{}
	return tc, nil
}

// trackedConn is an accepted connection Close can reset.
type trackedConn struct {
	net.Conn
	n *Internet
}

func (c *trackedConn) Close() error {
	c.n.mu.Lock()
	delete(c.n.tcpConns, c)
	c.n.mu.Unlock()
	return c.Conn.Close()
}

// abort closes c with a reset: a plain close queues its FIN behind unsent
// data, which a client that stopped reading (chargen) never lets out, and
// once the veth is gone nothing would ever end the client's connection.
func abort(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}

// Close stops the servers (and ends their connections), removes the veth
// and lets the namespace go. The unreachable route for Range stays. Close
// is idempotent.
func (n *Internet) Close() error {
	n.closeOnce.Do(func() { n.closeErr = n.teardown() })
	return n.closeErr
}

// teardown undoes whatever part of Start happened.
func (n *Internet) teardown() error {
	var errs []error
	n.mu.Lock()
	n.closed = true
	ls := n.listeners
	n.listeners = nil
	conns := make([]*trackedConn, 0, len(n.tcpConns))
	for c := range n.tcpConns {
		conns = append(conns, c)
	}
	n.tcpConns = make(map[*trackedConn]struct{})
	n.mu.Unlock()
	// Reset every accepted connection first (the servers' own closing
	// would end them with a FIN, see abort).
	for _, c := range conns {
		abort(c.Conn)
	}

	if n.httpSrv != nil {
		if err := n.httpSrv.Close(); err != nil {
			errs = append(errs, fmt.Errorf("netsim: close http: %w", err))
		}
	}
	for _, l := range ls {
		_ = l.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	for _, s := range n.dnsSrvs {
		if err := s.ShutdownContext(ctx); err != nil {
			errs = append(errs, fmt.Errorf("netsim: shut down dns %s: %w", s.Net, err))
		}
	}
	if err := waitCtx(ctx, n.wg.Wait); err != nil {
		errs = append(errs, fmt.Errorf("netsim: servers did not stop: %w", err))
	} else if err := waitCtx(ctx, n.httpWG.Wait); err != nil {
		errs = append(errs, fmt.Errorf("netsim: http connections did not end: %w", err))
	}
	select {
	case <-n.handlers.close():
	case <-ctx.Done():
		errs = append(errs, fmt.Errorf("netsim: http handlers did not end: %w", ctx.Err()))
	}

	if n.linkName != "" {
		// Deleting one end deletes both, synchronously: the name (the /24)
		// is free again when Close returns.
		link := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: n.linkName, Index: n.linkIndex}}
		if err := n.root.LinkDel(link); err != nil && !errors.Is(err, unix.ENODEV) {
			errs = append(errs, fmt.Errorf("netsim: delete %s: %w", n.linkName, err))
		}
	}
	if n.nsFile != nil {
		if err := n.nsFile.Close(); err != nil {
			errs = append(errs, fmt.Errorf("netsim: close namespace: %w", err))
		}
	}
	if n.root != nil {
		n.root.Close()
	}
	return errors.Join(errs...)
}

// waitCtx runs wait (a WaitGroup's Wait) but gives up when ctx ends; the
// waiting goroutine then ends whenever wait does.
func waitCtx(ctx context.Context, wait func()) error {
	done := make(chan struct{})
	go func() {
		wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func addrPortOf(a net.Addr) netip.AddrPort {
	if a == nil {
		return netip.AddrPort{}
	}
	if ta, ok := a.(*net.TCPAddr); ok {
		return ta.AddrPort()
	}
	if ua, ok := a.(*net.UDPAddr); ok {
		return ua.AddrPort()
	}
	ap, err := netip.ParseAddrPort(a.String())
	if err != nil {
		return netip.AddrPort{}
	}
	return ap
}
