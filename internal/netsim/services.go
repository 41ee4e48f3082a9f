package netsim

import (
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/miekg/dns"
)

// pattern is what /bytes and chargen send: printable, so a capture reads.
var pattern = func() []byte {
	b := make([]byte, 64<<10)
	for i := range b {
		b[i] = 'a' + byte(i%26)
	}
	return b
}()

// HoldInterval is how often "/hold" sends a byte.
const HoldInterval = 100 * time.Millisecond

// MaxBytes caps "/bytes?n=".
const MaxBytes = 1 << 40

// zoneTTL is the TTL of every answer. Short, so a test that changes the
// zone (SetZone) sees resolvers that honour TTLs follow soon.
const zoneTTL = 1

func tcpService(port int, n *Internet) func(net.Conn) {
	switch port {
	case PortEcho:
		return func(c net.Conn) { _, _ = io.Copy(c, c) }
	case PortDiscard:
		return func(c net.Conn) {
			buf := make([]byte, 64<<10)
			for {
				k, err := c.Read(buf)
				n.discarded.Add(int64(k))
				if err != nil {
					return
				}
			}
		}
	case PortChargen:
		return func(c net.Conn) {
			// Writes until the peer goes away (a write then fails) or
			// Close closes the connection.
			for {
				if _, err := c.Write(pattern); err != nil {
					return
				}
			}
		}
	}
	return func(net.Conn) {} // not reached: the ports are ours
}

// acceptLoop serves one raw TCP listener; each connection gets a goroutine
// counted in n.wg and is closed by Close.
func (n *Internet) acceptLoop(l net.Listener, serve func(net.Conn)) {
	var delay time.Duration
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
				// Out of descriptors: back off like net/http does.
				delay = min(max(2*delay, 5*time.Millisecond), time.Second)
				time.Sleep(delay)
				continue
			}
			return
		}
		delay = 0
		n.wg.Add(1) // the count is positive (this loop's own): no race with Close's Wait
		go func() {
			defer n.wg.Done()
			defer c.Close()
			serve(c)
		}()
	}
}

// handler serves HTTP and HTTPS alike (the scheme is the connection's).
func (n *Internet) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/hold", n.hold)
	mux.HandleFunc("/echo", n.echo)
	mux.HandleFunc("/bytes", n.bytes)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = io.WriteString(w, "hello from "+localAddr(r).Addr().String())
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !n.handlers.add() {
			http.Error(w, "closing", http.StatusServiceUnavailable)
			return
		}
		defer n.handlers.done()
		n.record(r)
		mux.ServeHTTP(w, r)
	})
}

func localAddr(r *http.Request) netip.AddrPort {
	a, _ := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
	return addrPortOf(a)
}

func scheme(r *http.Request) string {
	if r.TLS != nil {
		return "https"
	}
	return "http"
}

func sni(r *http.Request) string {
	if r.TLS != nil {
		return r.TLS.ServerName
	}
	return ""
}

func (n *Internet) record(r *http.Request) {
	remote, _ := netip.ParseAddrPort(r.RemoteAddr)
	req := Request{
		Method:     r.Method,
		Scheme:     scheme(r),
		Host:       r.Host,
		Path:       r.URL.Path,
		RawQuery:   r.URL.RawQuery,
		Proto:      r.Proto,
		Header:     r.Header.Clone(),
		SNI:        sni(r),
		RemoteAddr: remote,
		LocalAddr:  localAddr(r),
	}
	n.mu.Lock()
	n.requests = append(n.requests, req)
	n.mu.Unlock()
}

// hold streams a byte every HoldInterval until the client goes away (or
// Close ends the connection).
func (n *Internet) hold(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Cache-Control", "no-store")
	rc := http.NewResponseController(w)
	t := time.NewTicker(HoldInterval)
	defer t.Stop()
	for {
		if _, err := w.Write([]byte{'.'}); err != nil {
			return
		}
		if err := rc.Flush(); err != nil {
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-t.C:
		}
	}
}

func (n *Internet) echo(w http.ResponseWriter, r *http.Request) {
	body, _ := io.Copy(io.Discard, r.Body)
	remote := r.RemoteAddr
	reply := EchoReply{
		Method:    r.Method,
		Scheme:    scheme(r),
		Host:      r.Host,
		Path:      r.URL.Path,
		RawQuery:  r.URL.RawQuery,
		Proto:     r.Proto,
		Headers:   r.Header,
		SNI:       sni(r),
		Remote:    remote,
		Local:     localAddr(r).String(),
		BodyBytes: body,
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(reply)
}

func (n *Internet) bytes(w http.ResponseWriter, r *http.Request) {
	size, err := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
	if err != nil || size < 0 || size > MaxBytes {
		http.Error(w, "want n=0.."+strconv.FormatInt(MaxBytes, 10), http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
	for size > 0 {
		chunk := pattern[:min(int64(len(pattern)), size)]
		if _, err := w.Write(chunk); err != nil {
			return
		}
		size -= int64(len(chunk))
	}
}

// serveDNS answers the zone authoritatively and records the question.
func (n *Internet) serveDNS(w dns.ResponseWriter, req *dns.Msg) {
	_ = w.WriteMsg(n.answer(req, w.LocalAddr(), w.RemoteAddr()))
}

// answer builds the reply to req (a separate function so the fuzz test
// can drive it without sockets).
func (n *Internet) answer(req *dns.Msg, local, remote net.Addr) *dns.Msg {
	m := new(dns.Msg)
	m.SetReply(req)
	m.Authoritative = true
	m.RecursionAvailable = false
	if req.Opcode != dns.OpcodeQuery {
		m.Rcode = dns.RcodeNotImplemented
		return m
	}
	if len(req.Question) != 1 {
		m.Rcode = dns.RcodeFormatError
		return m
	}
	q := req.Question[0]
	name := strings.TrimSuffix(strings.ToLower(q.Name), ".")
	netw := "udp"
	if _, ok := remote.(*net.TCPAddr); ok {
		netw = "tcp"
	}
	typ, ok := dns.TypeToString[q.Qtype]
	if !ok {
		typ = "TYPE" + strconv.Itoa(int(q.Qtype))
	}
	query := Query{Name: name, Type: typ, Net: netw, Remote: addrPortOf(remote), Server: addrPortOf(local)}
	slog.Debug("netsim: dns query", "name", query.Name, "type", query.Type, "net", query.Net,
		"remote", query.Remote, "server", query.Server)
	n.mu.Lock()
	n.queries = append(n.queries, query)
	n.mu.Unlock()

	addrs, ok := n.lookupZone(name)
	if !ok || q.Qclass != dns.ClassINET {
		m.Rcode = dns.RcodeNameError
		return m
	}
	for _, a := range addrs {
		hdr := dns.RR_Header{Name: q.Name, Class: dns.ClassINET, Ttl: zoneTTL}
		switch {
		case q.Qtype == dns.TypeA && a.Is4():
			hdr.Rrtype = dns.TypeA
			m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: net.IP(a.AsSlice())})
		case q.Qtype == dns.TypeAAAA && a.Is6():
			hdr.Rrtype = dns.TypeAAAA
			m.Answer = append(m.Answer, &dns.AAAA{Hdr: hdr, AAAA: net.IP(a.AsSlice())})
		}
	}
	if netw == "udp" {
		size := dns.MinMsgSize
		if o := req.IsEdns0(); o != nil {
			size = max(int(o.UDPSize()), dns.MinMsgSize)
		}
		m.Truncate(size)
	}
	return m
}
