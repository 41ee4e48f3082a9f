package intercept

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"
)

// halfConn is an in-memory connection with a write side that closes on
// its own (CloseWrite), like TCP's.
type halfConn struct {
	r *io.PipeReader
	w *io.PipeWriter
}

// connPair returns two ends of an in-memory connection.
func connPair() (*halfConn, *halfConn) {
	ar, bw := io.Pipe()
	br, aw := io.Pipe()
	return &halfConn{r: ar, w: aw}, &halfConn{r: br, w: bw}
}

func (c *halfConn) Read(p []byte) (int, error)  { return c.r.Read(p) }
func (c *halfConn) Write(p []byte) (int, error) { return c.w.Write(p) }
func (c *halfConn) CloseWrite() error           { return c.w.Close() }
func (c *halfConn) Close() error {
	c.w.Close()
	return c.r.Close()
}
func (c *halfConn) LocalAddr() net.Addr                { return &net.TCPAddr{} }
func (c *halfConn) RemoteAddr() net.Addr               { return &net.TCPAddr{} }
func (c *halfConn) SetDeadline(t time.Time) error      { return nil }
func (c *halfConn) SetReadDeadline(t time.Time) error  { return nil }
func (c *halfConn) SetWriteDeadline(t time.Time) error { return nil }

// FuzzSession feeds arbitrary bytes as the client's decrypted stream and
// as the upstream's. The session must end (no hang, no panic), and what
// reaches the upstream must start with a request for the connection's
// host carrying the transformed header.
func FuzzSession(f *testing.F) {
	f.Add([]byte("GET / HTTP/1.1\r\nHost: example.com\r\n\r\n"), []byte("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
	f.Add([]byte("POST /u HTTP/1.1\r\nHost: example.com\r\nTransfer-Encoding: chunked\r\nTrailer: X-Api-Key\r\n\r\n3\r\nabc\r\n0\r\nX-Api-Key: mine\r\n\r\nGET /2 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"),
		[]byte("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n"))
	f.Add([]byte("GET /ws HTTP/1.1\r\nHost: example.com\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nraw client bytes"),
		[]byte("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\nraw server bytes"))
	f.Add([]byte("GET / HTTP/1.1\r\nHost: evil.example.net\r\n\r\n"), []byte("HTTP/1.1 200 OK\r\n\r\n"))
	f.Add([]byte("HEAD / HTTP/1.0\r\nHost: example.com\r\n\r\n"), []byte("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"))
	f.Add([]byte("GET / HTTP/1.1\r\nHost: example.com\r\n\r\n"), []byte("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil close"))
	f.Fuzz(func(t *testing.T, clientIn, upstreamIn []byte) {
		cs, cc := connPair()
		us, uc := connPair()
		s := newSession(cs, cs, testHost, map[string]string{"X-Api-Key": "k"})
		s.connect = func(context.Context) (net.Conn, net.Conn, error) { return us, us, nil }

		var wg sync.WaitGroup
		var received bytes.Buffer
		wg.Add(4)
		go func() { defer wg.Done(); cc.Write(clientIn); cc.CloseWrite() }()
		go func() { defer wg.Done(); io.Copy(io.Discard, cc) }()
		go func() { defer wg.Done(); uc.Write(upstreamIn); uc.CloseWrite() }()
		go func() { defer wg.Done(); io.Copy(&received, uc) }()

		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan struct{})
		go func() {
			defer close(done)
			s.serve(ctx)
			s.close()
		}()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("session did not end")
		}
		cc.Close()
		uc.Close()
		us.Close()
		wg.Wait()

		if received.Len() == 0 {
			return
		}
		req, err := http.ReadRequest(bufio.NewReader(&received))
		if err != nil {
			t.Fatalf("upstream got something that is not a request: %v: %q", err, received.Bytes())
		}
		if requestHost(req.Host) != testHost || req.Header.Get("X-Api-Key") != "k" || len(req.Header.Values("X-Api-Key")) != 1 {
			t.Fatalf("upstream got a request for %q with key %q", req.Host, req.Header.Values("X-Api-Key"))
		}
	})
}
