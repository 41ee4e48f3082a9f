package intercept

import (
	"bufio"
	"context"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/spacesbx/space/internal/errdefs"
)

// handshakeTimeout bounds each TLS handshake (the client's and the
// upstream's): the caller has already seen the ClientHello, so a client
// that stalls now is stalling on purpose. A variable for the tests.
var handshakeTimeout = 10 * time.Second

const (
	// maxHeaderBytes bounds a request's line and headers (net/http's
	// server allows 1 MiB; an API call needs far less).
	maxHeaderBytes = 64 << 10
	// maxResponseHeaderBytes bounds an upstream response's status line
	// and headers.
	maxResponseHeaderBytes = 1 << 20
	// maxInterim bounds the 1xx answers relayed before the final one.
	maxInterim = 16
	// errorWriteTimeout bounds writing an error response to a client that
	// may not be reading.
	errorWriteTimeout = 5 * time.Second
)

// Interceptor mints leaves from one sandbox's CA and serves intercepted
// connections. It is safe for concurrent use.
type Interceptor struct {
	ca     *x509.Certificate
	caKey  crypto.Signer
	roots  *x509.CertPool
	leaves *lru.Cache[string, *tls.Certificate]
	mintMu sync.Mutex // one mint at a time: a burst for one host mints once
}

// New parses the CA (certificate and key, PEM); roots verify upstream
// servers (nil = system roots).
func New(caCertPEM, caKeyPEM []byte, roots *x509.CertPool) (*Interceptor, error) {
	ca, key, err := parseCA(caCertPEM, caKeyPEM)
	if err != nil {
		return nil, err
	}
	leaves, err := lru.New[string, *tls.Certificate](leafCacheSize)
	if err != nil {
		return nil, fmt.Errorf("intercept: leaf cache: %w", err)
	}
	return &Interceptor{ca: ca, caKey: key, roots: roots, leaves: leaves}, nil
}

// leaf returns the cached leaf for host (normalized), minting it when
// absent or past half its life.
func (i *Interceptor) leaf(host string) (*tls.Certificate, error) {
	fresh := func(c *tls.Certificate) bool { return time.Now().Add(leafRenew).Before(c.Leaf.NotAfter) }
	if c, ok := i.leaves.Get(host); ok && fresh(c) {
		return c, nil
	}
	i.mintMu.Lock()
	defer i.mintMu.Unlock()
	if c, ok := i.leaves.Get(host); ok && fresh(c) {
		return c, nil
	}
	c, err := mintLeaf(i.ca, i.caKey, host, time.Now())
	if err != nil {
		return nil, err
	}
	i.leaves.Add(host, c)
	return c, nil
}

// Serve terminates the client's TLS with a leaf for host (ALPN http/1.1
// only) and forwards each HTTP/1.1 request on the connection to host over
// ONE upstream TLS connection made with dial and verified against the
// roots given to New. Each request's Host (port stripped, lower-case) must
// be host, else the client gets 421 and Serve stops (no domain fronting);
// headers[k] replaces header k. Bodies are streamed both ways; 1xx, chunked
// bodies, keep-alive and a 101 Upgrade (then raw bytes both ways) are
// handled. Serve returns when either side closes or ctx ends, and always
// closes client. It returns nil when a side closed between requests, else
// an error of class ErrInvalid (bad host or headers, a failed client
// handshake, a malformed request), ErrTooLarge (request header over 64
// KiB), ErrDenied (another Host), ErrUpstream (dial, verification or a
// broken answer: the client got a 502 when nothing else was sent yet),
// ErrTimeout (handshake), or ctx's error.
func (i *Interceptor) Serve(ctx context.Context, client net.Conn, host string, headers map[string]string,
	dial func(ctx context.Context) (net.Conn, error)) error {
	defer client.Close()
	h, err := normHost(host)
	if err != nil {
		return err
	}
	if err := checkHeaders(headers); err != nil {
		return err
	}
	headers = maps.Clone(headers) // read by the body goroutine too: the caller keeps its map
	cert, err := i.leaf(h)
	if err != nil {
		return err
	}
	tc := tls.Server(client, &tls.Config{
		Certificates: []tls.Certificate{*cert},
		NextProtos:   []string{"http/1.1"},
		MinVersion:   tls.VersionTLS12,
	})
	s := newSession(tc, client, h, headers)
	s.connect = func(ctx context.Context) (net.Conn, net.Conn, error) { return i.connectUpstream(ctx, h, dial) }
	stop := context.AfterFunc(ctx, s.abort)
	defer stop()

	hctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	err = tc.HandshakeContext(hctx)
	timedOut := errors.Is(hctx.Err(), context.DeadlineExceeded)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("intercept: client handshake for %s: %w", h, ctx.Err())
		}
		if timedOut {
			return fmt.Errorf("intercept: client handshake for %s: %w: %v", h, errdefs.ErrTimeout, err)
		}
		return fmt.Errorf("intercept: client handshake for %s: %w: %v", h, errdefs.ErrInvalid, err)
	}
	if p := tc.ConnectionState().NegotiatedProtocol; p != "" && p != "http/1.1" {
		return fmt.Errorf("intercept: client negotiated %q: %w", p, errdefs.ErrInvalid) // cannot happen: we offer http/1.1 only
	}
	err = s.serve(ctx)
	s.close()
	s.waitWatch()
	if ctx.Err() != nil && !errors.Is(err, ctx.Err()) {
		if err == nil {
			return ctx.Err()
		}
		err = fmt.Errorf("intercept: %s: %w (%v)", h, ctx.Err(), err)
	}
	return err
}

// connectUpstream dials and verifies host; it returns the TLS connection
// and the raw one under it (closed to abort at once).
func (i *Interceptor) connectUpstream(ctx context.Context, host string, dial func(ctx context.Context) (net.Conn, error)) (net.Conn, net.Conn, error) {
	raw, err := dial(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("intercept: dial %s: %w: %v", host, errdefs.ErrUpstream, err)
	}
	tc := tls.Client(raw, &tls.Config{
		ServerName: host,
		RootCAs:    i.roots,
		NextProtos: []string{"http/1.1"},
		MinVersion: tls.VersionTLS12,
	})
	hctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	defer cancel()
	if err := tc.HandshakeContext(hctx); err != nil {
		raw.Close()
		return nil, nil, fmt.Errorf("intercept: upstream handshake with %s: %w: %v", host, errdefs.ErrUpstream, err)
	}
	return tc, raw, nil
}

// checkHeaders refuses header names that are not HTTP tokens and values
// that could end the header line: the transform is the platform's, but a
// value with a CR LF would let it write a request of its own.
func checkHeaders(headers map[string]string) error {
	for k, v := range headers {
		if k == "" {
			return fmt.Errorf("intercept: empty header name: %w", errdefs.ErrInvalid)
		}
		for _, c := range []byte(k) {
			if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
				return fmt.Errorf("intercept: header name %q: %w", k, errdefs.ErrInvalid)
			}
		}
		if strings.ContainsAny(v, "\r\n\x00") {
			return fmt.Errorf("intercept: value of header %q: %w: control character", k, errdefs.ErrInvalid)
		}
		if http.CanonicalHeaderKey(k) == "Host" {
			return fmt.Errorf("intercept: header %q: %w: the host is the connection's", k, errdefs.ErrInvalid)
		}
	}
	return nil
}

// session is one intercepted client connection.
type session struct {
	host    string
	headers map[string]string
	// connect makes the upstream connection (TLS, raw under it).
	connect func(ctx context.Context) (net.Conn, net.Conn, error)

	client    net.Conn // the TLS side
	clientRaw net.Conn
	lr        *limitedReader
	cbr       *bufio.Reader
	cbw       *bufio.Writer

	up, upRaw net.Conn
	ulr       *limitedReader
	ubr       *bufio.Reader
	ubw       *bufio.Writer

	mu      sync.Mutex
	aborted bool
	// Between requests a watcher peeks at the upstream: a server that
	// closes an idle connection (or sends what nobody asked for) ends
	// the client's too, so the client reconnects instead of sending its
	// next request into a dead connection.
	watch    chan error // the watcher's result; nil when none runs
	inFlight bool       // a request is being forwarded
	upGone   bool       // the watcher saw the upstream end while idle
}

func newSession(client, clientRaw net.Conn, host string, headers map[string]string) *session {
	lr := &limitedReader{r: client}
	return &session{
		host: host, headers: headers,
		client: client, clientRaw: clientRaw,
		lr: lr, cbr: bufio.NewReader(lr), cbw: bufio.NewWriter(client),
	}
}

// abort closes both raw connections at once (ctx ended, or one side broke
// mid-exchange), unblocking every read and write.
func (s *session) abort() {
	s.mu.Lock()
	s.aborted = true
	up := s.upRaw
	s.mu.Unlock()
	s.clientRaw.Close()
	if up != nil {
		up.Close()
	}
}

// close ends the session in order: TLS close_notify to each side (bounded
// by tls' own 5 s), then the raw connections.
func (s *session) close() {
	s.mu.Lock()
	up, upRaw := s.up, s.upRaw
	s.mu.Unlock()
	if up != nil {
		up.Close()
		upRaw.Close()
	}
	s.client.Close()
	s.clientRaw.Close()
}

// startWatch runs the idle watcher after a request that leaves both
// connections open.
func (s *session) startWatch() {
	s.mu.Lock()
	s.inFlight = false
	s.mu.Unlock()
	s.watch = make(chan error, 1)
	go func() {
		_, err := s.ubr.Peek(1)
		s.mu.Lock()
		idle := !s.inFlight
		if idle {
			s.upGone = true
		}
		s.mu.Unlock()
		if idle {
			s.abort()
		}
		s.watch <- err
	}()
}

// waitWatch takes over the upstream reader from the watcher: it returns
// once the upstream has sent something (nil) or ended (its error).
func (s *session) waitWatch() error {
	if s.watch == nil {
		return nil
	}
	err := <-s.watch
	s.watch = nil
	return err
}

// beginRequest marks a request in flight; false when the watcher has
// already found the upstream gone.
func (s *session) beginRequest() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inFlight = true
	return !s.upGone
}

func (s *session) upstreamGone() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.upGone
}

// ensureUpstream connects on the first forwarded request, so a connection
// refused before that never reaches the server.
func (s *session) ensureUpstream(ctx context.Context) error {
	if s.up != nil {
		return nil
	}
	up, raw, err := s.connect(ctx)
	if err != nil {
		return err
	}
	s.mu.Lock()
	aborted := s.aborted
	s.up, s.upRaw = up, raw
	s.mu.Unlock()
	if aborted {
		raw.Close()
		return fmt.Errorf("intercept: %s: %w", s.host, context.Canceled)
	}
	s.ulr = &limitedReader{r: up}
	s.ubr, s.ubw = bufio.NewReader(s.ulr), bufio.NewWriter(up)
	return nil
}

// fail answers the client with an error status and no body; the
// connection ends after it.
func (s *session) fail(code int) {
	_ = s.clientRaw.SetWriteDeadline(time.Now().Add(errorWriteTimeout))
	fmt.Fprintf(s.cbw, "HTTP/1.1 %03d %s\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", code, http.StatusText(code))
	_ = s.cbw.Flush()
}

// errHeaderTooLarge is what limitedReader returns past its limit.
var errHeaderTooLarge = errors.New("request header too large")

// limitedReader bounds what the request parser may read; n is reset per
// request (not shared with another goroutine while a header is read).
type limitedReader struct {
	r         interface{ Read([]byte) (int, error) }
	n         int64
	unlimited bool
}

func (l *limitedReader) Read(p []byte) (int, error) {
	if l.unlimited {
		return l.r.Read(p)
	}
	if l.n <= 0 {
		return 0, errHeaderTooLarge
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.r.Read(p)
	l.n -= int64(n)
	return n, err
}
