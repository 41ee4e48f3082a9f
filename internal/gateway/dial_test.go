package gateway

import (
	"bufio"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
)

// serveDial runs f's gateway on a dial socket and returns its path.
func (f *fixture) serveDial(t *testing.T) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "gw.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.gw.ServeDialListener(ctx, ln) }()
	t.Cleanup(func() {
		f.gw.Close()
		cancel()
		ln.Close()
		if err := <-done; err != nil {
			t.Errorf("ServeDialListener: %v", err)
		}
	})
	return sock
}

func dialCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// getOn sends a GET on a passed guest connection and returns the body.
func getOn(t *testing.T, gc net.Conn) string {
	t.Helper()
	gc.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(gc, "GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
	res, err := http.ReadResponse(bufio.NewReader(gc), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return string(b)
}

func TestDialPassesTheGuestSocket(t *testing.T) {
	f := newFixture(t, nil)
	sock := f.serveDial(t)
	gc, hold, err := OpenGuest(dialCtx(t), sock, nil, DialRequest{Token: f.token(t, testRoute(), f.port, "http"), Port: f.port, Protocol: "http"})
	if err != nil {
		t.Fatal(err)
	}
	if n := f.gw.Streams(); n != 1 {
		t.Fatalf("streams while held: %d, want 1", n)
	}
	if body := getOn(t, gc); body != "hello from /x" {
		t.Fatalf("body %q", body)
	}
	gc.Close()
	hold.Close()
	deadline := time.Now().Add(5 * time.Second)
	for f.gw.Streams() != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := f.gw.Streams(); n != 0 {
		t.Fatalf("streams after release: %d", n)
	}
	if a, r, d := f.gw.Counts(); a != 1 || r != 0 || d != 0 {
		t.Fatalf("counts %d/%d/%d", a, r, d)
	}
}

// Every refusal of the in-process path is a refusal of the dial protocol,
// and nothing is passed with it.
func TestDialRejections(t *testing.T) {
	f := newFixture(t, nil)
	sock := f.serveDial(t)
	rt := testRoute()
	other := rt
	other.SandboxID = "sbxb"
	olderGen := rt
	olderGen.Generation, olderGen.ExecutionID = 2, "exec2"
	_, priv2, _ := ed25519.GenerateKey(rand.Reader)
	s2, _ := capability.NewSigner("k1", priv2)
	forged, _, _ := s2.Issue(capability.Claims{Route: rt, Purpose: capability.PurposeServicePort, Port: f.port, Protocol: "http"})
	cases := []struct {
		name    string
		req     DialRequest
		status  int
		outcome string
	}{
		{"missing capability", DialRequest{Port: f.port, Protocol: "http"}, 403, spacev1.OutcomeDeny},
		{"wrong port", DialRequest{Token: f.token(t, rt, f.port+1, "http"), Port: f.port, Protocol: "http"}, 403, spacev1.OutcomeDeny},
		{"wrong protocol", DialRequest{Token: f.token(t, rt, f.port, "ws"), Port: f.port, Protocol: "http"}, 403, spacev1.OutcomeDeny},
		{"tcp token for http", DialRequest{Token: f.token(t, rt, f.port, "tcp"), Port: f.port, Protocol: "http"}, 403, spacev1.OutcomeDeny},
		{"bad signature", DialRequest{Token: forged, Port: f.port, Protocol: "http"}, 403, spacev1.OutcomeDeny},
		{"malformed token", DialRequest{Token: "v4.public.garbage", Port: f.port, Protocol: "http"}, 403, spacev1.OutcomeDeny},
		{"other sandbox", DialRequest{Token: f.token(t, other, f.port, "http"), Port: f.port, Protocol: "http"}, 403, spacev1.OutcomeDeny},
		{"other generation", DialRequest{Token: f.token(t, olderGen, f.port, "http"), Port: f.port, Protocol: "http"}, 421, spacev1.OutcomeRefreshRoute},
		{"envd port", DialRequest{Token: f.token(t, rt, EnvdPort, "http"), Port: EnvdPort, Protocol: "http"}, 400, ""},
		{"port 0", DialRequest{Token: f.token(t, rt, f.port, "http"), Port: 0, Protocol: "http"}, 400, ""},
		{"port too big", DialRequest{Token: f.token(t, rt, f.port, "http"), Port: 70000, Protocol: "http"}, 400, ""},
		{"unknown protocol", DialRequest{Token: f.token(t, rt, f.port, "http"), Port: f.port, Protocol: "udp"}, 400, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			gc, _, err := OpenGuest(dialCtx(t), sock, nil, c.req)
			var refused *RefusedError
			if !errors.As(err, &refused) {
				if gc != nil {
					gc.Close()
				}
				t.Fatalf("err %v, want a refusal", err)
			}
			if refused.Status != c.status || refused.Outcome != c.outcome {
				t.Fatalf("refused %d %q (%s), want %d %q", refused.Status, refused.Outcome, refused.Reason, c.status, c.outcome)
			}
		})
	}
	// A retired gateway refuses with RefreshRoute.
	f.gw.Retire("test")
	_, _, err := OpenGuest(dialCtx(t), sock, nil, DialRequest{Token: f.token(t, rt, f.port, "http"), Port: f.port, Protocol: "http"})
	var refused *RefusedError
	if !errors.As(err, &refused) || refused.Status != 421 || refused.Outcome != spacev1.OutcomeRefreshRoute {
		t.Fatalf("retired: %v", err)
	}
}

// Hostile or broken request lines get a 400 line and no socket.
func TestDialMalformedRequests(t *testing.T) {
	f := newFixture(t, nil)
	sock := f.serveDial(t)
	for name, line := range map[string]string{
		"not json":      "nonsense\n",
		"unknown field": `{"token":"x","port":80,"protocol":"http","sandbox":"other"}` + "\n",
		"two values":    `{"port":80}{"port":81}` + "\n",
		"oversized":     `{"token":"` + strings.Repeat("a", maxDialLine+10) + `"}` + "\n",
		"no newline":    `{"token":"x"`,
	} {
		t.Run(name, func(t *testing.T) {
			c, err := net.Dial("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(15 * time.Second))
			io.WriteString(c, line)
			if name == "no newline" {
				c.(*net.UnixConn).CloseWrite()
			}
			buf := make([]byte, 4096)
			oob := make([]byte, 64)
			n, oobn, _, _, err := c.(*net.UnixConn).ReadMsgUnix(buf, oob)
			if err != nil && n == 0 {
				t.Fatalf("no reply: %v", err)
			}
			if oobn != 0 {
				t.Fatalf("a refusal carried %d bytes of control data", oobn)
			}
			if !strings.Contains(string(buf[:n]), `"status":400`) {
				t.Fatalf("reply %q", buf[:n])
			}
		})
	}
	if a, r, d := f.gw.Counts(); a != 0 {
		t.Fatalf("a malformed request was admitted: %d/%d/%d", a, r, d)
	}
}

// A new execution (or Retire) cuts a socket already handed over: the
// holder's copy sees the stream end although the guest keeps its side open.
func TestDialRetireCutsPassedSocket(t *testing.T) {
	f := newFixture(t, nil)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	held := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			held <- c // open, silent: only the gateway can end the stream
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	sock := f.serveDial(t)
	gc, hold, err := OpenGuest(dialCtx(t), sock, nil, DialRequest{Token: f.token(t, testRoute(), port, "tcp"), Port: port, Protocol: "tcp"})
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Close()
	defer gc.Close()
	gs := <-held
	defer gs.Close()
	next := testRoute()
	next.Generation, next.ExecutionID = 4, "exec4"
	if err := f.gw.SetActivation(next); !errors.Is(err, ErrEpochChanged) {
		t.Fatalf("SetActivation: %v", err)
	}
	gc.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, err := gc.Read(make([]byte, 16))
	if n != 0 || err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read after retire: n=%d err=%v; want the stream ended", n, err)
	}
	if _, err := gc.Write([]byte("x")); err == nil {
		t.Fatal("write after retire succeeded")
	}
}

// The client side refuses replies that pass no socket, several, or
// something that is not a TCP socket.
func TestOpenGuestRejectsBadReplies(t *testing.T) {
	pipeR, pipeW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pipeR.Close()
	defer pipeW.Close()
	tcpLn, _ := net.Listen("tcp", "127.0.0.1:0")
	defer tcpLn.Close()
	tc, _ := net.Dial("tcp", tcpLn.Addr().String())
	defer tc.Close()
	tf, _ := tc.(*net.TCPConn).File()
	defer tf.Close()
	cases := map[string]struct {
		line string
		fds  []int
		want string
	}{
		"no socket":       {`{"status":200}`, nil, "want one socket, got 0"},
		"two sockets":     {`{"status":200}`, []int{int(tf.Fd()), int(tf.Fd())}, "want one socket, got 2"},
		"a pipe":          {`{"status":200}`, []int{int(pipeR.Fd())}, "netgtw dial"},
		"malformed":       {`{"status":`, nil, "malformed reply"},
		"odd status":      {`{"status":302}`, nil, "netgtw refused: 502"},
		"closed silently": {"", nil, "netgtw dial"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "fake.sock")
			ln, err := net.Listen("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			go func() {
				s, err := ln.Accept()
				if err != nil {
					return
				}
				defer s.Close()
				bufio.NewReader(s).ReadString('\n')
				if c.line != "" {
					var oob []byte
					if len(c.fds) > 0 {
						oob = unix.UnixRights(c.fds...)
					}
					s.(*net.UnixConn).WriteMsgUnix([]byte(c.line+"\n"), oob, nil)
				}
			}()
			gc, hold, err := OpenGuest(dialCtx(t), sock, nil, DialRequest{Token: "t", Port: 80, Protocol: "http"})
			if err == nil {
				gc.Close()
				hold.Close()
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err %v, want %q", err, c.want)
			}
		})
	}
	// A peer that fails verification is never sent the capability.
	sock := filepath.Join(t.TempDir(), "peer.sock")
	ln, _ := net.Listen("unix", sock)
	defer ln.Close()
	got := make(chan int, 1)
	go func() {
		s, err := ln.Accept()
		if err != nil {
			return
		}
		defer s.Close()
		s.SetDeadline(time.Now().Add(5 * time.Second))
		b, _ := io.ReadAll(s)
		got <- len(b)
	}()
	_, _, err = OpenGuest(dialCtx(t), sock, func(net.Conn) error { return errors.New("not netgtw") }, DialRequest{Token: "secret", Port: 80, Protocol: "http"})
	if err == nil || !strings.Contains(err.Error(), "not netgtw") {
		t.Fatalf("err %v", err)
	}
	if n := <-got; n != 0 {
		t.Fatalf("an unverified peer received %d bytes", n)
	}
}

func FuzzDialRequest(f *testing.F) {
	f.Add([]byte(`{"token":"t","port":8000,"protocol":"http"}` + "\n"))
	f.Add([]byte(`{"port":49983,"protocol":"tcp"}`))
	f.Add([]byte(`{"port":1}{"port":2}`))
	f.Fuzz(func(t *testing.T, line []byte) {
		req, err := ParseDialRequest(line)
		if err != nil {
			return
		}
		if req.Port < 1 || req.Port > 65535 || req.Port == EnvdPort {
			t.Fatalf("accepted port %d", req.Port)
		}
		if req.Protocol != ProtocolHTTP && req.Protocol != ProtocolWS && req.Protocol != ProtocolTCP {
			t.Fatalf("accepted protocol %q", req.Protocol)
		}
	})
}
