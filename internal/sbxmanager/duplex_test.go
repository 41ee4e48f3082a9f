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

// Pause gives commands already started a bounded grace to finish before
// freezing, so that a move following the pause does not cut them; a
// command still running after the grace is frozen as it is, its stream
// kept open.
func TestPauseLetsStartedCommandsFinish(t *testing.T) {
	f := newFixture(t)
	f.m.cfg.PauseStreamGrace = 700 * time.Millisecond
	f.install(t, route("sbxa", 1))
	tok := f.token(t, route("sbxa", 1), capability.PurposeProcess)
	start := func(query string) (*http.Response, error) {
		req, _ := http.NewRequest("POST", f.srv.URL+"/process.Process/Start"+query, strings.NewReader("{}"))
		req.Header.Set(spacev1.HeaderCapability, tok)
		req.Header.Set("Content-Type", "application/connect+json")
		return http.DefaultClient.Do(req)
	}
	short, err := start("?end=300ms")
	if err != nil {
		t.Fatal(err)
	}
	defer short.Body.Close()
	long, err := start("")
	if err != nil {
		t.Fatal(err)
	}
	defer long.Body.Close()
	began := time.Now()
	if err := f.m.Pause(context.Background(), route("sbxa", 1)); err != nil {
		t.Fatal(err)
	}
	waited := time.Since(began)
	if waited < 600*time.Millisecond || waited > 3*time.Second {
		t.Fatalf("pause waited %s, want about the 700ms grace (the long command never ends)", waited)
	}
	b, err := io.ReadAll(short.Body)
	if err != nil || string(b) != "started\nfinished\n" {
		t.Fatalf("short command: %q %v", b, err)
	}
	// The long one is still open (frozen, not cut): after its first line a
	// read does not end.
	first := make([]byte, len("started\n"))
	if _, err := io.ReadFull(long.Body, first); err != nil {
		t.Fatal(err)
	}
	rd := make(chan error, 1)
	go func() { _, err := long.Body.Read(make([]byte, 64)); rd <- err }()
	select {
	case err := <-rd:
		t.Fatalf("long command's stream ended at pause: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	long.Body.Close()
	<-rd
	// Started while paused: refused, and not counted.
	resp, err := start("?end=1ms")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusConflict {
		t.Fatalf("start while paused: %d", resp.StatusCode)
	}
}

// With no command running, Pause does not wait for the grace.
func TestPauseWithoutCommandsDoesNotWait(t *testing.T) {
	f := newFixture(t)
	f.m.cfg.PauseStreamGrace = 5 * time.Second
	f.install(t, route("sbxa", 1))
	began := time.Now()
	if err := f.m.Pause(context.Background(), route("sbxa", 1)); err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(began); waited > time.Second {
		t.Fatalf("pause without commands took %s", waited)
	}
}
