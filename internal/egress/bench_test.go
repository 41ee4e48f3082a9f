package egress

import (
	"io"
	"net"
	"testing"

	"github.com/spacesbx/space/internal/netpolicy"
)

// BenchmarkSplice compares relaying through the proxy with a direct
// loopback connection; b.SetBytes makes `go test -bench` report MB/s.
func BenchmarkSplice(b *testing.B) {
	const chunk = 256 << 10
	sink := func(c net.Conn) { io.Copy(io.Discard, c); c.Write([]byte{1}) }
	run := func(b *testing.B, c net.Conn) {
		buf := make([]byte, chunk)
		b.SetBytes(chunk)
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if _, err := c.Write(buf); err != nil {
				b.Fatal(err)
			}
		}
		c.(*net.TCPConn).CloseWrite()
		io.ReadFull(c, make([]byte, 1)) // the sink has read everything
		b.StopTimer()
		c.Close()
	}
	b.Run("direct", func(b *testing.B) {
		c, err := net.Dial("tcp", serveLoop(b, sink))
		if err != nil {
			b.Fatal(err)
		}
		run(b, c)
	})
	b.Run("proxy", func(b *testing.B) {
		e := newEnv(b, nil)
		addr := e.listen("127.0.0.2")
		e.set("127.0.0.2", "sb1", netpolicy.Spec{AllowOut: []string{"203.0.113.0/24"}}, denyAll)
		e.route("203.0.113.1:9000", serveLoop(b, sink))
		run(b, e.connect(addr, "203.0.113.1:9000"))
	})
}
