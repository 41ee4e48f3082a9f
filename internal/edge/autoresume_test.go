package edge

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/spacev1"
)

// pausedHandler answers node-api's 409 paused while paused() is true.
func pausedHandler(paused func() bool, next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if paused() {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusConflict)
			_, _ = w.Write([]byte(`{"code":409,"message":"sandbox is paused","reason":"paused"}`))
			return
		}
		next(w, r)
	}
}

// A cached route that names a frozen execution: node-api answers paused,
// the edge asks the control plane again (which resumes an autoResume
// sandbox) and serves the request on the published execution.
func TestAutoResumeOnPausedAnswer(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	var paused atomic.Bool
	isPaused, setPaused := paused.Load, paused.Store
	h.node.handle("/files", pausedHandler(isPaused, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("content"))
	}))
	if res := h.envd("GET", "sbx1", "/files?path=/a", ""); res.StatusCode != 200 {
		t.Fatalf("first: %d %s", res.StatusCode, readAll(t, res))
	} else {
		res.Body.Close()
	}
	// Paused with the route cached; the control plane resumes on repair.
	setPaused(true)
	h.cp.mu.Lock()
	h.cp.onRepair = func() { setPaused(false) }
	h.cp.mu.Unlock()
	res := h.envd("GET", "sbx1", "/files?path=/a", "")
	if body := readAll(t, res); res.StatusCode != 200 || body != "content" {
		t.Fatalf("after resume: %d %q", res.StatusCode, body)
	}
	if n := h.cp.repairs(); n != 1 {
		t.Fatalf("repairs = %d, want 1", n)
	}

	// Without autoResume the control plane keeps answering paused: the
	// client gets E2B's 502 paused, as before.
	setPaused(true)
	h.cp.mu.Lock()
	h.cp.onRepair = nil
	h.cp.status, h.cp.reason = http.StatusConflict, spacev1.ReasonPaused
	h.cp.mu.Unlock()
	res = h.envd("GET", "sbx1", "/files?path=/a", "")
	body := readAll(t, res)
	if res.StatusCode != http.StatusBadGateway || !strings.Contains(body, `"reason":"paused"`) {
		t.Fatalf("paused without autoResume: %d %s", res.StatusCode, body)
	}
}

// A process stream whose sandbox is killed under it ends with the error
// the e2b SDK reads as a dropped connection (Connect unknown,
// "terminated"), not with "execution replaced".
func TestKilledDuringStreamEndsTerminated(t *testing.T) {
	for _, c := range codecs {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			h.edge.reattachBackoff = 5 * time.Millisecond
			r1 := h.sandbox("sbx1")
			serveProcess(h.node, &fakeProcess{start: func(_ context.Context, _ *connect.Request[processpb.StartRequest], s *connect.ServerStream[processpb.StartResponse]) error {
				_ = s.Send(&processpb.StartResponse{Event: startEv(testPid)})
				_ = s.Send(&processpb.StartResponse{Event: stdoutEv("one\n")})
				// Killed: the control plane forgets it (404), the worker
				// ends the stream as for any retired execution.
				h.cp.mu.Lock()
				delete(h.cp.routes, "sbx1")
				h.cp.mu.Unlock()
				return replacedErr(r1)
			}})
			got := startProcess(t, h, c, "sbx1")
			var ce *connect.Error
			if !errors.As(got.err, &ce) || ce.Code() != connect.CodeUnknown || !strings.HasPrefix(ce.Message(), "terminated") {
				t.Fatalf("client saw %+v (err %v), want unknown: terminated", got, got.err)
			}
			if got.out != "one\n" || len(got.starts) != 1 {
				t.Fatalf("output lost: %+v", got)
			}
		})
	}
}
