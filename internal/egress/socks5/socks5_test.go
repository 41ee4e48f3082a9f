package socks5

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/internal/errdefs"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// server is a minimal SOCKS5 proxy on loopback. It connects only to the
// test's echo listener, whatever the request names.
type server struct {
	t          *testing.T
	ln         net.Listener
	user, pass string // user != "": require user/pass
	reply      byte   // non-zero: refuse every CONNECT with it
	silent     bool   // read and never answer
	extra      []byte // sent in the same write as the success reply
	echo       string // address of the echo server

	mu    sync.Mutex
	dests []string
	wg    sync.WaitGroup
	conns []net.Conn
}

func newServer(t *testing.T, s *server) *server {
	t.Helper()
	s.t = t
	var err error
	if s.ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	s.echo = startEcho(t)
	s.wg.Add(1)
	go s.accept()
	t.Cleanup(func() {
		s.ln.Close()
		s.mu.Lock()
		for _, c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *server) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns = append(s.conns, c)
		s.mu.Unlock()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer c.Close()
			s.handle(c)
		}()
	}
}

func (s *server) handle(c net.Conn) {
	if s.silent {
		_, _ = io.Copy(io.Discard, c)
		return
	}
	var h [2]byte
	if _, err := io.ReadFull(c, h[:]); err != nil || h[0] != 5 {
		return
	}
	methods := make([]byte, h[1])
	if _, err := io.ReadFull(c, methods); err != nil {
		return
	}
	want := byte(0)
	if s.user != "" {
		want = 2
	}
	if !bytes.Contains(methods, []byte{want}) {
		c.Write([]byte{5, 0xff})
		return
	}
	c.Write([]byte{5, want})
	if want == 2 {
		var v [2]byte
		if _, err := io.ReadFull(c, v[:]); err != nil {
			return
		}
		u := make([]byte, v[1])
		io.ReadFull(c, u)
		var pl [1]byte
		io.ReadFull(c, pl[:])
		p := make([]byte, pl[0])
		if _, err := io.ReadFull(c, p); err != nil {
			return
		}
		if string(u) != s.user || string(p) != s.pass {
			c.Write([]byte{1, 1})
			return
		}
		c.Write([]byte{1, 0})
	}
	var r [4]byte
	if _, err := io.ReadFull(c, r[:]); err != nil || r[1] != 1 {
		return
	}
	var host string
	switch r[3] {
	case 1, 4:
		a := make([]byte, 4)
		if r[3] == 4 {
			a = make([]byte, 16)
		}
		io.ReadFull(c, a)
		ip, _ := netip.AddrFromSlice(a)
		host = ip.String()
	case 3:
		var l [1]byte
		io.ReadFull(c, l[:])
		a := make([]byte, l[0])
		io.ReadFull(c, a)
		host = string(a)
	}
	var p [2]byte
	if _, err := io.ReadFull(c, p[:]); err != nil {
		return
	}
	s.mu.Lock()
	s.dests = append(s.dests, net.JoinHostPort(host, strconv.Itoa(int(p[0])<<8|int(p[1]))))
	s.mu.Unlock()
	if s.reply != 0 {
		c.Write([]byte{5, s.reply, 0, 1, 0, 0, 0, 0, 0, 0})
		return
	}
	up, err := net.Dial("tcp", s.echo)
	if err != nil {
		c.Write([]byte{5, ReplyConnectionRefused, 0, 1, 0, 0, 0, 0, 0, 0})
		return
	}
	defer up.Close()
	c.Write(append([]byte{5, 0, 0, 3, 9, 'p', 'r', 'o', 'x', 'y', '.', 't', 's', 't', 0x1f, 0x90}, s.extra...))
	go func() { io.Copy(up, c); up.(*net.TCPConn).CloseWrite() }()
	io.Copy(c, up)
}

func (s *server) lastDest() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.dests) == 0 {
		return ""
	}
	return s.dests[len(s.dests)-1]
}

func startEcho(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				io.Copy(c, c)
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return ln.Addr().String()
}

var dialer = (&net.Dialer{}).DialContext

func echoThrough(t *testing.T, c net.Conn) {
	t.Helper()
	defer c.Close()
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	c.(*net.TCPConn).CloseWrite()
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "hello" {
		t.Fatalf("echo through proxy: %q, %v", got, err)
	}
}

func TestDialNoAuth(t *testing.T) {
	s := newServer(t, &server{})
	c, err := Dial(context.Background(), dialer, s.ln.Addr().String(), "", "", "192.0.2.7:443")
	if err != nil {
		t.Fatal(err)
	}
	if d := s.lastDest(); d != "192.0.2.7:443" {
		t.Fatalf("proxy was asked for %q", d)
	}
	echoThrough(t, c)
}

func TestDialUserPassDomainAndIPv6(t *testing.T) {
	s := newServer(t, &server{user: "alice", pass: "s3cret"})
	c, err := Dial(context.Background(), dialer, s.ln.Addr().String(), "alice", "s3cret", "api.example.com:8443")
	if err != nil {
		t.Fatal(err)
	}
	if d := s.lastDest(); d != "api.example.com:8443" {
		t.Fatalf("proxy was asked for %q", d)
	}
	echoThrough(t, c)
	c, err = Dial(context.Background(), dialer, s.ln.Addr().String(), "alice", "s3cret", "[2001:db8::1]:80")
	if err != nil {
		t.Fatal(err)
	}
	if d := s.lastDest(); d != "[2001:db8::1]:80" {
		t.Fatalf("proxy was asked for %q", d)
	}
	c.Close()
}

func TestDialAuthRefused(t *testing.T) {
	s := newServer(t, &server{user: "alice", pass: "s3cret"})
	for _, tc := range []struct{ name, user, pass string }{
		{"wrong password", "alice", "guess"},
		{"wrong user", "bob", "s3cret"},
		{"no credentials", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Dial(context.Background(), dialer, s.ln.Addr().String(), tc.user, tc.pass, "192.0.2.7:443")
			if err == nil {
				c.Close()
				t.Fatal("dial succeeded")
			}
			if !errors.Is(err, ErrAuthRefused) || !errors.Is(err, errdefs.ErrDenied) {
				t.Fatalf("error %v: want ErrAuthRefused (denied)", err)
			}
			if s.lastDest() != "" {
				t.Fatalf("a CONNECT was sent after a refused auth: %q", s.lastDest())
			}
		})
	}
}

func TestDialReplyCodes(t *testing.T) {
	for _, tc := range []struct {
		code  byte
		class error
	}{
		{ReplyGeneralFailure, errdefs.ErrUnavailable},
		{ReplyNotAllowed, errdefs.ErrDenied},
		{ReplyNetworkUnreachable, errdefs.ErrUnavailable},
		{ReplyHostUnreachable, errdefs.ErrUnavailable},
		{ReplyConnectionRefused, errdefs.ErrUnavailable},
		{ReplyTTLExpired, errdefs.ErrTimeout},
		{ReplyCommandNotSupported, errdefs.ErrUpstream},
		{ReplyAddrNotSupported, errdefs.ErrUpstream},
		{0x42, errdefs.ErrUpstream},
	} {
		s := newServer(t, &server{reply: tc.code})
		c, err := Dial(context.Background(), dialer, s.ln.Addr().String(), "", "", "192.0.2.7:443")
		if err == nil {
			c.Close()
			t.Fatalf("code %#x: dial succeeded", tc.code)
		}
		var re *ReplyError
		if !errors.As(err, &re) || re.Code != tc.code || !errors.Is(err, tc.class) {
			t.Fatalf("code %#x: error %v: want ReplyError of class %v", tc.code, err, tc.class)
		}
	}
}

func TestDialKeepsBytesAfterReply(t *testing.T) {
	s := newServer(t, &server{extra: []byte("early")})
	c, err := Dial(context.Background(), dialer, s.ln.Addr().String(), "", "", "192.0.2.7:443")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 5)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "early" {
		t.Fatalf("read after reply: %q, %v", buf, err)
	}
}

func TestDialHonorsContext(t *testing.T) {
	s := newServer(t, &server{silent: true})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	c, err := Dial(ctx, dialer, s.ln.Addr().String(), "", "", "192.0.2.7:443")
	if err == nil {
		c.Close()
		t.Fatal("dial succeeded against a silent proxy")
	}
	if !errors.Is(err, errdefs.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("error %v: want timeout + deadline exceeded", err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("handshake took %v past a 200ms deadline", el)
	}

	// Cancellation without a deadline interrupts the handshake too.
	ctx, cancel = context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	start = time.Now()
	c, err = Dial(ctx, dialer, s.ln.Addr().String(), "alice", "pw", "192.0.2.7:443")
	if err == nil {
		c.Close()
		t.Fatal("dial succeeded against a silent proxy")
	}
	if !errors.Is(err, context.Canceled) || time.Since(start) > 2*time.Second {
		t.Fatalf("error %v after %v: want a prompt cancellation", err, time.Since(start))
	}
}

func TestDialInvalidInput(t *testing.T) {
	dials := 0
	count := func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials++
		return nil, errors.New("must not dial")
	}
	long := string(bytes.Repeat([]byte("a"), 256))
	for _, tc := range []struct{ user, pass, dest string }{
		{"", "", "no-port"},
		{"", "", "host:0"},
		{"", "", "host:65536"},
		{"", "", "host:http"},
		{"", "", ":443"},
		{"", "", "[fe80::1%eth0]:443"},
		{"", "", long + ":443"},
		{long, "pw", "host:443"},
		{"u", long, "host:443"},
		{"", "pw", "host:443"},
	} {
		_, err := Dial(context.Background(), count, "127.0.0.1:1080", tc.user, tc.pass, tc.dest)
		if !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("Dial(user %d bytes, dest %.20q): %v, want invalid", len(tc.user), tc.dest, err)
		}
	}
	if dials != 0 {
		t.Fatalf("invalid input dialed the proxy %d times", dials)
	}
}

func TestDialBrokenProxies(t *testing.T) {
	for name, answer := range map[string][]byte{
		"closes at once":      nil,
		"wrong version":       {4, 0},
		"unoffered method":    {5, 2},
		"truncated reply":     {5, 0, 5, 0, 0, 1, 1},
		"reply wrong version": {5, 0, 4, 0, 0, 1, 0, 0, 0, 0, 0, 0},
		"reply bad atyp":      {5, 0, 5, 0, 0, 9, 0, 0, 0, 0, 0, 0},
	} {
		t.Run(name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			done := make(chan struct{})
			go func() {
				defer close(done)
				c, err := ln.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(5 * time.Second))
				io.ReadFull(c, make([]byte, 3))
				if answer == nil {
					return
				}
				c.Write(answer)
				io.ReadFull(c, make([]byte, 10)) // the CONNECT, if any
			}()
			c, err := Dial(context.Background(), dialer, ln.Addr().String(), "", "", "192.0.2.7:443")
			if err == nil {
				c.Close()
				t.Fatal("dial succeeded")
			}
			if !errors.Is(err, errdefs.ErrUpstream) {
				t.Fatalf("error %v: want upstream", err)
			}
			<-done
		})
	}
}

func FuzzReadReply(f *testing.F) {
	f.Add([]byte{5, 0, 0, 1, 127, 0, 0, 1, 0x1f, 0x90})
	f.Add([]byte{5, 5, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 80})
	f.Add([]byte{5, 0, 0, 3, 3, 'a', '.', 'b', 1, 187})
	f.Add([]byte{5, 0, 0, 3, 255})
	f.Add([]byte{5, 0, 0, 9})
	f.Fuzz(func(t *testing.T, data []byte) {
		r := bytes.NewReader(data)
		code, bound, err := readReply(r)
		if err != nil {
			if !errors.Is(err, errdefs.ErrUpstream) && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Fatalf("error %v is neither upstream nor a short read", err)
			}
			return
		}
		if code != data[1] {
			t.Fatalf("code %d, byte says %d", code, data[1])
		}
		consumed := len(data) - r.Len()
		want := 4 + 2
		var host string
		switch data[3] {
		case 1, 4:
			n := 4
			if data[3] == 4 {
				n = 16
			}
			want += n
			ip, _ := netip.AddrFromSlice(data[4 : 4+n])
			host = ip.String()
		case 3:
			want += 1 + int(data[4])
			host = string(data[5 : 5+int(data[4])]) // informational: kept as sent
		}
		if consumed != want {
			t.Fatalf("consumed %d bytes of a %d-byte reply", consumed, want)
		}
		port := strconv.Itoa(int(data[want-2])<<8 | int(data[want-1]))
		if bound != net.JoinHostPort(host, port) {
			t.Fatalf("bound %q, want %q", bound, net.JoinHostPort(host, port))
		}
	})
}

// script is a proxy that answers with fixed bytes and swallows writes.
type script struct{ r io.Reader }

func (s script) Read(p []byte) (int, error)  { return s.r.Read(p) }
func (s script) Write(p []byte) (int, error) { return len(p), nil }

func FuzzHandshake(f *testing.F) {
	f.Add([]byte{5, 0, 5, 0, 0, 1, 127, 0, 0, 1, 0, 80}, false)
	f.Add([]byte{5, 2, 1, 0, 5, 0, 0, 3, 1, 'a', 0, 80}, true)
	f.Add([]byte{5, 2, 1, 1}, true)
	f.Add([]byte{5, 0xff}, false)
	f.Add([]byte{5, 0, 5, 2, 0, 1, 0, 0, 0, 0, 0, 0}, false)
	f.Fuzz(func(t *testing.T, answer []byte, auth bool) {
		user, pass := "", ""
		if auth {
			user, pass = "u", "p"
		}
		req, _ := connectRequest("192.0.2.1:443")
		err := handshake(script{bytes.NewReader(answer)}, user, pass, req)
		if err == nil {
			want := []byte{5, 0}
			if auth {
				want = []byte{5, 2}
			}
			if !bytes.HasPrefix(answer, want) {
				t.Fatalf("success on %x", answer)
			}
			return
		}
		if !classed(err) && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("unclassed error %v", err)
		}
	})
}
