package egress

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"

	"github.com/spacesbx/space/internal/errdefs"
)

const (
	// learnedMaxTTL caps how long an answer allows its address (DNS-learned
	// rule); learnedMinTTL keeps a TTL-0 answer usable for the connect that
	// follows it.
	learnedMaxTTL  = 10 * time.Minute
	learnedMinTTL  = 5 * time.Second
	learnedMaxAddr = 4096 // per sandbox
	learnedMaxName = 16   // names remembered per address (CDNs share them)

	queryTimeout    = 5 * time.Second  // one client query, all upstreams included
	upstreamTimeout = 2 * time.Second  // one upstream attempt
	tcpDNSIdle      = 10 * time.Second // a DNS-over-TCP client silent that long is closed
	maxUDPInflight  = 256              // UDP queries answered at once; more are dropped (clients retry)
)

// ServeDNS answers queries on udp (the sandbox is identified per packet by
// its destination address, read with IP_PKTINFO / IPV6_PKTINFO) and on tcp
// (by the connection's local address) until ctx ends or Close. Either may be
// nil. It closes both when it returns.
func (p *Proxy) ServeDNS(ctx context.Context, udp *net.UDPConn, tcp net.Listener) error {
	var socks []interface{ Close() error }
	if udp != nil {
		socks = append(socks, udp)
	}
	if tcp != nil {
		socks = append(socks, tcp)
	}
	for i, s := range socks {
		if !p.serve(s) {
			for _, s := range socks {
				s.Close()
			}
			for _, s := range socks[:i] {
				p.unserve(s)
			}
			return fmt.Errorf("egress: proxy closed: %w", errdefs.ErrUnavailable)
		}
	}
	defer func() {
		for _, s := range socks {
			s.Close()
			p.unserve(s)
		}
	}()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stopP := context.AfterFunc(p.ctx, cancel)
	defer stopP()
	stop := context.AfterFunc(ctx, func() {
		for _, s := range socks {
			s.Close()
		}
	})
	defer stop()

	if udp != nil {
		err4 := ipv4.NewPacketConn(udp).SetControlMessage(ipv4.FlagDst, true)
		err6 := ipv6.NewPacketConn(udp).SetControlMessage(ipv6.FlagDst, true)
		if err4 != nil && err6 != nil {
			return fmt.Errorf("egress: dns: enable pktinfo: %w", err4)
		}
	}
	errc := make(chan error, 2)
	n := 0
	p.mu.Lock()
	if udp != nil && p.goLocked(func() { errc <- p.serveUDP(ctx, udp) }) {
		n++
	}
	if tcp != nil && p.goLocked(func() { errc <- p.serveDNSTCP(ctx, tcp) }) {
		n++
	}
	p.mu.Unlock()
	var first error
	for range n {
		if err := <-errc; err != nil && first == nil {
			first = err
			cancel() // one side failing stops the other: fail loudly, not half-served
		}
	}
	return first
}

// pktDst returns the destination address of a received packet.
func pktDst(oob []byte) netip.Addr {
	var cm4 ipv4.ControlMessage
	if cm4.Parse(oob) == nil && cm4.Dst != nil {
		if a, ok := netip.AddrFromSlice(cm4.Dst); ok {
			return a.Unmap()
		}
	}
	var cm6 ipv6.ControlMessage
	if cm6.Parse(oob) == nil && cm6.Dst != nil {
		if a, ok := netip.AddrFromSlice(cm6.Dst); ok {
			return a.Unmap()
		}
	}
	return netip.Addr{}
}

// srcOOB makes the reply leave from the address the query was sent to, so
// it matches the client's (and conntrack's) idea of the flow. IP_PKTINFO is
// honoured on IPv6 sockets too for IPv4(-mapped) peers.
func srcOOB(gw netip.Addr) []byte {
	if gw.Is4() {
		return (&ipv4.ControlMessage{Src: gw.AsSlice()}).Marshal()
	}
	return (&ipv6.ControlMessage{Src: gw.AsSlice()}).Marshal()
}

func (p *Proxy) serveUDP(ctx context.Context, udp *net.UDPConn) error {
	sem := make(chan struct{}, maxUDPInflight)
	buf := make([]byte, 65535)
	oob := make([]byte, 512)
	for {
		n, oobn, _, raddr, err := udp.ReadMsgUDPAddrPort(buf, oob)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			var t interface{ Temporary() bool }
			if errors.As(err, &t) && t.Temporary() {
				continue
			}
			return fmt.Errorf("egress: dns udp: %w", err)
		}
		gw := pktDst(oob[:oobn])
		if !gw.IsValid() {
			continue // no destination: cannot attribute, drop
		}
		select {
		case sem <- struct{}{}:
		default:
			p.m.queries.WithLabelValues("error", "overload").Inc()
			continue
		}
		pkt := append([]byte(nil), buf[:n]...)
		p.mu.Lock()
		ok := p.goLocked(func() {
			defer func() { <-sem }()
			out := p.answerPacket(ctx, gw, pkt, true)
			if out != nil {
				udp.WriteMsgUDPAddrPort(out, srcOOB(gw), raddr)
			}
		})
		p.mu.Unlock()
		if !ok {
			return nil
		}
	}
}

func (p *Proxy) serveDNSTCP(ctx context.Context, ln net.Listener) error {
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			var t interface{ Temporary() bool }
			if errors.As(err, &t) && t.Temporary() {
				select {
				case <-time.After(50 * time.Millisecond):
				case <-ctx.Done():
				}
				continue
			}
			return fmt.Errorf("egress: dns tcp: %w", err)
		}
		p.mu.Lock()
		ok := p.goLocked(func() {
			defer c.Close()
			stop := context.AfterFunc(ctx, func() { c.Close() })
			defer stop()
			gw := addrPortOf(c.LocalAddr()).Addr()
			var lb [2]byte
			for {
				c.SetReadDeadline(time.Now().Add(tcpDNSIdle))
				if _, err := io.ReadFull(c, lb[:]); err != nil {
					return
				}
				msg := make([]byte, binary.BigEndian.Uint16(lb[:]))
				if _, err := io.ReadFull(c, msg); err != nil {
					return
				}
				out := p.answerPacket(ctx, gw, msg, false)
				if out == nil {
					return // unknown sandbox or garbage: no answer, no connection
				}
				c.SetWriteDeadline(time.Now().Add(tcpDNSIdle))
				if _, err := c.Write(binary.BigEndian.AppendUint16(nil, uint16(len(out)))); err != nil {
					return
				}
				if _, err := c.Write(out); err != nil {
					return
				}
			}
		})
		p.mu.Unlock()
		if !ok {
			c.Close()
			return nil
		}
	}
}

// answerPacket decodes a query, answers it and encodes the reply; nil: drop.
func (p *Proxy) answerPacket(ctx context.Context, gw netip.Addr, pkt []byte, udp bool) []byte {
	req := new(dns.Msg)
	if err := req.Unpack(pkt); err != nil {
		p.m.queries.WithLabelValues("error", "malformed").Inc()
		return nil
	}
	resp := p.answer(ctx, gw, req)
	if resp == nil {
		return nil
	}
	if udp {
		size := dns.MinMsgSize
		if opt := req.IsEdns0(); opt != nil {
			size = max(int(opt.UDPSize()), dns.MinMsgSize)
		}
		resp.Truncate(size)
	}
	out, err := resp.Pack()
	if err != nil {
		p.m.queries.WithLabelValues("error", "pack").Inc()
		return nil
	}
	return out
}

// answer decides and answers one query for the sandbox at gw; nil: drop.
func (p *Proxy) answer(ctx context.Context, gw netip.Addr, req *dns.Msg) *dns.Msg {
	st, sb, _ := p.lookupSandbox(gw)
	if st == nil {
		qn := ""
		if len(req.Question) > 0 {
			qn = strings.TrimSuffix(strings.ToLower(req.Question[0].Name), ".")
		}
		p.deny(Denial{Kind: "dns", Dest: qn, Name: qn, Reason: "unknown-sandbox"}, p.m.queries)
		return nil
	}
	reply := func(rcode int) *dns.Msg {
		m := new(dns.Msg)
		m.SetRcode(req, rcode)
		m.RecursionAvailable = true
		return m
	}
	if req.Response || len(req.Question) != 1 {
		p.m.queries.WithLabelValues("error", "malformed").Inc()
		return reply(dns.RcodeFormatError)
	}
	if req.Opcode != dns.OpcodeQuery {
		p.m.queries.WithLabelValues("error", "not-implemented").Inc()
		return reply(dns.RcodeNotImplemented)
	}
	q := req.Question[0]
	name := strings.TrimSuffix(strings.ToLower(q.Name), ".")
	pol := sb.Policy
	nv := pol.Name(name)
	denial := Denial{SandboxID: sb.ID, Generation: sb.Generation, Kind: "dns", Dest: name, Name: name}
	if pol.AllowList() {
		switch {
		case q.Qtype == dns.TypePTR || q.Qtype == dns.TypeANY || q.Qclass != dns.ClassINET:
			denial.Reason = "refused-qtype"
		case !nv.Allow:
			denial.Reason = nv.Reason
		}
		if denial.Reason != "" {
			p.deny(denial, p.m.queries)
			return reply(dns.RcodeRefused)
		}
	}

	up := req.Copy()
	up.Id = dns.Id()
	up.RecursionDesired = true
	clientOpt := req.IsEdns0()
	if opt := up.IsEdns0(); opt != nil {
		opt.SetUDPSize(dns.DefaultMsgSize)
	} else {
		up.SetEdns0(dns.DefaultMsgSize, false)
	}
	ctx, cancel := context.WithTimeout(ctx, queryTimeout)
	defer cancel()
	resp, err := p.exchange(ctx, up)
	if err != nil {
		p.m.queries.WithLabelValues("error", "upstream-failed").Inc()
		p.log.Debug("egress dns upstream failed", "sandbox", sb.ID, "err", err)
		return reply(dns.RcodeServerFailure)
	}
	resp.Id = req.Id
	resp.Question = req.Question
	if clientOpt == nil {
		resp.Extra = slices.DeleteFunc(resp.Extra, func(rr dns.RR) bool { return rr.Header().Rrtype == dns.TypeOPT })
	}

	// Anti-rebinding: an address the sandbox may never reach is not handed out.
	stripped, strippedAddrs := 0, 0
	reserved := func(ip net.IP) bool {
		a, ok := netip.AddrFromSlice(ip)
		return !ok || p.reserved(pol, a.Unmap())
	}
	keepRR := func(rr dns.RR) bool {
		if a, ok := rrAddr(rr); ok && p.reserved(pol, a) {
			stripped++
			strippedAddrs++
			return false
		}
		// SVCB/HTTPS address hints are addresses too (browsers connect to them).
		var svcb *dns.SVCB
		switch r := rr.(type) {
		case *dns.SVCB:
			svcb = r
		case *dns.HTTPS:
			svcb = &r.SVCB
		}
		if svcb != nil {
			svcb.Value = slices.DeleteFunc(svcb.Value, func(kv dns.SVCBKeyValue) bool {
				var hint *[]net.IP
				switch h := kv.(type) {
				case *dns.SVCBIPv4Hint:
					hint = &h.Hint
				case *dns.SVCBIPv6Hint:
					hint = &h.Hint
				default:
					return false
				}
				n := len(*hint)
				*hint = slices.DeleteFunc(*hint, reserved)
				stripped += n - len(*hint)
				return len(*hint) == 0
			})
		}
		return true
	}
	resp.Answer = slices.DeleteFunc(resp.Answer, func(rr dns.RR) bool { return !keepRR(rr) })
	resp.Extra = slices.DeleteFunc(resp.Extra, func(rr dns.RR) bool { return !keepRR(rr) })
	addrs := 0
	now := time.Now()
	for _, rr := range resp.Answer {
		if a, ok := rrAddr(rr); ok {
			addrs++
			if nv.Allow {
				st.learned.add(a, name, time.Duration(rr.Header().Ttl)*time.Second, now)
			}
		}
	}
	if strippedAddrs > 0 && addrs == 0 {
		resp.Answer = nil // only the CNAME chain to a forbidden address would be left
		denial.Reason = "rebinding"
		p.deny(denial, p.m.queries)
		return resp
	}
	if stripped > 0 {
		denial.Reason = "rebinding"
		p.log.Info("egress dns answers stripped", "sandbox", sb.ID, "name", name, "stripped", stripped)
		if p.cfg.Audit != nil {
			p.cfg.Audit(denial)
		}
	}
	reason := "forwarded"
	if nv.Allow {
		reason = nv.Reason
	}
	p.m.queries.WithLabelValues("allow", reason).Inc()
	return resp
}

func rrAddr(rr dns.RR) (netip.Addr, bool) {
	var ip net.IP
	switch r := rr.(type) {
	case *dns.A:
		ip = r.A
	case *dns.AAAA:
		ip = r.AAAA
	default:
		return netip.Addr{}, false
	}
	a, ok := netip.AddrFromSlice(ip)
	if !ok {
		return netip.Addr{}, true // unusable address: reserved-equivalent (invalid is reserved)
	}
	return a.Unmap(), true
}

// exchange asks the upstreams in order (UDP, then TCP when truncated) and
// returns the first answer that is not a server failure.
func (p *Proxy) exchange(ctx context.Context, m *dns.Msg) (*dns.Msg, error) {
	var last *dns.Msg
	var lastErr error = fmt.Errorf("no upstream: %w", errdefs.ErrUnavailable)
	for _, u := range p.upstreams {
		for _, netw := range []string{"udp", "tcp"} {
			c := &dns.Client{Net: netw, Timeout: upstreamTimeout, UDPSize: dns.DefaultMsgSize}
			resp, _, err := c.ExchangeContext(ctx, m, u.String())
			if err != nil {
				lastErr = err
				break
			}
			if resp.Truncated && netw == "udp" {
				continue
			}
			if resp.Rcode == dns.RcodeServerFailure {
				last = resp
				break
			}
			return resp, nil
		}
		if ctx.Err() != nil {
			break
		}
	}
	if last != nil {
		return last, nil
	}
	return nil, fmt.Errorf("dns upstreams: %w: %w", errdefs.ErrUnavailable, lastErr)
}

// resolveCache keeps the proxy's own answers for their TTL (clamped), so a
// burst of connections to one allowed name costs one pair of queries.
type resolveCache struct {
	mu sync.Mutex
	m  map[string]resolved
}

type resolved struct {
	addrs []netip.Addr
	exp   time.Time
}

const (
	resolveMinTTL   = 5 * time.Second
	resolveMaxTTL   = 5 * time.Minute
	resolveMaxNames = 4096
)

func (c *resolveCache) get(name string, now time.Time) ([]netip.Addr, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.m[name]
	if !ok || now.After(r.exp) {
		return nil, false
	}
	return r.addrs, true
}

func (c *resolveCache) put(name string, addrs []netip.Addr, ttl time.Duration, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = make(map[string]resolved)
	}
	if len(c.m) >= resolveMaxNames {
		for n, r := range c.m {
			if now.After(r.exp) || len(c.m) >= resolveMaxNames*7/8 {
				delete(c.m, n)
			}
		}
	}
	c.m[name] = resolved{addrs: addrs, exp: now.Add(min(max(ttl, resolveMinTTL), resolveMaxTTL))}
}

// resolve is the proxy's own A/AAAA resolution through the upstreams (both
// asked at once); answers without any address are not cached.
func (p *Proxy) resolve(ctx context.Context, name string) ([]netip.Addr, error) {
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	now := time.Now()
	if addrs, ok := p.cache.get(name, now); ok {
		return addrs, nil
	}
	types := []uint16{dns.TypeA, dns.TypeAAAA}
	resps := make([]*dns.Msg, len(types))
	errs := make([]error, len(types))
	var wg sync.WaitGroup
	for i, t := range types {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m := new(dns.Msg)
			m.SetQuestion(dns.Fqdn(name), t)
			m.SetEdns0(dns.DefaultMsgSize, false)
			resps[i], errs[i] = p.exchange(ctx, m)
		}()
	}
	wg.Wait()
	var out []netip.Addr
	ttl := resolveMaxTTL
	for _, resp := range resps {
		if resp == nil {
			continue
		}
		for _, rr := range resp.Answer {
			if a, ok := rrAddr(rr); ok && a.IsValid() {
				out = append(out, a)
				ttl = min(ttl, time.Duration(rr.Header().Ttl)*time.Second)
			}
		}
	}
	if len(out) == 0 {
		if err := errors.Join(errs...); err != nil {
			return nil, fmt.Errorf("resolve %s: %w", name, err)
		}
		return nil, nil
	}
	p.cache.put(name, out, ttl, now)
	return out, nil
}
