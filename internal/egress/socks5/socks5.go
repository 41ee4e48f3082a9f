// Package socks5 is the SOCKS5 client (RFC 1928, username/password auth
// RFC 1929) the egress proxy uses when a sandbox's policy chains its
// traffic through an upstream proxy. Only CONNECT is spoken; every refusal
// comes back as a typed error carrying an errdefs class.
package socks5

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

const (
	version        = 5
	authVersion    = 1
	methodNoAuth   = 0x00
	methodUserPass = 0x02
	methodNone     = 0xff
	cmdConnect     = 1
	atypIPv4       = 1
	atypDomain     = 3
	atypIPv6       = 4
)

// Reply codes of RFC 1928 section 6.
const (
	ReplySucceeded           = 0x00
	ReplyGeneralFailure      = 0x01
	ReplyNotAllowed          = 0x02
	ReplyNetworkUnreachable  = 0x03
	ReplyHostUnreachable     = 0x04
	ReplyConnectionRefused   = 0x05
	ReplyTTLExpired          = 0x06
	ReplyCommandNotSupported = 0x07
	ReplyAddrNotSupported    = 0x08
)

// ErrAuthRefused: the proxy accepted none of the offered methods, or
// refused the user name and password.
var ErrAuthRefused = fmt.Errorf("socks5: authentication refused: %w", errdefs.ErrDenied)

// ReplyError is a CONNECT the proxy refused.
type ReplyError struct {
	Code byte
}

var replyText = map[byte]string{
	ReplyGeneralFailure:      "general failure",
	ReplyNotAllowed:          "connection not allowed by ruleset",
	ReplyNetworkUnreachable:  "network unreachable",
	ReplyHostUnreachable:     "host unreachable",
	ReplyConnectionRefused:   "connection refused",
	ReplyTTLExpired:          "TTL expired",
	ReplyCommandNotSupported: "command not supported",
	ReplyAddrNotSupported:    "address type not supported",
}

func (e *ReplyError) Error() string {
	t, ok := replyText[e.Code]
	if !ok {
		t = "unknown reply"
	}
	return fmt.Sprintf("socks5: proxy refused connect: %s (0x%02x)", t, e.Code)
}

// Unwrap gives the code's class: the ruleset's refusal is a denial, what
// the network did is unavailability, a proxy that cannot speak CONNECT
// or our address type is an upstream failure.
func (e *ReplyError) Unwrap() error {
	switch e.Code {
	case ReplyNotAllowed:
		return errdefs.ErrDenied
	case ReplyGeneralFailure, ReplyNetworkUnreachable, ReplyHostUnreachable, ReplyConnectionRefused:
		return errdefs.ErrUnavailable
	case ReplyTTLExpired:
		return errdefs.ErrTimeout
	}
	return errdefs.ErrUpstream
}

// Dial connects to the SOCKS5 proxy at proxyAddr ("host:port", already
// checked by the caller) with dial, authenticates (no auth, or user/pass
// when user != ""), and CONNECTs to dest ("ip:port" or "name:port"). The
// handshake ends by ctx's deadline or cancellation; the connection
// returned has no deadline set.
//
// Errors: ErrInvalid for a bad dest or credentials (nothing dialed),
// ErrAuthRefused (ErrDenied), a *ReplyError classed by its code,
// ErrTimeout wrapping ctx's error when ctx ended the handshake,
// ErrUnavailable when the proxy cannot be dialed, ErrUpstream for a proxy
// that breaks the protocol.
func Dial(ctx context.Context, dial func(ctx context.Context, network, addr string) (net.Conn, error),
	proxyAddr, user, pass, dest string) (net.Conn, error) {
	req, err := connectRequest(dest)
	if err != nil {
		return nil, err
	}
	if len(user) > 255 || len(pass) > 255 || (user == "" && pass != "") {
		return nil, fmt.Errorf("socks5: credentials: %w: user and password must be 1-255 bytes", errdefs.ErrInvalid)
	}
	conn, err := dial(ctx, "tcp", proxyAddr)
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("socks5: dial proxy %s: %w: %w", proxyAddr, errdefs.ErrTimeout, ctx.Err())
		}
		return nil, fmt.Errorf("socks5: dial proxy %s: %w: %v", proxyAddr, errdefs.ErrUnavailable, err)
	}
	if d, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(d)
	}
	// Cancellation (not only the deadline) interrupts a blocked read.
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	err = handshake(conn, user, pass, req)
	stop()
	if d, ok := ctx.Deadline(); ok && err != nil && !time.Now().Before(d) {
		<-ctx.Done() // the conn's deadline fired a moment before ctx's timer: report ctx's
	}
	if ctx.Err() != nil {
		conn.Close()
		return nil, fmt.Errorf("socks5: handshake with %s: %w: %w", proxyAddr, errdefs.ErrTimeout, context.Cause(ctx))
	}
	if err != nil {
		conn.Close()
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return nil, fmt.Errorf("socks5: handshake with %s: %w: %v", proxyAddr, errdefs.ErrTimeout, err)
		}
		if !classed(err) {
			err = fmt.Errorf("%w: %w", errdefs.ErrUpstream, err)
		}
		return nil, fmt.Errorf("socks5: via %s to %s: %w", proxyAddr, dest, err)
	}
	if err := conn.SetDeadline(time.Time{}); err != nil {
		conn.Close()
		return nil, fmt.Errorf("socks5: clear deadline: %w", err)
	}
	return conn, nil
}

// classed reports whether err already carries an errdefs class.
func classed(err error) bool {
	for _, c := range []error{errdefs.ErrDenied, errdefs.ErrUnavailable, errdefs.ErrTimeout, errdefs.ErrUpstream, errdefs.ErrInvalid} {
		if errors.Is(err, c) {
			return true
		}
	}
	return false
}

func handshake(conn io.ReadWriter, user, pass string, req []byte) error {
	method := byte(methodNoAuth)
	if user != "" {
		method = methodUserPass
	}
	if _, err := conn.Write([]byte{version, 1, method}); err != nil {
		return err
	}
	var b [2]byte
	if _, err := io.ReadFull(conn, b[:]); err != nil {
		return fmt.Errorf("read method: %w", err)
	}
	if b[0] != version {
		return fmt.Errorf("%w: proxy speaks version %d", errdefs.ErrUpstream, b[0])
	}
	switch b[1] {
	case method:
	case methodNone:
		return ErrAuthRefused
	default:
		return fmt.Errorf("%w: proxy chose method 0x%02x, not offered", errdefs.ErrUpstream, b[1])
	}
	if method == methodUserPass {
		msg := make([]byte, 0, 3+len(user)+len(pass))
		msg = append(msg, authVersion, byte(len(user)))
		msg = append(msg, user...)
		msg = append(msg, byte(len(pass)))
		msg = append(msg, pass...)
		if _, err := conn.Write(msg); err != nil {
			return err
		}
		if _, err := io.ReadFull(conn, b[:]); err != nil {
			return fmt.Errorf("read auth status: %w", err)
		}
		// RFC 1929 says version 1; some proxies echo 5.
		if b[0] != authVersion && b[0] != version {
			return fmt.Errorf("%w: auth reply version %d", errdefs.ErrUpstream, b[0])
		}
		if b[1] != 0 {
			return ErrAuthRefused
		}
	}
	if _, err := conn.Write(req); err != nil {
		return err
	}
	code, _, err := readReply(conn)
	if err != nil {
		return err
	}
	if code != ReplySucceeded {
		return &ReplyError{Code: code}
	}
	return nil
}

// connectRequest encodes CONNECT dest: an IP literal as such, anything
// else as a domain name for the proxy to resolve.
func connectRequest(dest string) ([]byte, error) {
	host, ps, err := net.SplitHostPort(dest)
	if err != nil {
		return nil, fmt.Errorf("socks5: destination %q: %w: %v", dest, errdefs.ErrInvalid, err)
	}
	port, err := strconv.ParseUint(ps, 10, 16)
	if err != nil || port == 0 {
		return nil, fmt.Errorf("socks5: destination %q: %w: bad port", dest, errdefs.ErrInvalid)
	}
	req := []byte{version, cmdConnect, 0}
	if ip, err := netip.ParseAddr(host); err == nil {
		if ip.Zone() != "" {
			return nil, fmt.Errorf("socks5: destination %q: %w: zoned address", dest, errdefs.ErrInvalid)
		}
		ip = ip.Unmap()
		if ip.Is4() {
			req = append(req, atypIPv4)
		} else {
			req = append(req, atypIPv6)
		}
		req = append(req, ip.AsSlice()...)
	} else {
		if host == "" || len(host) > 255 {
			return nil, fmt.Errorf("socks5: destination %q: %w: bad host length", dest, errdefs.ErrInvalid)
		}
		req = append(req, atypDomain, byte(len(host)))
		req = append(req, host...)
	}
	return append(req, byte(port>>8), byte(port)), nil
}

// readReply reads a CONNECT reply: VER REP RSV ATYP BND.ADDR BND.PORT. It
// reads exactly the reply's bytes, so whatever the proxy relays next stays
// in the connection. bound is the proxy's "addr:port".
func readReply(r io.Reader) (code byte, bound string, err error) {
	var h [4]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, "", fmt.Errorf("read reply: %w", err)
	}
	if h[0] != version {
		return 0, "", fmt.Errorf("%w: reply version %d", errdefs.ErrUpstream, h[0])
	}
	var host string
	switch h[3] {
	case atypIPv4, atypIPv6:
		n := 4
		if h[3] == atypIPv6 {
			n = 16
		}
		a := make([]byte, n)
		if _, err := io.ReadFull(r, a); err != nil {
			return 0, "", fmt.Errorf("read reply address: %w", err)
		}
		ip, _ := netip.AddrFromSlice(a)
		host = ip.String()
	case atypDomain:
		var l [1]byte
		if _, err := io.ReadFull(r, l[:]); err != nil {
			return 0, "", fmt.Errorf("read reply address: %w", err)
		}
		a := make([]byte, l[0])
		if _, err := io.ReadFull(r, a); err != nil {
			return 0, "", fmt.Errorf("read reply address: %w", err)
		}
		host = string(a)
	default:
		return 0, "", fmt.Errorf("%w: reply address type %d", errdefs.ErrUpstream, h[3])
	}
	var p [2]byte
	if _, err := io.ReadFull(r, p[:]); err != nil {
		return 0, "", fmt.Errorf("read reply port: %w", err)
	}
	return h[1], net.JoinHostPort(host, strconv.Itoa(int(p[0])<<8|int(p[1]))), nil
}
