package sbxmanager

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
)

// Replacing the execution by an install ends its Connect streams with
// "execution replaced" too; plain streaming bodies are cut (never a body
// that looks complete), and a stream whose guest had not answered yet gets
// the end-of-stream message alone.
func TestLeaseEndsStreams(t *testing.T) {
	f := newLCFixture(t)
	r1 := route("sbxl", 1)
	f.install(t, r1)
	proc := f.stream(t, "/process.Process/Start", r1, capability.PurposeProcess)
	procDone, procStarted := expectReplacedEnd(t, "process stream", proc, 2)
	waitDone(t, "first message of the stream", procStarted)

	pending := make(chan *http.Response, 1)
	go func() {
		pending <- f.stream(t, "/process.Process/Connect", r1, capability.PurposeProcess)
	}()
	plainReq, _ := http.NewRequest("GET", f.srv.URL+"/files?stream=1", nil)
	plainReq.Header.Set(spacev1.HeaderCapability, f.token(t, r1, capability.PurposeFiles))
	plain, err := http.DefaultClient.Do(plainReq)
	if err != nil || plain.StatusCode != 200 {
		t.Fatalf("plain stream: %v", err)
	}
	plainDone := make(chan error, 1)
	go func() { _, err := io.ReadAll(plain.Body); plain.Body.Close(); plainDone <- err }()
	// Let the pending request reach the guest.
	for deadline := time.Now().Add(5 * time.Second); f.sub.forwarded.Load() < 3 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}

	f.install(t, route("sbxl", 2))
	waitDone(t, "process stream", procDone)
	select {
	case err := <-plainDone:
		if err == nil {
			t.Fatal("a cut plain stream looked complete")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("plain stream still open")
	}
	var resp *http.Response
	select {
	case resp = <-pending:
	case <-time.After(10 * time.Second):
		t.Fatal("pending stream still open")
	}
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/connect+json" {
		t.Fatalf("pending stream: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	pendingDone, _ := expectReplacedEnd(t, "pending stream", resp, 1)
	waitDone(t, "pending stream", pendingDone)
}

// The lease writer on its own: a non-Connect request whose lease ended
// before the guest answered gets a 503 "execution replaced" JSON error,
// and a Connect cut inside a message aborts.
func TestLeaseWriterUnit(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	act := &activation{route: route("sbxu", 3), ctx: ctx}
	cancel()
	rec := httptest.NewRecorder()
	req := httptest.NewRequest("GET", "/files", nil)
	lw := newLeaseWriter(rec, req, act, act.ctx)
	func() {
		defer lw.finish()
		writeTestError(lw, fmt.Errorf("%w: sandbox bridge: context canceled", errdefs.ErrUnavailable))
	}()
	var e spacev1.Error
	if rec.Code != 503 || json.Unmarshal(rec.Body.Bytes(), &e) != nil || e.Reason != spacev1.ReasonExecutionReplaced {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}

	act2 := &activation{route: route("sbxu", 3)}
	var cancel2 context.CancelFunc
	act2.ctx, cancel2 = context.WithCancel(context.Background())
	rec = httptest.NewRecorder()
	lw = newLeaseWriter(rec, req, act2, act2.ctx)
	panicked := func() (p any) {
		defer func() { p = recover() }()
		defer lw.finish()
		lw.Header().Set("Content-Type", "application/connect+json")
		lw.WriteHeader(200)
		lw.Write(frame(0, `{"a":1}`)[:7]) // half a message
		cancel2()
		panic(http.ErrAbortHandler)
	}()
	if panicked != http.ErrAbortHandler {
		t.Fatalf("cut inside a message: %v", panicked)
	}
	// Other panics propagate untouched.
	rec = httptest.NewRecorder()
	lw = newLeaseWriter(rec, req, act2, act2.ctx)
	p := func() (p any) {
		defer func() { p = recover() }()
		defer lw.finish()
		panic("boom")
	}()
	if p != "boom" {
		t.Fatalf("foreign panic: %v", p)
	}
}
