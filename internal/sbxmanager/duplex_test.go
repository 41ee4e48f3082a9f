package sbxmanager

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

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

// Pause refuses new requests at once but lets a unary request already in
// the guest finish, instead of freezing it mid-flight.
func TestPauseDrainsUnaryRequestsInFlight(t *testing.T) {
	f := newFixture(t)
	f.install(t, route("sbxa", 1))
	tok := f.token(t, route("sbxa", 1), capability.PurposeFiles)
	got := make(chan int, 1)
	go func() {
		resp, _ := f.get(t, "/files?delay=400ms", tok)
		got <- resp.StatusCode
	}()
	time.Sleep(100 * time.Millisecond) // the request is inside the guest
	start := time.Now()
	if err := f.m.Pause(context.Background(), route("sbxa", 1)); err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(start); waited < 200*time.Millisecond {
		t.Fatalf("pause did not wait for the request in flight (%s)", waited)
	}
	if s := <-got; s != http.StatusOK {
		t.Fatalf("request in flight during pause: %d", s)
	}
	if resp, _ := f.get(t, "/files", tok); resp.StatusCode != http.StatusConflict {
		t.Fatalf("request after pause: %d", resp.StatusCode)
	}
}
