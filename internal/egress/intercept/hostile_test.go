package intercept

import (
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/internal/errdefs"
)

// hostile runs send against a fresh env, checks Serve's error and that the
// upstream saw nothing, then tears everything down and checks that no
// goroutine is left.
func hostile(t *testing.T, send func(e *env) error, class error) {
	t.Helper()
	var hits atomic.Int32
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1) }))
	sendErr := make(chan error, 1)
	go func() { sendErr <- send(e) }()
	err := e.serveErr()
	if err == nil || (class != nil && !errors.Is(err, class)) {
		t.Fatalf("Serve: %v, want an error of class %v", err, class)
	}
	select {
	case <-sendErr:
	case <-time.After(10 * time.Second):
		t.Fatal("the client side is still blocked after Serve returned")
	}
	if hits.Load() != 0 || e.dials.Load() != 0 {
		t.Fatalf("hostile input reached upstream (hits %d, dials %d)", hits.Load(), e.dials.Load())
	}
	e.close()
	goleak.VerifyNone(t)
}

func TestHostileNotTLS(t *testing.T) {
	for name, garbage := range map[string][]byte{
		"plain http": []byte("GET / HTTP/1.1\r\nHost: example.com\r\n\r\n"),
		"zeros":      make([]byte, 4096),
		"bad record": {0x16, 0x03, 0x01, 0xff, 0xff, 1, 2, 3},
	} {
		t.Run(name, func(t *testing.T) {
			hostile(t, func(e *env) error {
				c, err := net.Dial("tcp", e.ln.Addr().String())
				if err != nil {
					return err
				}
				defer c.Close()
				c.Write(garbage)
				c.SetReadDeadline(time.Now().Add(10 * time.Second))
				_, err = io.Copy(io.Discard, c) // until Serve closes it
				return err
			}, errdefs.ErrInvalid)
		})
	}
}

// sendAndRead writes head (in the background: Serve may stop reading
// midway) and returns the status Serve answered, if any.
func sendAndRead(e *env, head io.Reader) (int, error) {
	c, br, err := e.rawTLS()
	if err != nil {
		return 0, err
	}
	defer c.Close()
	go io.Copy(c, head)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return 0, err
	}
	return resp.StatusCode, nil
}

func TestHostileHugeRequestLine(t *testing.T) {
	hostile(t, func(e *env) error {
		line := io.MultiReader(strings.NewReader("GET /"), bytes.NewReader(bytes.Repeat([]byte("a"), 1<<20)),
			strings.NewReader(" HTTP/1.1\r\nHost: example.com\r\n\r\n"))
		code, err := sendAndRead(e, line)
		if err == nil && code != http.StatusRequestHeaderFieldsTooLarge {
			t.Errorf("status %d, want 431", code)
		}
		return err
	}, errdefs.ErrTooLarge)
}

func TestHostileHeaderFlood(t *testing.T) {
	hostile(t, func(e *env) error {
		flood := io.MultiReader(strings.NewReader("GET / HTTP/1.1\r\nHost: example.com\r\n"),
			bytes.NewReader(bytes.Repeat([]byte("X-Flood: x\r\n"), 100_000)), strings.NewReader("\r\n"))
		code, err := sendAndRead(e, flood)
		if err == nil && code != http.StatusRequestHeaderFieldsTooLarge {
			t.Errorf("status %d, want 431", code)
		}
		return err
	}, errdefs.ErrTooLarge)
}

func TestHostileMalformedRequest(t *testing.T) {
	for name, req := range map[string]string{
		"not http":      "\x00\x01\x02 hello\r\n\r\n",
		"bad version":   "GET / HTTP/9.9\r\nHost: example.com\r\n\r\n",
		"bad header":    "GET / HTTP/1.1\r\nHost: example.com\r\nNo colon here\r\n\r\n",
		"double length": "POST / HTTP/1.1\r\nHost: example.com\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
		"bad encoding":  "POST / HTTP/1.1\r\nHost: example.com\r\nTransfer-Encoding: gzip\r\n\r\n",
	} {
		t.Run(name, func(t *testing.T) {
			hostile(t, func(e *env) error {
				code, err := sendAndRead(e, strings.NewReader(req))
				if err == nil && code != http.StatusBadRequest && code != http.StatusHTTPVersionNotSupported {
					t.Errorf("status %d, want 400 or 505", code)
				}
				return err
			}, errdefs.ErrInvalid)
		})
	}
}

// A client that leaves after the handshake, or mid-request, ends Serve.
func TestHostileClientLeaves(t *testing.T) {
	hostile(t, func(e *env) error {
		c, _, err := e.rawTLS()
		if err != nil {
			return err
		}
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: exa")
		return c.Close()
	}, nil)
}

// A client that connects and never finishes its handshake is dropped.
func TestHostileStalledHandshake(t *testing.T) {
	defer func(d time.Duration) { handshakeTimeout = d }(handshakeTimeout)
	handshakeTimeout = 200 * time.Millisecond
	hostile(t, func(e *env) error {
		c, err := net.Dial("tcp", e.ln.Addr().String())
		if err != nil {
			return err
		}
		defer c.Close()
		c.Write([]byte{0x16, 0x03, 0x01, 0x00, 0x80}) // a record header, then nothing
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = io.Copy(io.Discard, c)
		return err
	}, errdefs.ErrTimeout)
}
