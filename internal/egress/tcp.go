package egress

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacesbx/space/internal/egress/intercept"
	"github.com/spacesbx/space/internal/egress/socks5"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/netpolicy"
)

// conn is one sandbox connection. The fields below decided are written once
// under Proxy.mu when the decision is recorded and read under it by Set.
type conn struct {
	client net.Conn

	mu     sync.Mutex
	up     net.Conn
	closed bool

	decided     bool
	dialed      netip.AddrPort // what the proxy connects to (dst, or its own resolution of name)
	name        string         // the allowed name that chose dialed, or the SNI / Host seen
	proto       protocol
	proxy       *netpolicy.EgressProxy // the SOCKS5 hop it goes through; nil: direct
	intercepted bool
	icpt        *intercept.Interceptor // the CA it was intercepted with
	sni         string                 // the host intercepted for
	headers     map[string]string      // the headers injected
}

// close cuts both sides; safe to call more than once and before up exists.
func (c *conn) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	c.client.Close()
	if c.up != nil {
		c.up.Close()
	}
}

// setUp records the outbound side; false (and u closed) if c was cut meanwhile.
func (c *conn) setUp(u net.Conn) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		u.Close()
		return false
	}
	c.up = u
	return true
}

// ServeTCP accepts redirected connections on ln until ctx ends or Close, and
// closes ln when it returns. origDst returns a connection's original
// destination (SO_ORIGINAL_DST in production). Connections it accepted end
// with it.
func (p *Proxy) ServeTCP(ctx context.Context, ln net.Listener, origDst func(net.Conn) (netip.AddrPort, error)) error {
	if !p.serve(ln) {
		ln.Close()
		return fmt.Errorf("egress: proxy closed: %w", errdefs.ErrUnavailable)
	}
	defer p.unserve(ln)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stopP := context.AfterFunc(p.ctx, cancel)
	defer stopP()
	stopLn := context.AfterFunc(ctx, func() { ln.Close() })
	defer stopLn()
	defer ln.Close()

	var delay time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil || p.ctx.Err() != nil { // Close cancels p.ctx before closing ln
				return nil
			}
			var t interface{ Temporary() bool }
			if errors.As(err, &t) && t.Temporary() { // EMFILE and friends
				delay = min(max(2*delay, 5*time.Millisecond), time.Second)
				select {
				case <-time.After(delay):
				case <-ctx.Done():
					return nil
				}
				continue
			}
			return fmt.Errorf("egress: accept: %w", err)
		}
		delay = 0
		p.mu.Lock()
		ok := p.goLocked(func() { p.handle(ctx, c, origDst) })
		p.mu.Unlock()
		if !ok {
			c.Close()
			return nil
		}
	}
}

// decision is the outcome of the algorithm for one connection.
type decision struct {
	allow     bool
	reason    string
	verdict   string // metric label when !allow: "deny" or "error"
	dial      netip.AddrPort
	name      string // recorded for Set (allowed name, or the seen one)
	proxy     *netpolicy.EgressProxy
	proxyAddr netip.AddrPort
	intercept map[string]string // headers when intercepting
}

func addrPortOf(a net.Addr) netip.AddrPort {
	if t, ok := a.(*net.TCPAddr); ok {
		ap := t.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	ap, _ := netip.ParseAddrPort(a.String())
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

func (p *Proxy) handle(ctx context.Context, c net.Conn, origDst func(net.Conn) (netip.AddrPort, error)) {
	gw := addrPortOf(c.LocalAddr()).Addr()
	p.mu.Lock()
	st := p.sbs[gw]
	if st == nil {
		p.mu.Unlock()
		d := Denial{Kind: "tcp", Reason: "unknown-sandbox"}
		if dst, err := origDst(c); err == nil {
			d.Dest = dst.String()
		}
		c.Close()
		p.deny(d, p.m.conns)
		return
	}
	tc := &conn{client: c}
	st.conns[tc] = struct{}{}
	sb, icpt := st.sb, st.icpt
	p.mu.Unlock()
	stop := context.AfterFunc(ctx, tc.close)
	defer func() {
		stop()
		tc.close()
		p.mu.Lock()
		delete(st.conns, tc)
		p.mu.Unlock()
	}()

	dst, err := origDst(c)
	if err != nil || !dst.IsValid() {
		p.deny(Denial{SandboxID: sb.ID, Generation: sb.Generation, Kind: "tcp", Reason: "no-original-dst"}, p.m.conns)
		return
	}
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())

	pk, d := p.decide(ctx, st, sb, icpt, c, dst)
	denial := Denial{SandboxID: sb.ID, Generation: sb.Generation, Kind: "tcp", Dest: dst.String(), Name: pk.name, Reason: d.reason}
	if !d.allow {
		p.refuse(denial, d.verdict, p.m.conns)
		return
	}

	// Record what allowed it, unless the sandbox changed while deciding: then
	// the current policy must allow it too (Set only re-checks decided ones).
	p.mu.Lock()
	tc.dialed, tc.name, tc.proto, tc.proxy = d.dial, d.name, pk.proto, d.proxy
	tc.intercepted, tc.sni, tc.headers = d.intercept != nil, pk.name, d.intercept
	if tc.intercepted {
		tc.icpt = icpt
	}
	cur := p.sbs[gw]
	ok := cur == st && (st.sb.Policy == sb.Policy && st.icpt == icpt || p.stillAllowedLocked(st, tc))
	if ok {
		tc.decided = true
	}
	p.mu.Unlock()
	if !ok {
		denial.Reason = "policy-changed"
		p.deny(denial, p.m.conns)
		return
	}

	dial := func(ctx context.Context) (net.Conn, error) {
		dctx, cancel := context.WithTimeout(ctx, p.cfg.DialTimeout)
		defer cancel()
		t0 := time.Now()
		u, err := p.dialOut(dctx, d)
		p.m.dial.Observe(time.Since(t0).Seconds())
		if err != nil {
			denial.Reason = "dial-failed"
			p.log.Debug("egress dial failed", "sandbox", sb.ID, "dest", d.dial, "err", err)
			p.refuse(denial, "error", p.m.conns)
			return nil, err
		}
		if !tc.setUp(u) {
			return nil, errClosed
		}
		return u, nil
	}

	p.m.active.Inc()
	defer p.m.active.Dec()
	if d.intercept != nil {
		p.m.conns.WithLabelValues("allow", d.reason).Inc()
		client := &replayConn{Conn: c, replay: pk.data}
		if err := icpt.Serve(ctx, client, pk.name, d.intercept, dial); err != nil {
			p.log.Debug("egress interception ended", "sandbox", sb.ID, "host", pk.name, "err", err)
		}
		return
	}
	up, err := dial(ctx)
	if err != nil {
		return
	}
	p.m.conns.WithLabelValues("allow", d.reason).Inc()
	p.splice(c, up, pk.data)
}

// decide runs the decision algorithm (see the package contract) for dst.
func (p *Proxy) decide(ctx context.Context, st *sandbox, sb Sandbox, icpt *intercept.Interceptor, c net.Conn, dst netip.AddrPort) (peeked, decision) {
	pol := sb.Policy
	deny := func(reason string) decision { return decision{reason: reason, verdict: "deny"} }
	if p.reserved(pol, dst.Addr()) {
		return peeked{}, deny("reserved")
	}
	v := pol.Addr(dst.Addr())
	var pk peeked
	if pol.HasDomains() || pol.HasTransforms() {
		var err error
		if pk, err = peek(c, p.cfg.PeekTimeout); err != nil {
			return pk, decision{reason: "peek-failed", verdict: "error"}
		}
	} else if !v.Allow {
		return pk, deny(v.Reason)
	}

	d := decision{allow: true, name: pk.name}
	switch {
	case pk.name != "" && pol.Name(pk.name).Allow:
		addrs, err := p.lookup(ctx, pk.name)
		if err != nil {
			return pk, decision{reason: "resolve-failed", verdict: "error"}
		}
		var keep []netip.Addr
		for _, a := range addrs {
			if a = a.Unmap(); !p.reserved(pol, a) {
				keep = append(keep, a)
			}
		}
		if len(keep) == 0 {
			return pk, deny("rebinding")
		}
		// The sandbox's own choice when the resolver agrees, else the
		// first address of its family (its route exists), else the first.
		d.dial = netip.AddrPortFrom(keep[0], dst.Port())
		for _, a := range slices.Backward(keep) {
			if a.Is4() == dst.Addr().Is4() {
				d.dial = netip.AddrPortFrom(a, dst.Port())
			}
		}
		if slices.Contains(keep, dst.Addr()) {
			d.dial = dst
		}
		d.reason = "allow-domain"
	case v.Allow:
		d.dial, d.reason = dst, v.Reason
	default:
		n := st.learned.allowed(dst.Addr(), pol, time.Now())
		switch {
		case n == "" && pk.name != "":
			return pk, deny("no-domain-match")
		case n == "":
			return pk, deny(v.Reason)
		case pk.name != "" && !isIPLiteral(pk.name):
			// A Host or TLS server name that is not allowed, at an address
			// learned for another name: virtual hosting (a CDN, a shared
			// front) would serve the forbidden one (domain fronting).
			return pk, deny("host-mismatch")
		case pk.bad:
			return pk, deny("malformed")
		}
		d.dial, d.reason, d.name = dst, "dns-learned", n
	}

	if pr := pol.Proxy(); pr != nil {
		a, err := p.resolveProxy(ctx, pol, pr.Address)
		if err != nil {
			return pk, deny("reserved-proxy")
		}
		d.proxy, d.proxyAddr = pr, a
	}
	if pk.proto == protoTLS && pk.name != "" && icpt != nil {
		if t := pol.Transform(pk.name); t != nil {
			d.intercept = maps.Clone(t.Headers)
			if d.intercept == nil {
				d.intercept = map[string]string{}
			}
		}
	}
	return pk, d
}

// resolveProxy resolves the SOCKS5 proxy's host:port; a proxy at a reserved
// address is refused (a policy must not reach the worker's network by it).
func (p *Proxy) resolveProxy(ctx context.Context, pol *netpolicy.Policy, hostport string) (netip.AddrPort, error) {
	host, ps, err := net.SplitHostPort(hostport)
	if err != nil {
		return netip.AddrPort{}, err
	}
	port, err := strconv.ParseUint(ps, 10, 16)
	if err != nil || port == 0 {
		return netip.AddrPort{}, fmt.Errorf("proxy port %q: %w", ps, errdefs.ErrInvalid)
	}
	var addrs []netip.Addr
	if a, err := netip.ParseAddr(host); err == nil {
		addrs = []netip.Addr{a}
	} else if addrs, err = p.lookup(ctx, host); err != nil {
		return netip.AddrPort{}, err
	}
	for _, a := range addrs {
		if !p.reserved(pol, a) {
			return netip.AddrPortFrom(a.Unmap(), uint16(port)), nil
		}
	}
	return netip.AddrPort{}, fmt.Errorf("proxy %s: reserved address: %w", hostport, errdefs.ErrDenied)
}

// stillAllowedLocked re-runs the decision for a live connection under the
// sandbox's current policy, without peeking or resolving: the recorded name
// and the address actually connected to decide. Caller holds p.mu.
func (p *Proxy) stillAllowedLocked(st *sandbox, c *conn) bool {
	pol := st.sb.Policy
	a := c.dialed.Addr()
	if p.reservedLocked(pol, a) {
		return false
	}
	if pr := pol.Proxy(); (pr == nil) != (c.proxy == nil) || pr != nil && *pr != *c.proxy {
		return false // the path out changed
	}
	if c.intercepted {
		t := pol.Transform(c.sni)
		if st.icpt != c.icpt || t == nil || !maps.Equal(t.Headers, c.headers) {
			return false // another CA, or the injected headers are no longer what the policy says
		}
	}
	if c.name != "" && pol.Name(c.name).Allow || pol.Addr(a).Allow {
		return true
	}
	return !(c.proto == protoHTTP && c.name != "") && st.learned.allowed(a, pol, time.Now()) != ""
}

func (p *Proxy) dialOut(ctx context.Context, d decision) (net.Conn, error) {
	dial, real := p.cfg.Dial, p.cfg.Dial == nil
	if real {
		dial = p.dialer.DialContext
	}
	if d.proxy != nil {
		return socks5.Dial(ctx, dial, d.proxyAddr.String(), d.proxy.Username, d.proxy.Password, d.dial.String())
	}
	c, err := dial(ctx, "tcp", d.dial.String())
	if err != nil {
		return nil, err
	}
	// A test's Dial reaches its servers on loopback: the backstop is for
	// the worker's own dialer.
	if reason := p.localConn(c); real && reason != "" {
		c.Close()
		return nil, fmt.Errorf("egress: %s is %s: %w", d.dial, reason, errdefs.ErrDenied)
	}
	return c, nil
}

// localConn is the backstop behind the decision: a connection that the
// kernel delivered to the host itself (it chose the destination as
// source, which it does only for a local address) or whose destination
// became one of the host's addresses while it was dialled is closed
// before a byte of the sandbox's is sent. The peer saw a handshake, no
// data.
func (p *Proxy) localConn(c net.Conn) string {
	la, lok := c.LocalAddr().(*net.TCPAddr)
	ra, rok := c.RemoteAddr().(*net.TCPAddr)
	if !lok || !rok {
		return "" // not a TCP socket (a test's Dial)
	}
	l, _ := netip.AddrFromSlice(la.IP)
	r, _ := netip.AddrFromSlice(ra.IP)
	switch {
	case l.Unmap() == r.Unmap():
		return "this host"
	case p.cfg.Defaults.Reserved(r):
		return "reserved"
	}
	return ""
}

// lookup is the proxy's own resolution of an allowed name.
func (p *Proxy) lookup(ctx context.Context, name string) ([]netip.Addr, error) {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.DialTimeout)
	defer cancel()
	if p.cfg.Lookup != nil {
		return p.cfg.Lookup(ctx, name)
	}
	return p.resolve(ctx, name)
}

// replayConn returns the peeked bytes before the rest of the connection.
type replayConn struct {
	net.Conn
	replay []byte
}

func (r *replayConn) Read(b []byte) (int, error) {
	if len(r.replay) > 0 {
		n := copy(b, r.replay)
		r.replay = r.replay[n:]
		return n, nil
	}
	return r.Conn.Read(b)
}

// splice relays both ways until both directions end (half-closes passed on)
// or either fails; the peeked bytes go first. Plain io.Copy between
// *net.TCPConn lets Linux splice(2) without copying through user space.
func (p *Proxy) splice(client, up net.Conn, replay []byte) {
	defer client.Close()
	defer up.Close()
	if len(replay) > 0 {
		up.SetWriteDeadline(time.Now().Add(p.cfg.DialTimeout))
		n, err := up.Write(replay)
		p.m.bytes.WithLabelValues("out").Add(float64(n))
		if err != nil {
			return
		}
		up.SetWriteDeadline(time.Time{})
	}
	var last atomic.Int64
	last.Store(time.Now().UnixNano())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		n, err := p.copy(up, client, &last)
		p.m.bytes.WithLabelValues("out").Add(float64(n))
		p.endDirection(up, client, err)
	}()
	n, err := p.copy(client, up, &last)
	p.m.bytes.WithLabelValues("in").Add(float64(n))
	p.endDirection(client, up, err)
	wg.Wait()
}

// endDirection passes a clean end on as a half-close, and aborts both sides
// on an error so the other direction does not wait forever.
func (p *Proxy) endDirection(dst, src net.Conn, err error) {
	if err == nil {
		if cw, ok := dst.(interface{ CloseWrite() error }); ok && cw.CloseWrite() == nil {
			return
		}
	}
	dst.Close()
	src.Close()
}

// copy is io.Copy, or with IdleTimeout a loop that ends when neither
// direction moved for that long.
func (p *Proxy) copy(dst, src net.Conn, last *atomic.Int64) (int64, error) {
	if p.cfg.IdleTimeout <= 0 {
		return io.Copy(dst, src)
	}
	buf := make([]byte, 32<<10)
	var total int64
	for {
		src.SetReadDeadline(time.Now().Add(p.cfg.IdleTimeout))
		n, err := src.Read(buf)
		if n > 0 {
			last.Store(time.Now().UnixNano())
			w, werr := dst.Write(buf[:n])
			total += int64(w)
			if werr != nil {
				return total, werr
			}
		}
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() && time.Since(time.Unix(0, last.Load())) < p.cfg.IdleTimeout {
				continue // the other direction is busy
			}
			return total, err
		}
	}
}

// isIPLiteral reports whether a peeked name is an address (a Host of
// "203.0.113.7" names no virtual host).
func isIPLiteral(name string) bool {
	_, err := netip.ParseAddr(strings.Trim(name, "[]"))
	return err == nil
}
