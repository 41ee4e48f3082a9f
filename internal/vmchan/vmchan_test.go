package vmchan

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/internal/vmchan/vmchantest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// guest is a Listener on a port plus an echo/handler loop.
type guest struct {
	port *vmchantest.Port
	l    *Listener
	mu   sync.Mutex
	acts [][]byte
}

func newGuest(t *testing.T, handle func(net.Conn)) *guest {
	t.Helper()
	g := &guest{port: &vmchantest.Port{}}
	g.l = NewListener(g.port, ListenerConfig{Logger: quiet, PollInterval: 5 * time.Millisecond,
		Activate: func(sid SessionID, p []byte) ([]byte, error) {
			if bytes.HasPrefix(p, []byte("refuse")) {
				return nil, errors.New("refused: " + string(p))
			}
			g.mu.Lock()
			g.acts = append(g.acts, append([]byte(nil), p...))
			g.mu.Unlock()
			return append([]byte("id:"), p...), nil
		}})
	g.l.Start()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var hw sync.WaitGroup
		defer hw.Wait()
		for {
			c, err := g.l.Accept()
			if err != nil {
				return
			}
			hw.Add(1)
			go func() { defer hw.Done(); defer c.Close(); handle(c) }()
		}
	}()
	t.Cleanup(func() { g.l.Close(); wg.Wait() })
	return g
}

func echo(c net.Conn) { io.Copy(c, c) }

// connect attaches a new host connection to g's port and runs the
// handshake with activation act.
func connect(t *testing.T, g *guest, act string) *Client {
	t.Helper()
	h, gside := vmchantest.Socketpair(t)
	g.port.Attach(gside)
	c, err := NewClient(context.Background(), h, ClientConfig{Activation: []byte(act), Logger: quiet,
		ResendInterval: 50 * time.Millisecond, BootTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func roundTrip(t *testing.T, c *Client, msg []byte) {
	t.Helper()
	s, err := c.Open(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	errc := make(chan error, 1)
	go func() {
		_, err := s.Write(msg)
		if err == nil {
			err = s.(*Stream).CloseWrite()
		}
		errc <- err
	}()
	got, err := io.ReadAll(s)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, msg) {
		t.Fatalf("echo of %d bytes returned %d bytes", len(msg), len(got))
	}
}

func TestHandshakeAndEcho(t *testing.T) {
	g := newGuest(t, echo)
	c := connect(t, g, `{"a":1}`)
	if string(c.Ack()) != `id:{"a":1}` {
		t.Fatalf("ack %q", c.Ack())
	}
	roundTrip(t, c, []byte("hello"))
	big := make([]byte, 3*InitialWindow+123)
	rand.Read(big)
	roundTrip(t, c, big)
}

func TestManyConcurrentStreams(t *testing.T) {
	g := newGuest(t, echo)
	c := connect(t, g, "{}")
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msg := bytes.Repeat([]byte{byte(i)}, 1000+i*5000)
			roundTrip(t, c, msg)
		}()
	}
	wg.Wait()
}

// A stream whose reader stalls uses up its window; other streams go on.
func TestStalledReaderDoesNotBlockOthers(t *testing.T) {
	release := make(chan struct{})
	g := newGuest(t, func(c net.Conn) {
		var first [1]byte
		if _, err := io.ReadFull(c, first[:]); err != nil {
			return
		}
		if first[0] == 's' {
			<-release // stall
		}
		c.Write(first[:])
		io.Copy(c, c)
	})
	c := connect(t, g, "{}")
	stalled, _ := c.Open(context.Background())
	defer stalled.Close()
	wrote := make(chan error, 1)
	go func() {
		_, err := stalled.Write(append([]byte("s"), make([]byte, 2*InitialWindow)...))
		wrote <- err
	}()
	time.Sleep(100 * time.Millisecond)
	select {
	case err := <-wrote:
		t.Fatalf("write beyond the window did not block: %v", err)
	default:
	}
	for range 5 {
		roundTrip(t, c, []byte("other stream"))
	}
	close(release)
	go io.Copy(io.Discard, stalled)
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
}

func TestHalfCloseAndReset(t *testing.T) {
	g := newGuest(t, func(c net.Conn) {
		b, _ := io.ReadAll(c) // until the host's FIN
		if string(b) == "no-read" {
			return
		}
		c.Write(append([]byte("got "), b...))
	})
	c := connect(t, g, "{}")
	s, _ := c.Open(context.Background())
	s.Write([]byte("abc"))
	s.(*Stream).CloseWrite()
	if _, err := s.Write([]byte("x")); !errors.Is(err, ErrWriteClosed) {
		t.Fatalf("write after CloseWrite: %v", err)
	}
	got, err := io.ReadAll(s)
	if err != nil || string(got) != "got abc" {
		t.Fatalf("%q %v", got, err)
	}
	s.Close()

	// The guest closes without reading everything: the host's further
	// writes fail with a reset.
	g2 := newGuest(t, func(c net.Conn) {})
	c2 := connect(t, g2, "{}")
	s2, _ := c2.Open(context.Background())
	defer s2.Close()
	var err2 error
	deadline := time.Now().Add(5 * time.Second)
	for err2 == nil && time.Now().Before(deadline) {
		_, err2 = s2.Write([]byte("data"))
		time.Sleep(5 * time.Millisecond)
	}
	var re *ResetError
	if !errors.As(err2, &re) || re.Code != CodeClosed {
		t.Fatalf("write to a closed stream: %v", err2)
	}
	if _, err := io.ReadAll(s2); err != nil {
		t.Fatalf("read after the peer's FIN+RESET: %v", err)
	}
}

func TestDeadlines(t *testing.T) {
	g := newGuest(t, func(c net.Conn) { io.Copy(io.Discard, c) })
	c := connect(t, g, "{}")
	s, _ := c.Open(context.Background())
	defer s.Close()
	s.SetReadDeadline(time.Now().Add(30 * time.Millisecond))
	_, err := s.Read(make([]byte, 1))
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("read past deadline: %v", err)
	}
	s.SetReadDeadline(time.Time{})
	s.SetReadDeadline(time.Unix(1, 0))
	if _, err := s.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read with a past deadline: %v", err)
	}
}

func TestActivationRefused(t *testing.T) {
	g := newGuest(t, echo)
	h, gside := vmchantest.Socketpair(t)
	g.port.Attach(gside)
	_, err := NewClient(context.Background(), h, ClientConfig{Activation: []byte("refuse me"), Logger: quiet, ResendInterval: 50 * time.Millisecond})
	var ae *ActivationError
	if !errors.As(err, &ae) || ae.Msg != "refused: refuse me" {
		t.Fatalf("got %v", err)
	}
}

func TestBootTimeout(t *testing.T) {
	h, other := vmchantest.Socketpair(t)
	defer other.Close()
	go io.Copy(io.Discard, other) // a port nobody answers on
	start := time.Now()
	_, err := NewClient(context.Background(), h, ClientConfig{Logger: quiet, ResendInterval: 20 * time.Millisecond, BootTimeout: 200 * time.Millisecond})
	if !errors.Is(err, ErrBootTimeout) || time.Since(start) > 2*time.Second {
		t.Fatalf("got %v after %v", err, time.Since(start))
	}
}

// The guest's agent opens the port late: HELLOs sent before are lost, the
// periodic resend gets through.
func TestLateGuestIsReachedByResend(t *testing.T) {
	h, gside := vmchantest.Socketpair(t)
	go func() {
		// Bytes sent before the guest reads are lost.
		gside.SetReadDeadline(time.Now().Add(150 * time.Millisecond))
		io.Copy(io.Discard, gside)
		gside.SetReadDeadline(time.Time{})
	}()
	g := newGuest(t, echo)
	time.Sleep(200 * time.Millisecond)
	g.port.Attach(gside)
	c, err := NewClient(context.Background(), h, ClientConfig{Activation: []byte("{}"), Logger: quiet, ResendInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	roundTrip(t, c, []byte("late"))
}

// Stale bytes in both directions before the session: garbage, a partial
// frame, a fake ACK of another session.
func TestResyncAfterGarbageAndPartialFrame(t *testing.T) {
	h, gside := vmchantest.Socketpair(t)
	g := newGuest(t, echo)
	// Guest -> host: garbage and an ACK of another session, written by
	// the guest before the pause.
	stale := []byte("garbage \xA5SX\x03 more")
	stale = appendFrame(stale, FrameAck, 0, make([]byte, SessionIDSize), []byte{ackOK}, []byte("stale"))
	stale = append(stale, appendFrame(nil, FrameData, 7, make([]byte, 100))[:40]...)
	if _, err := h.(*net.UnixConn).File(); err != nil {
		t.Fatal(err)
	}
	gside.Write(stale)
	// Host -> guest: a partial DATA frame of the old session in the
	// port's buffer: the header promises 16 KiB, 10 bytes arrived.
	h.Write(appendFrame(nil, FrameData, 1, make([]byte, MaxDataPayload))[:HeaderSize+10])
	g.port.Attach(gside)
	c, err := NewClient(context.Background(), h, ClientConfig{Activation: []byte("{}"), Logger: quiet, ResendInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if string(c.Ack()) != "id:{}" {
		t.Fatalf("ack %q", c.Ack())
	}
	roundTrip(t, c, []byte("after resync"))
}

// The guest is in sync with session 1 and in the middle of a frame when
// the byte stream continues with a new host (a VM restore without a
// disconnect): the padding resynchronises it, the old streams fail with
// ErrSessionReset, and the new session works.
func TestNewHelloResetsSession(t *testing.T) {
	readErr := make(chan error, 4)
	g := newGuest(t, func(c net.Conn) {
		b := make([]byte, 100)
		if _, err := c.Read(b); err != nil || string(b[:4]) != "ping" {
			c.Write([]byte("bad"))
			return
		}
		c.Write([]byte("pong"))
		_, err := io.ReadAll(c)
		readErr <- err
	})
	h, gside := vmchantest.Socketpair(t)
	g.port.Attach(gside)
	// Session 1, by hand.
	var sid SessionID
	sid[0] = 1
	h.Write(appendFrame(appendFrame(nil, FrameHello, 0, helloPayload(sid)), FrameActivate, 0, []byte("one")))
	br := bufio.NewReader(h)
	f, err := readFrame(br)
	if err != nil || f.Type != FrameAck {
		t.Fatalf("ACK: %v %v", f.Type, err)
	}
	h.Write(appendFrame(appendFrame(nil, FrameOpen, 1), FrameData, 1, []byte("ping")))
	f, err = readFrame(br)
	if err != nil || f.Type != FrameData || string(f.Payload) != "pong" {
		t.Fatalf("pong: %v %q %v", f.Type, f.Payload, err)
	}
	if _, ok := g.l.Session(); !ok {
		t.Fatal("no session")
	}
	// A HELLO in sync resets the session at once.
	sid[0] = 2
	h.Write(appendFrame(appendFrame(nil, FrameHello, 0, helloPayload(sid)), FrameActivate, 0, []byte("one-b")))
	select {
	case err := <-readErr:
		if !errors.Is(err, ErrSessionReset) {
			t.Fatalf("old stream: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("old stream did not fail")
	}
	if f, err := readFrame(br); err != nil || f.Type != FrameAck || !bytes.Equal(f.Payload[:SessionIDSize], sid[:]) {
		t.Fatalf("ACK 2: %v %v", f.Type, err)
	}
	h.Write(appendFrame(appendFrame(nil, FrameOpen, 1), FrameData, 1, []byte("ping")))
	if f, err = readFrame(br); err != nil || string(f.Payload) != "pong" {
		t.Fatalf("pong 2: %v %q %v", f.Type, f.Payload, err)
	}
	// The old host leaves a partial frame; the new host continues on the
	// same byte stream.
	h.Write(appendFrame(nil, FrameData, 1, make([]byte, 1000))[:HeaderSize+500])
	c, err := newClientOn(t, h, br, "two")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	select {
	case err := <-readErr:
		// The padding before the new HELLO ends the old session.
		if !errors.Is(err, ErrSessionReset) && !errors.Is(err, ErrLostSync) {
			t.Fatalf("old stream: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("old stream did not fail")
	}
	s, _ := c.Open(context.Background())
	defer s.Close()
	s.Write([]byte("ping"))
	b := make([]byte, 4)
	if _, err := io.ReadFull(s, b); err != nil || string(b) != "pong" {
		t.Fatalf("new session: %q %v", b, err)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.acts) < 2 || string(g.acts[len(g.acts)-1]) != "two" {
		t.Fatalf("activations %q", g.acts)
	}
}

// newClientOn runs NewClient on h, first handing it what br buffered.
func newClientOn(t *testing.T, h net.Conn, br *bufio.Reader, act string) (*Client, error) {
	t.Helper()
	buffered, _ := br.Peek(br.Buffered())
	return NewClient(context.Background(), &prefixConn{Conn: h, prefix: bytes.NewReader(append([]byte(nil), buffered...))},
		ClientConfig{Activation: []byte(act), Logger: quiet, ResendInterval: 50 * time.Millisecond})
}

type prefixConn struct {
	net.Conn
	prefix *bytes.Reader
}

func (c *prefixConn) Read(b []byte) (int, error) {
	if c.prefix.Len() > 0 {
		return c.prefix.Read(b)
	}
	return c.Conn.Read(b)
}

// handshake runs session 1 by hand on a fresh guest and returns the raw
// host connection, in sync after the ACK.
func handshake(t *testing.T, g *guest) (net.Conn, *bufio.Reader) {
	t.Helper()
	h, gside := vmchantest.Socketpair(t)
	t.Cleanup(func() { h.Close() })
	g.port.Attach(gside)
	var sid SessionID
	sid[0] = 9
	h.Write(appendFrame(appendFrame(nil, FrameHello, 0, helloPayload(sid)), FrameActivate, 0, []byte("{}")))
	br := bufio.NewReader(h)
	if f, err := readFrame(br); err != nil || f.Type != FrameAck {
		t.Fatalf("ACK: %v %v", f.Type, err)
	}
	return h, br
}

func expectGoAway(t *testing.T, br *bufio.Reader, what string) {
	t.Helper()
	for {
		f, err := readFrame(br)
		if err != nil {
			t.Fatalf("%s: no GOAWAY: %v", what, err)
		}
		if f.Type == FrameGoAway {
			return
		}
	}
}

func TestGuestRejectsHostileFrames(t *testing.T) {
	cases := map[string][]byte{
		"oversize DATA": func() []byte {
			h := appendFrame(nil, FrameOpen, 1)
			h = append(h, magic[0], magic[1], magic[2], byte(FrameData), 0, 0, 0, 1)
			return binary.BigEndian.AppendUint32(h, MaxDataPayload+1)
		}(),
		"beyond the window": func() []byte {
			b := appendFrame(nil, FrameOpen, 1)
			for range InitialWindow/MaxDataPayload + 1 {
				b = appendFrame(b, FrameData, 1, make([]byte, MaxDataPayload))
			}
			return b
		}(),
		"unknown type":      {0xA5, 'S', 'X', 0x42, 0, 0, 0, 1, 0, 0, 0, 0},
		"DATA never opened": appendFrame(nil, FrameData, 5, []byte("x")),
		"OPEN reused":       appendFrame(appendFrame(nil, FrameOpen, 3), FrameOpen, 2),
		"window overflow":   appendFrame(appendFrame(nil, FrameOpen, 1), FrameWindow, 1, be32(1)),
		"ACK from host":     appendFrame(nil, FrameAck, 0, make([]byte, SessionIDSize+1)),
		"second ACTIVATE":   appendFrame(nil, FrameActivate, 0, []byte("{}")),
		"bad magic in sync": []byte("GET / HTTP/1.1\r\n\r\n"),
	}
	for name, b := range cases {
		t.Run(name, func(t *testing.T) {
			g := newGuest(t, func(c net.Conn) { time.Sleep(time.Second) })
			h, br := handshake(t, g)
			h.Write(b)
			expectGoAway(t, br, name)
			// The guest recovers with the next HELLO.
			c, err := newClientOn(t, h, br, "{}")
			if err != nil {
				t.Fatal(err)
			}
			c.Close()
		})
	}
}

func TestHostRejectsHostileGuest(t *testing.T) {
	for name, b := range map[string][]byte{
		"OPEN from guest": appendFrame(nil, FrameOpen, 2),
		"oversize header": append([]byte{0xA5, 'S', 'X', byte(FrameData), 0, 0, 0, 1}, 0xff, 0xff, 0xff, 0xff),
		"DATA beyond window": func() []byte {
			var b []byte
			for range InitialWindow/MaxDataPayload + 1 {
				b = appendFrame(b, FrameData, 1, make([]byte, MaxDataPayload))
			}
			return b
		}(),
	} {
		t.Run(name, func(t *testing.T) {
			h, gside := vmchantest.Socketpair(t)
			defer gside.Close()
			go func() {
				br := bufio.NewReader(gside)
				f, err := scanFor(br, FrameHello)
				if err != nil {
					return
				}
				sid, _ := parseHello(f.Payload)
				gside.Write(appendFrame(nil, FrameAck, 0, sid[:], []byte{ackOK}, []byte("{}")))
				readFrame(br) // ACTIVATE
				readFrame(br) // OPEN 1
				gside.Write(b)
				io.Copy(io.Discard, br)
			}()
			c, err := NewClient(context.Background(), h, ClientConfig{Activation: []byte("{}"), Logger: quiet, ResendInterval: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			s, _ := c.Open(context.Background())
			select {
			case <-c.Done():
			case <-time.After(5 * time.Second):
				t.Fatal("session survived a hostile guest")
			}
			var pe *ProtocolError
			if !errors.As(c.Err(), &pe) {
				t.Fatalf("session error %v", c.Err())
			}
			if _, err := io.ReadAll(s); !errors.As(err, &pe) {
				t.Fatalf("stream error %v", err)
			}
		})
	}
}

// Dropping the connection fails every open stream at once; the guest
// sees end of file and waits for the next host.
func TestDroppedChannelFailsStreams(t *testing.T) {
	g := newGuest(t, echo)
	c := connect(t, g, "{}")
	var streams []net.Conn
	for range 5 {
		s, _ := c.Open(context.Background())
		defer s.Close()
		streams = append(streams, s)
	}
	roundTrip(t, c, []byte("warm"))
	c.conn.Close()
	<-c.Done()
	for _, s := range streams {
		if _, err := s.Read(make([]byte, 1)); !errors.Is(err, ErrChannelLost) {
			t.Fatalf("stream after drop: %v", err)
		}
	}
	if _, err := c.Open(context.Background()); !errors.Is(err, ErrChannelLost) {
		t.Fatalf("open after drop: %v", err)
	}
	// The guest serves the next host.
	c2 := connect(t, g, "again")
	roundTrip(t, c2, []byte("second host"))
}

func TestParseHeader(t *testing.T) {
	good := appendFrame(nil, FrameData, 3, []byte("abc"))
	if ft, id, n, err := parseHeader(good); err != nil || ft != FrameData || id != 3 || n != 3 {
		t.Fatalf("%v %d %d %v", ft, id, n, err)
	}
	for name, h := range map[string][]byte{
		"short":          good[:5],
		"magic":          append([]byte("XSX"), good[3:]...),
		"HELLO stream 1": appendFrame(nil, FrameHello, 1, make([]byte, 17)),
		"DATA stream 0":  appendFrame(nil, FrameData, 0, []byte("x")),
		"empty DATA":     appendFrame(nil, FrameData, 1),
		"FIN payload":    appendFrame(nil, FrameFin, 1, []byte("x")),
		"HELLO size":     appendFrame(nil, FrameHello, 0, make([]byte, 16)),
	} {
		var fe *FrameError
		if _, _, _, err := parseHeader(h); !errors.As(err, &fe) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if _, err := parseHello(append([]byte{2}, make([]byte, 16)...)); err == nil {
		t.Error("version 2 accepted")
	}
}

func BenchmarkThroughput(b *testing.B) {
	t := &testing.T{}
	_ = t
	h, gside := vmchantest.Socketpair(b)
	p := &vmchantest.Port{}
	p.Attach(gside)
	l := NewListener(p, ListenerConfig{Logger: quiet, Activate: func(SessionID, []byte) ([]byte, error) { return nil, nil }})
	l.Start()
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(io.Discard, c); c.Close() }()
		}
	}()
	c, err := NewClient(context.Background(), h, ClientConfig{Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	s, _ := c.Open(context.Background())
	defer s.Close()
	buf := make([]byte, 64<<10)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		if _, err := s.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
}

var _ = fmt.Sprint
