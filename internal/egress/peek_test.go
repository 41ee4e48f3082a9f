package egress

import (
	"bytes"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// clientHello captures the ClientHello crypto/tls sends for sni.
func clientHello(t testing.TB, sni string) []byte {
	t.Helper()
	a, b := net.Pipe()
	done := make(chan struct{})
	go func() {
		defer close(done)
		c := tls.Client(a, &tls.Config{ServerName: sni, InsecureSkipVerify: true, NextProtos: []string{"h2", "http/1.1"}})
		c.Handshake()
	}()
	var buf []byte
	tmp := make([]byte, 4096)
	for {
		b.SetReadDeadline(time.Now().Add(3 * time.Second))
		n, err := b.Read(tmp)
		buf = append(buf, tmp[:n]...)
		if _, perr := parseClientHello(buf); !errors.Is(perr, errNeedMore) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	b.Close()
	a.Close()
	<-done
	return buf
}

func TestParseClientHello(t *testing.T) {
	ch := clientHello(t, "API.Example.com")
	name, err := parseClientHello(ch)
	if err != nil || name != "api.example.com" {
		t.Fatalf("%q %v", name, err)
	}
	// Every strict prefix asks for more; none is mistaken for a name.
	for i := 0; i < len(ch); i++ {
		if _, err := parseClientHello(ch[:i]); !errors.Is(err, errNeedMore) {
			t.Fatalf("prefix %d: %v", i, err)
		}
	}
	// The same hello split over two records (fragmented handshake).
	body := ch[5:]
	split := append([]byte{0x16, 3, 1, 0, 40}, body[:40]...)
	split = append(split, 0x16, 3, 1)
	split = binary.BigEndian.AppendUint16(split, uint16(len(body)-40))
	split = append(split, body[40:]...)
	if name, err := parseClientHello(split); err != nil || name != "api.example.com" {
		t.Fatalf("fragmented: %q %v", name, err)
	}
	if name, err := parseClientHello(buildHello("x.example.org")); err != nil || name != "x.example.org" {
		t.Fatalf("built hello: %q %v", name, err)
	}
	// No SNI (IP literal).
	if name, err := parseClientHello(clientHello(t, "")); err != nil || name != "" {
		t.Fatalf("no sni: %q %v", name, err)
	}
	// Malformed: not a handshake record, not a ClientHello, bad lengths.
	for _, bad := range [][]byte{
		{0x16, 3, 1, 0, 0},
		{0x16, 2, 0, 0, 4, 1, 0, 0, 0},
		{0x16, 3, 1, 0, 4, 2, 0, 0, 0},
		{0x16, 3, 1, 0, 6, 1, 0, 0, 2, 3, 3},
		{0x16, 3, 1, 0x50, 0, 1},
	} {
		if _, err := parseClientHello(bad); err == nil || errors.Is(err, errNeedMore) {
			t.Errorf("%x: %v", bad, err)
		}
	}
	// Bytes no host name has are refused, not passed to the policy.
	i := bytes.Index(ch, []byte("API.Example.com")) // crypto/tls sends the name as given
	if i < 0 {
		t.Fatal("sni not found")
	}
	mangled := bytes.Clone(ch)
	copy(mangled[i:], "api.exam\x00e.com")
	if _, err := parseClientHello(mangled); err == nil {
		t.Fatal("NUL in server name accepted")
	}
}

func TestParseHTTPHost(t *testing.T) {
	for _, tc := range []struct {
		in   string
		name string
		err  error
	}{
		{"GET / HTTP/1.1\r\nHost: Example.COM:8080\r\nAccept: */*\r\n\r\n", "example.com", nil},
		{"GET / HTTP/1.1\nHost: a.example.com\n\n", "a.example.com", nil},
		{"GET http://a.example.com/x HTTP/1.1\r\nHost: a.example.com\r\n\r\n", "a.example.com", nil},
		{"GET http://user@a.example.com:81/x HTTP/1.1\r\n\r\n", "a.example.com", nil},
		{"CONNECT a.example.com:443 HTTP/1.1\r\nHost: a.example.com:443\r\n\r\n", "a.example.com", nil},
		{"GET / HTTP/1.1\r\nHost: [2001:db8::1]:80\r\n\r\n", "", nil},
		{"GET / HTTP/1.0\r\n\r\n", "", nil},
		{"GET / HTTP/1.1\r\nHost: a.example.com\r\n", "", errNeedMore},
		{"GET http://b.example.com/ HTTP/1.1\r\nHost: a.example.com\r\n\r\n", "", errMalformed},
		{"GET / HTTP/1.1\r\nHost: a.example.com\r\nHost: b.example.com\r\n\r\n", "", errMalformed},
		{"GET / HTTP/1.1\r\n Host: b.example.com\r\n\r\n", "", errMalformed},
		{"GET / HTTP/2.0\r\nHost: a.example.com\r\n\r\n", "", errMalformed},
		{"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", "", errMalformed},
		{"GET / HTTP/1.1\r\nno colon\r\n\r\n", "", errMalformed},
	} {
		name, err := parseHTTPHost([]byte(tc.in))
		if name != tc.name || !errors.Is(err, tc.err) && !(err == nil && tc.err == nil) {
			t.Errorf("%q: %q %v, want %q %v", tc.in, name, err, tc.name, tc.err)
		}
	}
}

func TestClassify(t *testing.T) {
	for _, tc := range []struct {
		in    string
		proto protocol
		done  bool
	}{
		{"SSH-2.0-x\r\n", protoOther, true},
		{"GE", protoOther, false},
		{"GET / HTTP/1.1\r\nHost: a.example.com\r\n\r\n", protoHTTP, true},
		{"\x16\x03\x01", protoOther, false},
		{"\x00\x01", protoOther, true},
	} {
		p, done := classify([]byte(tc.in))
		if done != tc.done || done && p.proto != tc.proto {
			t.Errorf("%q: %v %v", tc.in, p.proto, done)
		}
	}
}

// TestPeekStopsAtLimit: a never-ending "request" is cut at maxPeek, not
// buffered without bound, and yields no name.
func TestPeekStopsAtLimit(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	go func() {
		io.WriteString(b, "GET / HTTP/1.1\r\nX: ")
		b.Write(bytes.Repeat([]byte("a"), 2*maxPeek))
	}()
	p, err := peek(a, 2*time.Second)
	if err != nil || p.name != "" || !p.bad || len(p.data) > maxPeek {
		t.Fatalf("%v name=%q bad=%v len=%d", err, p.name, p.bad, len(p.data))
	}
	// Timeout with nothing: no name, no error.
	c, d := net.Pipe()
	defer c.Close()
	defer d.Close()
	p, err = peek(c, 50*time.Millisecond)
	if err != nil || p.name != "" || len(p.data) != 0 {
		t.Fatalf("%v %+v", err, p)
	}
}

func FuzzParseClientHello(f *testing.F) {
	f.Add(buildHello("a.example.com"))
	f.Add(buildHello(""))
	f.Add([]byte{0x16, 3, 1, 0, 4, 1, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		name, err := parseClientHello(b)
		if err == nil && name != "" {
			if n, ok := cleanName(name); !ok || n != name {
				t.Fatalf("unclean name %q", name)
			}
		}
		if err != nil && name != "" {
			t.Fatalf("name %q with error %v", name, err)
		}
	})
}

func FuzzParseHTTPHost(f *testing.F) {
	f.Add([]byte("GET / HTTP/1.1\r\nHost: a.example.com\r\n\r\n"))
	f.Add([]byte("GET http://a/ HTTP/1.1\r\n\r\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		name, err := parseHTTPHost(b)
		if err == nil && name != "" {
			if n, ok := cleanName(name); !ok || n != name || strings.Contains(name, ":") {
				t.Fatalf("unclean name %q", name)
			}
		}
		classify(b)
	})
}

// buildHello is a minimal hand-made ClientHello (no crypto/tls: fuzz seeds
// are made in every fuzz worker).
func buildHello(sni string) []byte {
	u16 := func(b []byte, v int) []byte { return binary.BigEndian.AppendUint16(b, uint16(v)) }
	body := []byte{3, 3}
	body = append(body, make([]byte, 32)...)
	body = append(body, 0)          // session id
	body = u16(body, 2)             // cipher suites
	body = append(body, 0x13, 0x01) //
	body = append(body, 1, 0)       // compression: null
	var ext []byte
	if sni != "" {
		var list []byte
		list = append(list, 0)
		list = u16(list, len(sni))
		list = append(list, sni...)
		var sn []byte
		sn = u16(sn, len(list))
		sn = append(sn, list...)
		ext = u16(ext, 0)
		ext = u16(ext, len(sn))
		ext = append(ext, sn...)
	}
	ext = u16(ext, 43) // supported_versions
	ext = u16(ext, 3)
	ext = append(ext, 2, 3, 4)
	body = u16(body, len(ext))
	body = append(body, ext...)
	hs := []byte{1, byte(len(body) >> 16), byte(len(body) >> 8), byte(len(body))}
	hs = append(hs, body...)
	rec := []byte{0x16, 3, 1}
	rec = u16(rec, len(hs))
	return append(rec, hs...)
}
