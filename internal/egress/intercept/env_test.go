package intercept

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// testHost is a name the httptest certificate is valid for.
const testHost = "example.com"

// env is an upstream httptest TLS server, an Interceptor and a loopback
// listener whose every connection is handed to Serve.
type env struct {
	t       *testing.T
	caPool  *x509.CertPool
	icpt    *Interceptor
	up      *httptest.Server
	ln      net.Listener
	headers map[string]string

	upConns  atomic.Int32 // connections the upstream accepted
	dials    atomic.Int32 // calls of Serve's dial
	accepted atomic.Int32 // client connections
	errs     chan error   // one Serve result per client connection

	ctx     context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	closeMu sync.Once
}

type envOpt func(*envConfig)

type envConfig struct {
	roots   func(up *httptest.Server) *x509.CertPool
	headers map[string]string
	server  func(*http.Server)
	dial    func(ctx context.Context, upAddr string) (net.Conn, error)
}

func withServer(f func(*http.Server)) envOpt { return func(c *envConfig) { c.server = f } }

func withDial(f func(ctx context.Context, upAddr string) (net.Conn, error)) envOpt {
	return func(c *envConfig) { c.dial = f }
}

func withRoots(f func(up *httptest.Server) *x509.CertPool) envOpt {
	return func(c *envConfig) { c.roots = f }
}

func newEnv(t *testing.T, h http.Handler, opts ...envOpt) *env {
	t.Helper()
	cfg := envConfig{
		roots: func(up *httptest.Server) *x509.CertPool {
			p := x509.NewCertPool()
			p.AddCert(up.Certificate())
			return p
		},
		headers: map[string]string{"X-Api-Key": "k-123", "Authorization": "Bearer platform-secret"},
	}
	for _, o := range opts {
		o(&cfg)
	}
	e := &env{t: t, headers: cfg.headers, errs: make(chan error, 64)}
	e.up = httptest.NewUnstartedServer(h)
	e.up.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			e.upConns.Add(1)
		}
	}
	e.up.Config.ErrorLog = log.New(io.Discard, "", 0) // handshakes the tests make fail on purpose
	if cfg.server != nil {
		cfg.server(e.up.Config)
	}
	e.up.StartTLS()

	certPEM, keyPEM, err := NewCA("sbx-test")
	if err != nil {
		t.Fatal(err)
	}
	if e.icpt, err = New(certPEM, keyPEM, cfg.roots(e.up)); err != nil {
		t.Fatal(err)
	}
	e.caPool = x509.NewCertPool()
	if !e.caPool.AppendCertsFromPEM(certPEM) {
		t.Fatal("CA PEM not accepted")
	}
	if e.ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	e.ctx, e.cancel = context.WithCancel(context.Background())
	dial := func(ctx context.Context) (net.Conn, error) {
		e.dials.Add(1)
		if cfg.dial != nil {
			return cfg.dial(ctx, e.up.Listener.Addr().String())
		}
		var d net.Dialer
		return d.DialContext(ctx, "tcp", e.up.Listener.Addr().String())
	}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		for {
			c, err := e.ln.Accept()
			if err != nil {
				return
			}
			e.accepted.Add(1)
			e.wg.Add(1)
			go func() {
				defer e.wg.Done()
				e.errs <- e.icpt.Serve(e.ctx, c, testHost, e.headers, dial)
			}()
		}
	}()
	t.Cleanup(e.close)
	return e
}

// close stops everything the env started and waits for it.
func (e *env) close() {
	e.closeMu.Do(func() {
		e.cancel()
		e.ln.Close()
		e.wg.Wait()
		e.up.Close()
	})
}

// serveErr waits for the next Serve result.
func (e *env) serveErr() error {
	e.t.Helper()
	select {
	case err := <-e.errs:
		return err
	case <-time.After(10 * time.Second):
		e.t.Fatal("Serve did not return")
		return nil
	}
}

// client is an HTTP/1.1 client that trusts only the sandbox CA and dials
// the interceptor whatever the URL says.
func (e *env) client() *http.Client {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", e.ln.Addr().String())
		},
		TLSClientConfig:       &tls.Config{RootCAs: e.caPool, ServerName: testHost},
		ExpectContinueTimeout: 5 * time.Second,
	}
	e.t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

// rawTLS is a TLS connection to the interceptor for hand-written requests.
func (e *env) rawTLS(protos ...string) (*tls.Conn, *bufio.Reader, error) {
	c, err := net.Dial("tcp", e.ln.Addr().String())
	if err != nil {
		return nil, nil, err
	}
	tc := tls.Client(c, &tls.Config{RootCAs: e.caPool, ServerName: testHost, NextProtos: protos})
	tc.SetDeadline(time.Now().Add(20 * time.Second))
	if err := tc.Handshake(); err != nil {
		c.Close()
		return nil, nil, err
	}
	e.t.Cleanup(func() { tc.Close() })
	return tc, bufio.NewReader(tc), nil
}

func readResp(t *testing.T, br *bufio.Reader, method string) *http.Response {
	t.Helper()
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		t.Fatalf("read response: %v", err)
	}
	return resp
}

func poolOf(t *testing.T, pemCerts ...[]byte) *x509.CertPool {
	t.Helper()
	p := x509.NewCertPool()
	for _, c := range pemCerts {
		if !p.AppendCertsFromPEM(c) {
			t.Fatal("bad PEM")
		}
	}
	return p
}
