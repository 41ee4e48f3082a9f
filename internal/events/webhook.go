package events

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strings"
	"syscall"
	"unicode/utf8"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
)

// Sign is the e2b-signature of body under secret, as E2B computes it: the
// unpadded standard base64 of SHA-256(secret || body).
func Sign(secret string, body []byte) string {
	h := sha256.New()
	h.Write([]byte(secret))
	h.Write(body)
	return base64.RawStdEncoding.EncodeToString(h.Sum(nil))
}

// SignatureVersion is the e2b-signature-version header's value.
const SignatureVersion = "v1"

// Bounds of a webhook registration.
const (
	MaxNameLen   = 256
	MaxURLLen    = 2048
	MinSecretLen = 8
	MaxSecretLen = 256
)

// Webhook is a registration as ValidateWebhook checks it.
type Webhook struct {
	Name    string
	URL     string
	Events  []string
	Secret  string
	Enabled bool
}

// ValidateWebhook checks a registration: a name, an http(s) URL whose host
// is not a private, loopback or link-local address (unless allowPrivate),
// known event types (at least one, no repeats) and a secret. Errors are
// errdefs.ErrInvalid.
func ValidateWebhook(w Webhook, allowPrivate bool) error {
	switch {
	case len(w.Name) > MaxNameLen || !utf8.ValidString(w.Name):
		return fmt.Errorf("%w: webhook name must be valid UTF-8 of at most %d bytes", errdefs.ErrInvalid, MaxNameLen)
	case len(w.Secret) < MinSecretLen || len(w.Secret) > MaxSecretLen:
		return fmt.Errorf("%w: signatureSecret must be %d..%d bytes", errdefs.ErrInvalid, MinSecretLen, MaxSecretLen)
	case len(w.Events) == 0:
		return fmt.Errorf("%w: events must name at least one event type", errdefs.ErrInvalid)
	case len(w.Events) > len(e2bapi.EventTypes):
		return fmt.Errorf("%w: too many event types", errdefs.ErrInvalid)
	}
	seen := map[string]bool{}
	for _, e := range w.Events {
		if !e2bapi.KnownEventType(e) {
			return fmt.Errorf("%w: unknown event type %q (known: %s)", errdefs.ErrInvalid, truncate(e, 64), strings.Join(e2bapi.EventTypes, ", "))
		}
		if seen[e] {
			return fmt.Errorf("%w: event type %q named twice", errdefs.ErrInvalid, e)
		}
		seen[e] = true
	}
	_, err := ParseWebhookURL(w.URL, allowPrivate)
	return err
}

// ParseWebhookURL parses a webhook URL: http or https, a host, no user
// information, no fragment. A host given as an IP address must be public
// unless allowPrivate; names are checked again at every delivery, on the
// address actually dialled. Errors are errdefs.ErrInvalid.
func ParseWebhookURL(raw string, allowPrivate bool) (*url.URL, error) {
	if raw == "" || len(raw) > MaxURLLen {
		return nil, fmt.Errorf("%w: webhook url must be 1..%d bytes", errdefs.ErrInvalid, MaxURLLen)
	}
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("%w: webhook url: %v", errdefs.ErrInvalid, err)
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, fmt.Errorf("%w: webhook url must be http or https", errdefs.ErrInvalid)
	case u.Hostname() == "":
		return nil, fmt.Errorf("%w: webhook url has no host", errdefs.ErrInvalid)
	case u.User != nil:
		return nil, fmt.Errorf("%w: webhook url must not carry credentials", errdefs.ErrInvalid)
	case u.Fragment != "" || u.Opaque != "":
		return nil, fmt.Errorf("%w: webhook url must not have a fragment", errdefs.ErrInvalid)
	}
	if p := u.Port(); p != "" {
		var n int
		if _, err := fmt.Sscanf(p, "%d", &n); err != nil || n < 1 || n > 65535 {
			return nil, fmt.Errorf("%w: webhook url port %q", errdefs.ErrInvalid, p)
		}
	}
	host := u.Hostname()
	if ip, err := netip.ParseAddr(host); err == nil {
		if !allowPrivate && !PublicAddr(ip) {
			return nil, fmt.Errorf("%w: webhook url names a non-public address %s", errdefs.ErrInvalid, ip)
		}
	} else if h := strings.ToLower(strings.TrimSuffix(host, ".")); !allowPrivate && (h == "localhost" || strings.HasSuffix(h, ".localhost")) {
		return nil, fmt.Errorf("%w: webhook url names localhost", errdefs.ErrInvalid)
	}
	return u, nil
}

// PublicAddr reports whether ip is a routable public unicast address: not
// loopback, private (RFC 1918, fc00::/7), link-local, CGNAT, multicast,
// unspecified or otherwise reserved.
func PublicAddr(ip netip.Addr) bool {
	ip = ip.Unmap()
	if !ip.IsValid() || ip.IsLoopback() || ip.IsPrivate() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() ||
		ip.IsInterfaceLocalMulticast() || ip.IsMulticast() || ip.IsUnspecified() {
		return false
	}
	for _, p := range reserved {
		if p.Contains(ip) {
			return false
		}
	}
	return true
}

var reserved = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),
	netip.MustParsePrefix("100.64.0.0/10"), // CGNAT
	netip.MustParsePrefix("192.0.0.0/24"),
	netip.MustParsePrefix("192.0.2.0/24"),
	netip.MustParsePrefix("198.18.0.0/15"),
	netip.MustParsePrefix("198.51.100.0/24"),
	netip.MustParsePrefix("203.0.113.0/24"),
	netip.MustParsePrefix("240.0.0.0/4"),
	netip.MustParsePrefix("64:ff9b::/96"),   // NAT64 reaches IPv4 inside
	netip.MustParsePrefix("64:ff9b:1::/48"), // local-use NAT64 (RFC 8215)
	netip.MustParsePrefix("2002::/16"),      // 6to4: an IPv4 address inside
	netip.MustParsePrefix("::/96"),          // IPv4-compatible (deprecated)
	netip.MustParsePrefix("2001:db8::/32"),
	netip.MustParsePrefix("fec0::/10"), // deprecated site-local
	netip.MustParsePrefix("100::/64"),  // discard
}

// dialControl refuses connections to non-public addresses: it runs on the
// address actually dialled, after name resolution, so a name that
// resolves (or is rebound) to a private address is refused too.
func dialControl(allowPrivate bool) func(network, address string, c syscall.RawConn) error {
	return func(network, address string, _ syscall.RawConn) error {
		if allowPrivate {
			return nil
		}
		ap, err := netip.ParseAddrPort(address)
		if err != nil {
			return fmt.Errorf("%w: webhook dial %q: %v", errdefs.ErrDenied, address, err)
		}
		if !PublicAddr(ap.Addr()) {
			return fmt.Errorf("%w: webhook url resolves to non-public address %s", errdefs.ErrDenied, ap.Addr())
		}
		return nil
	}
}

// newDialer is the dialer of webhook deliveries.
func newDialer(allowPrivate bool) func(ctx context.Context, network, addr string) (net.Conn, error) {
	d := &net.Dialer{Control: dialControl(allowPrivate)}
	return d.DialContext
}

// NewID returns a random UUID (version 4) for event, delivery and webhook
// ids.
func NewID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
