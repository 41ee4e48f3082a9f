package sbxmanager

// The data plane: a guest API request is admitted, then forwarded to its
// activation's spaced-host over a transport that verifies every connection
// and never retries a request on a second one.

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/telemetry"
)

// ServeHTTP serves the guest API paths (/files, /process.Process/...,
// /filesystem.Filesystem/...) for every sandbox on this worker, routed by
// the capability's sandbox. Nothing is forwarded before admission.
func (m *Manager) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if m.fence.epoch().Err() != nil {
		m.refuseFenced(w) // serves nothing for any sandbox, before admission
		return
	}
	if isServicePort(r) {
		m.serveServicePort(w, r) // admitted here, then again at netgtw
		return
	}
	purpose, ok := capability.PurposeForEnvdPath(r.URL.Path)
	if !ok {
		m.writeError(w, fmt.Errorf("%w: no such guest API path %q", errdefs.ErrNotFound, r.URL.Path))
		return
	}
	ctx, span := telemetry.StartSpan(r.Context(), telemetry.ScopeSbxManager, "sbx-manager admit", telemetry.AttrPurpose.String(string(purpose)), telemetry.AttrWorker.String(m.cfg.WorkerID))
	defer span.End()
	r = r.WithContext(ctx)
	var sandbox string
	var act *activation
	if m.cfg.UnsafeSkipIdentityChecks {
		sandbox = r.Header.Get("E2b-Sandbox-Id")
		m.mu.RLock()
		act = m.active[sandbox]
		m.mu.RUnlock()
	} else {
		ad := m.Admit(r.Header.Get(spacev1.HeaderCapability), purpose)
		traceDecision(ctx, ad)
		if !m.judge(w, ad, purpose, r.URL.Path) {
			return
		}
		sandbox, act = ad.Claims.SandboxID, ad.act
		if act != nil && act.route != ad.Claims.Route {
			// Cannot happen while record and activation change together;
			// never forward to another execution than the admitted one.
			writeOutcome(w, http.StatusMisdirectedRequest, spacev1.OutcomeRefreshRoute, "execution replaced")
			return
		}
	}
	if m.testHookAdmitted != nil {
		m.testHookAdmitted()
	}
	if act == nil {
		// The record is live but nothing runs it: the worker restarted.
		m.writeError(w, fmt.Errorf("%w: execution of %s is installed but not active on this worker", errdefs.ErrUnavailable, sandbox))
		return
	}
	if act.awaitingView.Load() {
		m.writeError(w, awaitingViewError(sandbox))
		return
	}
	// Replaced, retired or torn down since admission, or the worker
	// fenced: the lease has ended.
	ctx, lease, release, ok := act.leaseContext(r.Context(), m.fence.epoch())
	if !ok {
		m.refuseEnded(w)
		return
	}
	defer release()
	// The proxy's transport reads the request body while the response
	// streams back: without full duplex the server would discard and close
	// that body when the (flushed) response headers go out, failing the
	// transport's body write and cutting the response short.
	_ = http.NewResponseController(w).EnableFullDuplex()
	// In full duplex the handler must close an unread body itself before
	// returning, or the server's next read panics (golang/go#68560).
	defer r.Body.Close()
	if !isStream(r) {
		act.gate.RLock() // Pause waits for unary requests in flight
		defer act.gate.RUnlock()
	}
	if r.URL.Path == startPath {
		act.starts.Add(1) // before the paused check: Pause sees it or refuses it
		defer act.starts.Add(-1)
	}
	if act.paused.Load() {
		m.writeError(w, pausedError(sandbox)) // never into a frozen guest
		return
	}
	act.use.requests.Add(1)
	if r.Body != nil && r.Body != http.NoBody {
		r.Body = countingBody{r.Body, &act.use.rxBytes}
	}
	// A lease that ends mid-response ends it with "execution replaced".
	lw := newLeaseWriter(w, r, act, lease)
	defer lw.finish()
	act.proxy.ServeHTTP(lw, r.WithContext(ctx))
}

// leaseContext derives a request context that ends with the request's
// lease, so replacing the execution (or fencing the worker: epoch, the
// manager's serving epoch, ends) cuts the request and any stream it opens.
// lease is the lease itself (it ends with the activation's or the epoch).
// ok is false when the lease has already ended.
func (a *activation) leaseContext(parent, epoch context.Context) (ctx, lease context.Context, release func(), ok bool) {
	lease, lcancel := context.WithCancel(a.ctx)
	stopEpoch := context.AfterFunc(epoch, lcancel)
	ctx, cancel := context.WithCancel(parent)
	stop := context.AfterFunc(lease, cancel)
	release = func() { stop(); cancel(); stopEpoch(); lcancel() }
	if a.ctx.Err() != nil || epoch.Err() != nil {
		release()
		return nil, nil, nil, false
	}
	return ctx, lease, release, true
}

// refuseEnded answers a request whose lease ended between admission and
// forwarding: the worker was fenced meanwhile, or the execution replaced.
func (m *Manager) refuseEnded(w http.ResponseWriter) {
	if m.fence.epoch().Err() != nil {
		m.refuseFenced(w)
		return
	}
	writeOutcome(w, http.StatusMisdirectedRequest, spacev1.OutcomeRefreshRoute, "execution replaced")
}

// startPath starts a command; Pause waits a little for these to finish.
const startPath = "/process.Process/Start"

// isStream reports whether r opens a Connect stream (process output, PTY,
// watch): those live until their lease ends and are not waited for.
func isStream(r *http.Request) bool {
	return strings.HasPrefix(r.Header.Get("Content-Type"), "application/connect+")
}

func writeOutcome(w http.ResponseWriter, status int, outcome, reason string) {
	w.Header().Set(spacev1.HeaderRouteOutcome, outcome)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(spacev1.Error{Code: status, Message: reason, Reason: outcome})
}

// unreachable is the refusal of a request whose forwarding to what (the
// sandbox bridge, the service-port gateway) failed: unavailable, and only
// a classed cause's text reaches the client (ErrBridgeConnLost says the
// request was not retried); a raw transport error names host sockets and
// is logged here instead.
func (m *Manager) unreachable(what string, r *http.Request, err error) error {
	if errdefs.Reason(err) != "internal" {
		return fmt.Errorf("%w: %s: %w", errdefs.ErrUnavailable, what, err)
	}
	if r.Context().Err() == nil {
		m.log.WarnContext(r.Context(), what+" request failed", "path", r.URL.Path, "err", err)
	}
	return fmt.Errorf("%w: %s unreachable", errdefs.ErrUnavailable, what)
}

// pausedError is the refusal of a request for a paused execution (a
// conflict with reason "paused").
func pausedError(sandbox string) error {
	return errdefs.WithReason(errdefs.Message(errdefs.ErrConflict,
		fmt.Sprintf("sandbox %s is paused: resume it (or connect) and retry", sandbox)), ReasonPaused)
}

// ErrBridgeConnLost means a request's connection to spaced-host failed and
// the request was not retried on another connection. Its class is
// errdefs.ErrUnavailable; its text (quoted in the 503 a request gets) is
// its own.
var ErrBridgeConnLost = errdefs.Message(errdefs.ErrUnavailable, "bridge connection lost; not retried")

// newBridgeTransport returns the HTTP transport to one spaced-host: every
// new connection is verified by verify before use, and the RoundTripper to
// use refuses the transport's transparent retries: net/http re-sends an
// idempotent (or unsent, bodiless) request on another connection when a
// reused one turns out closed; a bridge connection that drops fails the
// operation on it instead.
func newBridgeTransport(sock string, verify func(net.Conn) error) (*http.Transport, http.RoundTripper) {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			c, err := d.DialContext(ctx, "unix", sock)
			if err != nil {
				return nil, err
			}
			if err := verify(c); err != nil {
				c.Close()
				return nil, fmt.Errorf("bridge endpoint verification: %w", err)
			}
			return c, nil
		},
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
	}
	return tr, telemetry.Transport(noRetryTransport{tr}) // spaced-host's parent is the admission span
}

// noRetryTransport lets a request use one connection only. The transport
// reports each connection it takes for a request (httptrace GotConn); a
// second one is a retry, and that connection is closed before the request
// is written to it, so the attempt fails and the error reaches the caller.
type noRetryTransport struct{ tr *http.Transport }

func (n noRetryTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	var conns atomic.Int32
	trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
		if conns.Add(1) > 1 {
			info.Conn.Close()
		}
	}}
	resp, err := n.tr.RoundTrip(req.WithContext(httptrace.WithClientTrace(req.Context(), trace)))
	if err != nil && conns.Load() > 1 {
		return nil, fmt.Errorf("%w: %v", ErrBridgeConnLost, err)
	}
	return resp, err
}
