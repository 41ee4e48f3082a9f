package sbxmanager

// The lease writer: a forwarded response that outlives its execution's
// lease ends with "execution replaced", at a Connect message boundary
// when it can.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/envelope"
	"github.com/spacesbx/space/internal/identity"
)

// leaseWriter wraps the ResponseWriter of a forwarded request so that a
// lease that ends mid-response (the execution was replaced, retired or torn
// down) ends the response with a clear "execution replaced" status instead
// of a silently cut connection:
//
//   - Connect streams (application/connect+json or +proto) end with a
//     Connect end-of-stream message (flag 0x02) carrying
//     {"error":{"code":"unavailable","message":"execution replaced: ..."}},
//     written at a message boundary (the wrapper tracks the envelopes that
//     pass through). If the guest's own end-of-stream already went out the
//     stream is left as it is; if the cut falls inside a message the
//     connection is aborted (a partial message cannot be completed).
//   - A response whose headers had not gone out yet is replaced: Connect
//     streaming requests get HTTP 200 with just that end-of-stream message
//     (how a Connect server reports a stream error), others 503 with the
//     JSON error reason "execution replaced" (no Space-Route-Outcome: the
//     request may have reached the old guest, so it is not a pre-forward
//     rejection and the edge must not replay it blindly).
//   - Any other response that was already streaming is aborted (the
//     client sees the body end early, never a truncated body that looks
//     complete).
type leaseWriter struct {
	w          http.ResponseWriter
	lease      context.Context
	route      identity.Route
	reqConnect string // Content-Type of a Connect streaming request, else ""

	tx        *atomic.Int64 // the activation's response bytes
	status    int
	swallowed bool // the answer was written after the lease ended: replaced
	connect   bool // the response is a Connect stream

	// env follows the envelopes of a Connect response that went out.
	env envelope.Splitter
}

func newLeaseWriter(w http.ResponseWriter, r *http.Request, act *activation, lease context.Context) *leaseWriter {
	lw := &leaseWriter{w: w, lease: lease, route: act.route, tx: &act.use.txBytes}
	if ct := r.Header.Get("Content-Type"); strings.HasPrefix(ct, "application/connect+") {
		lw.reqConnect = ct
	}
	return lw
}

func (lw *leaseWriter) Header() http.Header { return lw.w.Header() }

func (lw *leaseWriter) WriteHeader(code int) {
	if lw.status != 0 {
		return
	}
	if code >= 100 && code < 200 {
		if lw.lease.Err() == nil {
			lw.w.WriteHeader(code)
		}
		return
	}
	lw.status = code
	if lw.lease.Err() != nil {
		lw.swallowed = true
		return
	}
	lw.connect = strings.HasPrefix(lw.w.Header().Get("Content-Type"), "application/connect+")
	lw.w.WriteHeader(code)
}

func (lw *leaseWriter) Write(p []byte) (int, error) {
	if lw.status == 0 {
		lw.WriteHeader(http.StatusOK)
	}
	if lw.swallowed {
		return len(p), nil
	}
	n, err := lw.w.Write(p)
	lw.tx.Add(int64(n))
	if lw.connect {
		lw.env.Feed(p[:n], nil)
	}
	return n, err
}

func (lw *leaseWriter) Flush() {
	if !lw.swallowed && lw.status != 0 {
		http.NewResponseController(lw.w).Flush()
	}
}

// Unwrap lets http.ResponseController reach the server's writer (full
// duplex, hijack for upgrades, deadlines).
func (lw *leaseWriter) Unwrap() http.ResponseWriter { return lw.w }

func (lw *leaseWriter) replacedMessage() string {
	return fmt.Sprintf("%s: sandbox %s execution %s (generation %d) is no longer served by worker %s; reconnect to the current execution",
		spacev1.ReasonExecutionReplaced, lw.route.SandboxID, lw.route.ExecutionID, lw.route.Generation, lw.route.WorkerID)
}

func (lw *leaseWriter) endStreamFrame() []byte {
	return envelope.EndStreamFrame("unavailable", lw.replacedMessage())
}

// finish is deferred around the proxy: it recovers the proxy's
// http.ErrAbortHandler (a body copy cut by the lease) and ends the
// response as described on leaseWriter. Other panics propagate.
func (lw *leaseWriter) finish() {
	p := recover()
	if p != nil && p != http.ErrAbortHandler {
		panic(p)
	}
	if lw.lease.Err() == nil {
		if p != nil {
			panic(p)
		}
		return
	}
	switch {
	case lw.status == 0 || lw.swallowed:
		h := lw.w.Header()
		clear(h)
		if lw.reqConnect != "" {
			h.Set("Content-Type", lw.reqConnect)
			lw.w.WriteHeader(http.StatusOK)
			lw.w.Write(lw.endStreamFrame())
			return
		}
		h.Set("Content-Type", "application/json")
		lw.w.WriteHeader(http.StatusServiceUnavailable)
		json.NewEncoder(lw.w).Encode(spacev1.Error{Code: http.StatusServiceUnavailable, Message: lw.replacedMessage(), Reason: spacev1.ReasonExecutionReplaced})
	case lw.connect && lw.env.Ended():
		// The guest ended the stream itself.
		if p != nil && !lw.env.AtBoundary() {
			panic(p)
		}
	case lw.connect && lw.env.AtBoundary():
		if _, err := lw.w.Write(lw.endStreamFrame()); err == nil {
			http.NewResponseController(lw.w).Flush()
		}
	case lw.connect:
		panic(http.ErrAbortHandler) // cut inside a message: abort
	default:
		if p != nil {
			panic(p)
		}
	}
}
