package egress

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/sdk"
)

// hostEcho answers every GET with the Host header it received.
const hostEcho = `import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = (self.headers.get("Host") or "").encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
`

// network.maskRequestHost: a sandbox's services see the mask (with
// ${PORT} filled in) as the Host of requests through the edge; without
// one, the Host the client sent.
func TestMaskRequestHost(t *testing.T) {
	w := getWorld(t)
	masked := w.sandbox(t, sdk.CreateOptions{Network: &sdk.Network{MaskRequestHost: "masked.internal:${PORT}"}})
	plain := w.sandbox(t, sdk.CreateOptions{})
	for _, s := range []*sandbox{masked, plain} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if _, err := s.WriteFile(ctx, "/tmp/hostecho.py", []byte(hostEcho)); err != nil {
			t.Fatal(err)
		}
		cancel()
		s.sh(t, `setsid nohup python3 /tmp/hostecho.py >/dev/null 2>&1 </dev/null & for i in $(seq 50); do python3 -c 'import socket; socket.create_connection(("127.0.0.1", 8000), 1)' 2>/dev/null && break; sleep 0.1; done`)
	}
	get := func(id string) string {
		req, _ := http.NewRequest(http.MethodGet, w.plat.SandboxURL+"/", nil)
		req.Host = fmt.Sprintf("8000-%s.localhost", id)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		if res.StatusCode != 200 {
			t.Fatalf("GET %s: %d %s", req.Host, res.StatusCode, b)
		}
		return string(b)
	}
	if got := get(masked.ID); got != "masked.internal:8000" {
		t.Fatalf("masked sandbox's service saw Host %q", got)
	}
	if got := get(plain.ID); !strings.HasPrefix(got, "8000-"+plain.ID) {
		t.Fatalf("unmasked sandbox's service saw Host %q", got)
	}
	info, err := w.client.GetSandbox(context.Background(), masked.ID)
	if err != nil || info.Network == nil || info.Network.MaskRequestHost != "masked.internal:${PORT}" {
		t.Fatalf("GET: %v %+v", err, info)
	}
}
