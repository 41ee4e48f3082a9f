package egress

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

// maxPeek bounds what the proxy buffers before it decides: a ClientHello with
// post-quantum key shares is ~2 KiB, request headers rarely more than a few.
const maxPeek = 16 << 10

// protocol is what the first bytes of a connection looked like.
type protocol int

const (
	protoOther protocol = iota
	protoTLS
	protoHTTP
)

func (p protocol) String() string {
	switch p {
	case protoTLS:
		return "tls"
	case protoHTTP:
		return "http"
	}
	return "other"
}

// errNeedMore: the bytes so far are a valid prefix; read more.
var errNeedMore = errors.New("need more data")

// errMalformed marks first bytes that claim to be TLS or HTTP but are not
// well formed; a name is then never taken from them.
var errMalformed = fmt.Errorf("malformed client hello or request: %w", errdefs.ErrInvalid)

// peeked is what the proxy learned from a connection's first bytes.
type peeked struct {
	proto protocol
	name  string // SNI or Host (lower-case, no port, no trailing dot); "" when none
	bad   bool   // claimed TLS/HTTP but malformed or ambiguous
	data  []byte // every byte read, replayed to the destination
}

// peek reads the client's first bytes until a ClientHello or a request head
// is complete, they are clearly something else, maxPeek is reached or
// timeout passes. A server-speaks-first protocol (SMTP, MySQL) therefore
// waits timeout before it is spliced; that is the price of looking.
func peek(c net.Conn, timeout time.Duration) (peeked, error) {
	if err := c.SetReadDeadline(time.Now().Add(timeout)); err != nil {
		return peeked{}, err
	}
	defer c.SetReadDeadline(time.Time{})
	buf := make([]byte, 0, 2048)
	for {
		if len(buf) == cap(buf) {
			nb := make([]byte, len(buf), min(2*cap(buf), maxPeek))
			copy(nb, buf)
			buf = nb
		}
		n, err := c.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if n > 0 {
			p, done := classify(buf)
			if done {
				return p, nil
			}
			if len(buf) >= maxPeek {
				// Too long to be what it claims: a name hidden past the
				// limit is not looked for.
				return peeked{proto: p.proto, bad: p.proto != protoOther, data: buf}, nil
			}
		}
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, io.EOF) {
				p, _ := classify(buf)
				if p.proto != protoOther && p.name == "" {
					p.bad = true
				}
				p.data = buf
				return p, nil
			}
			return peeked{data: buf}, err
		}
	}
}

// classify looks at buf; done is false while more bytes could change the answer.
func classify(buf []byte) (peeked, bool) {
	p := peeked{data: buf}
	switch {
	case len(buf) == 0:
		return p, false
	case buf[0] == 0x16:
		p.proto = protoTLS
		name, err := parseClientHello(buf)
		switch {
		case errors.Is(err, errNeedMore):
			return p, false
		case err != nil:
			p.bad = true
		default:
			p.name = name
		}
		return p, true
	}
	switch looksHTTP(buf) {
	case errNeedMore:
		return p, false
	case nil:
		p.proto = protoHTTP
		name, err := parseHTTPHost(buf)
		switch {
		case errors.Is(err, errNeedMore):
			return p, false
		case err != nil:
			p.bad = true
		default:
			p.name = name
		}
		return p, true
	}
	return p, true
}

// parseClientHello returns the server_name of the TLS ClientHello at the
// start of buf ("" when it has none). The handshake message may span several
// records. errNeedMore: a valid but incomplete prefix.
func parseClientHello(buf []byte) (string, error) {
	var hs []byte
	for {
		if len(buf) < 5 {
			return "", errNeedMore
		}
		if buf[0] != 0x16 || buf[1] != 3 {
			return "", errMalformed
		}
		n := int(binary.BigEndian.Uint16(buf[3:5]))
		if n == 0 || n > 1<<14 {
			return "", errMalformed
		}
		if len(buf) < 5+n {
			return "", errNeedMore
		}
		hs = append(hs, buf[5:5+n]...)
		buf = buf[5+n:]
		if len(hs) < 4 {
			continue
		}
		if hs[0] != 1 { // client_hello
			return "", errMalformed
		}
		l := int(hs[1])<<16 | int(hs[2])<<8 | int(hs[3])
		if l > maxPeek {
			return "", errMalformed
		}
		if len(hs) >= 4+l {
			return parseClientHelloBody(hs[4 : 4+l])
		}
	}
}

// reader is a bounds-checked cursor: every read past the end sets bad.
type reader struct {
	b   []byte
	bad bool
}

func (r *reader) bytes(n int) []byte {
	if r.bad || n < 0 || n > len(r.b) {
		r.bad = true
		return nil
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) u8() int {
	v := r.bytes(1)
	if v == nil {
		return 0
	}
	return int(v[0])
}

func (r *reader) u16() int {
	v := r.bytes(2)
	if v == nil {
		return 0
	}
	return int(binary.BigEndian.Uint16(v))
}

func parseClientHelloBody(b []byte) (string, error) {
	r := &reader{b: b}
	r.bytes(2)  // legacy_version
	r.bytes(32) // random
	if sid := r.u8(); sid > 32 {
		return "", errMalformed
	} else {
		r.bytes(sid)
	}
	cs := r.u16()
	if cs < 2 || cs%2 != 0 {
		return "", errMalformed
	}
	r.bytes(cs)
	if cm := r.u8(); cm < 1 {
		return "", errMalformed
	} else {
		r.bytes(cm)
	}
	if r.bad {
		return "", errMalformed
	}
	if len(r.b) == 0 {
		return "", nil // no extensions (SSL 3.0 style hello): no name
	}
	ext := &reader{b: r.bytes(r.u16())}
	if r.bad || len(r.b) != 0 {
		return "", errMalformed
	}
	name, seen := "", false
	for len(ext.b) > 0 {
		typ := ext.u16()
		data := ext.bytes(ext.u16())
		if ext.bad {
			return "", errMalformed
		}
		if typ != 0 {
			continue
		}
		if seen {
			return "", errMalformed // two server_name extensions: ambiguous
		}
		seen = true
		n, err := parseServerName(data)
		if err != nil {
			return "", err
		}
		name = n
	}
	return name, nil
}

func parseServerName(data []byte) (string, error) {
	r := &reader{b: data}
	list := &reader{b: r.bytes(r.u16())}
	if r.bad || len(r.b) != 0 {
		return "", errMalformed
	}
	name := ""
	for len(list.b) > 0 {
		typ := list.u8()
		v := list.bytes(list.u16())
		if list.bad {
			return "", errMalformed
		}
		if typ != 0 { // host_name
			continue
		}
		if name != "" {
			return "", errMalformed // RFC 6066: one name of a type
		}
		n, ok := cleanName(string(v))
		if !ok {
			return "", errMalformed
		}
		name = n
	}
	return name, nil
}

// cleanName lower-cases a host name and drops a trailing dot; names with
// bytes no DNS name has are refused (the policy checks syntax again).
func cleanName(s string) (string, bool) {
	s = strings.TrimSuffix(strings.ToLower(s), ".")
	if s == "" || len(s) > 253 || s[0] == '.' || strings.Contains(s, "..") {
		return "", false // empty labels
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '.' || c == '_') {
			return "", false
		}
	}
	return s, true
}

// looksHTTP: nil if buf starts with an HTTP method token and a space.
func looksHTTP(buf []byte) error {
	for i, c := range buf {
		switch {
		case c == ' ' && i > 0:
			return nil
		case c >= 'A' && c <= 'Z' && i < 16:
		default:
			return errMalformed
		}
	}
	return errNeedMore
}

// parseHTTPHost returns the host an HTTP/1.x request head names: the Host
// header, or the authority of an absolute-form target. Both present and
// different, several Host headers, or a non-HTTP/1 version are refused: a
// server could pick either, so the proxy must not.
func parseHTTPHost(buf []byte) (string, error) {
	end := bytes.Index(buf, []byte("\r\n\r\n"))
	if end < 0 {
		if !bytes.Contains(buf, []byte("\n\n")) {
			return "", errNeedMore
		}
		end = bytes.Index(buf, []byte("\n\n"))
	}
	lines := strings.Split(strings.ReplaceAll(string(buf[:end]), "\r\n", "\n"), "\n")
	f := strings.Split(lines[0], " ")
	if len(f) != 3 || f[0] == "" || f[1] == "" || !strings.HasPrefix(f[2], "HTTP/1.") {
		return "", errMalformed
	}
	var target string
	if i := strings.Index(f[1], "://"); i > 0 {
		rest := f[1][i+3:]
		if j := strings.IndexAny(rest, "/?#"); j >= 0 {
			rest = rest[:j]
		}
		if j := strings.LastIndexByte(rest, '@'); j >= 0 {
			rest = rest[j+1:]
		}
		target = rest
	} else if f[0] == "CONNECT" {
		target = f[1]
	}
	host, hosts := "", 0
	for _, l := range lines[1:] {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			return "", errMalformed
		}
		if strings.EqualFold(k, "host") {
			host = strings.TrimSpace(v)
			hosts++
		} else if strings.TrimSpace(k) != k {
			return "", errMalformed // " Host:" / obs-fold tricks
		}
	}
	if hosts > 1 {
		return "", errMalformed
	}
	var name string
	for _, h := range []string{target, host} {
		if h == "" {
			continue
		}
		n, ok := hostOnly(h)
		if !ok {
			return "", errMalformed
		}
		if name != "" && n != name {
			return "", errMalformed
		}
		name = n
	}
	return name, nil
}

// hostOnly strips a port from an authority; an IP literal is no name (the
// address decides), reported as "".
func hostOnly(h string) (string, bool) {
	if x, _, err := net.SplitHostPort(h); err == nil {
		h = x
	} else if strings.HasPrefix(h, "[") && strings.HasSuffix(h, "]") {
		h = h[1 : len(h)-1]
	}
	if _, err := netip.ParseAddr(h); err == nil {
		return "", true
	}
	return cleanName(h)
}
