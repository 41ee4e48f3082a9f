package sbxmanager

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
)

// A request refused without reading its body (here: the sandbox is paused)
// must leave the keep-alive connection usable. In full-duplex mode the
// server would otherwise panic on its next read (golang/go#68560) and drop
// the connection under the edge's next request.
func TestRefusedBodyKeepsConnectionUsable(t *testing.T) {
	f := newFixture(t)
	f.install(t, route("sbxa", 1))
	if err := f.m.Pause(context.Background(), route("sbxa", 1)); err != nil {
		t.Fatal(err)
	}
	tok := f.token(t, route("sbxa", 1), capability.PurposeFiles)
	client := &http.Client{Transport: &http.Transport{MaxConnsPerHost: 1}}
	defer client.CloseIdleConnections()
	for i := range 5 {
		req, _ := http.NewRequest("POST", f.srv.URL+"/files?path=/x", strings.NewReader(strings.Repeat("b", 64<<10)))
		req.Header.Set(spacev1.HeaderCapability, tok)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusConflict {
			t.Fatalf("request %d: status %d", i, resp.StatusCode)
		}
	}
}
