package edge

// Reattaching process streams across a move (DESIGN.md section 7).
//
// The edge follows the Connect envelopes of every process.Process/Start and
// process.Process/Connect response it forwards. Bytes pass to the client as
// they arrive; only two kinds of message are looked at: the first one (the
// StartEvent, for the pid) and the end-of-stream message, which is held
// until it is complete. When the end-of-stream message is sbx-manager's
// "execution replaced" error and the pid is known, the edge does not
// forward it. Instead it resolves the sandbox's current route through route
// repair (a new capability; the new backend stream passes admission again),
// opens process.Process/Connect {process:{pid}} on the new execution with
// the client's original headers and codec, drops that stream's StartEvent
// and forwards the rest into the same client response.
//
// Bounds: ReattachAttempts backend attempts within ReattachWindow per
// replacement. While the control plane still names the replaced route, or
// answers that the sandbox is moving (409, 421, 5xx), the edge waits with
// backoff without spending an attempt. If the new execution has no such
// process (the ns substrate restarts processes: Connect answers
// not_found), or the attempts or the window run out, the client gets the
// original "execution replaced" end-of-stream message unchanged. Everything
// runs inside the proxy's body copy, on the client's context: a client that
// goes away cancels it, and no goroutine is started.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/envelope"
)

const (
	processStartPath   = "/process.Process/Start"
	processConnectPath = "/process.Process/Connect"
	// maxReattachBackoff caps the wait between reattach tries.
	maxReattachBackoff     = 2 * time.Second
	defaultReattachBackoff = 100 * time.Millisecond
)

// Reattach results (space_edge_stream_reattaches_total{result}).
const (
	reattachOK        = "reattached"
	reattachGone      = "process_gone"
	reattachFailed    = "failed"
	reattachCancelled = "client_gone"
)

// watchProcess wraps the body of a process Start/Connect stream that ent's
// node answered so that an "execution replaced" end is turned into a
// reattach. Other responses are returned unchanged.
func (e *Edge) watchProcess(out *http.Request, st *reqState, ent *entry, res *http.Response) *http.Response {
	if e.cfg.ReattachAttempts <= 0 || st.t.purpose != capability.PurposeProcess || res.StatusCode != http.StatusOK {
		return res
	}
	path := out.URL.Path
	if path != processStartPath && path != processConnectPath {
		return res
	}
	c := codecOf(res.Header.Get("Content-Type"))
	if c == codecNone || c != codecOf(out.Header.Get("Content-Type")) {
		return res
	}
	ps := &processStream{
		e: e, ctx: out.Context(), out: out, st: st, codec: c, started: time.Now(),
		ent: ent, cur: res.Body, curEnc: res.Header.Get("Connect-Content-Encoding"),
		buf: make([]byte, 32<<10),
	}
	if path == processConnectPath && st.held {
		ps.pid, ps.havePid = selectedPid(c, st.body, out.Header.Get("Connect-Content-Encoding"))
	}
	if v := out.Header.Get("Connect-Timeout-Ms"); v != "" {
		if ms, err := strconv.ParseInt(v, 10, 64); err == nil && ms > 0 {
			ps.timeout = time.Duration(ms) * time.Millisecond
		}
	}
	res.Body = ps
	return res
}

func (s *processStream) onEnd() {
	frame := envelope.Frame(s.flags, s.held)
	var ee envelope.EndError
	pl, ok := payloadOf(s.flags, s.held, s.curEnc)
	if ok {
		var err error
		ee, err = envelope.ParseEnd(pl)
		ok = err == nil
	}
	if s.pendingAttach {
		switch {
		case ok && processNotFound(ee):
			s.lastFailure = "process not found: " + ee.Message
			s.finish(reattachGone)
		case ok && executionReplaced(ee):
			// Moved again before the stream got going: wait for a route
			// other than this one.
			s.lastFailure = "replaced again"
			s.fromRoute = s.ent.route
			s.reattach()
		default:
			s.lastFailure = fmt.Sprintf("stream ended before its StartEvent: %s %s", ee.Code, ee.Message)
			s.finish(reattachFailed)
		}
		return
	}
	if !ok || !executionReplaced(ee) || !s.havePid || !s.withinTimeout() {
		s.pending = append(s.pending, frame...)
		return
	}
	s.replacedEnd = frame
	s.fromRoute = s.ent.route
	s.deadline = time.Now().Add(s.e.cfg.ReattachWindow)
	s.attempts = 0
	s.backoff = reattachBackOff(s.e.reattachBackoff)
	s.lastFailure = ""
	s.e.log.Info("process stream's execution replaced; reattaching", "sandbox", s.st.t.sandbox, "pid", s.pid,
		"generation", s.fromRoute.Generation, "execution", s.fromRoute.ExecutionID, "worker", s.fromRoute.WorkerID)
	s.reattach()
}

// onReattachStart checks the first message of a reattached stream: the
// StartEvent of the same pid, which the client normally saw already.
func (s *processStream) onReattachStart() {
	pl, ok := payloadOf(s.flags, s.held, s.curEnc)
	var pid uint32
	if ok {
		pid, ok = startPid(s.codec, pl)
	}
	if !ok || pid != s.pid {
		s.lastFailure = "first message is not the process's StartEvent"
		s.finish(reattachFailed)
		return
	}
	if !s.timer.Stop() {
		// The window passed as the StartEvent came: the request is cancelled.
		s.lastFailure = "reattach window passed"
		s.finish(reattachFailed)
		return
	}
	s.timer = nil
	s.pendingAttach = false
	s.replacedEnd = nil
	if !s.clientStarted {
		// The replaced stream ended before its first message (a Connect
		// call whose pid came from the request): this is the client's
		// StartEvent.
		s.pending = append(s.pending, envelope.Frame(s.flags, s.held)...)
		s.clientStarted = true
	}
	s.e.metrics.reattaches.WithLabelValues(reattachOK).Inc()
	s.e.log.Info("process stream reattached", "sandbox", s.st.t.sandbox, "pid", s.pid,
		"old_generation", s.fromRoute.Generation, "old_execution", s.fromRoute.ExecutionID,
		"new_generation", s.ent.route.Generation, "new_execution", s.ent.route.ExecutionID,
		"worker", s.ent.route.WorkerID, "attempts", s.attempts)
}

// withinTimeout reports whether the client's call has time left.
func (s *processStream) withinTimeout() bool {
	return s.timeout == 0 || time.Since(s.started) < s.timeout
}

// reattach schedules a reattach: Read first hands the client what is
// already queued (output that arrived with the end of the old stream must
// not wait for the new one), then runs it.
func (s *processStream) reattach() {
	s.reattachDue = true
	s.switched = true // the rest of the old stream's chunk is dropped
}

// runReattach tries to open the process on the current execution until a
// stream is open (then the parser takes over), or gives up.
func (s *processStream) runReattach() {
	s.closeCur()
	for {
		switch {
		case s.ctx.Err() != nil:
			s.abandon()
			return
		case s.attempts >= s.e.cfg.ReattachAttempts:
			s.lastFailure = fmt.Sprintf("%d attempts failed; last: %s", s.attempts, s.lastFailure)
			s.finish(reattachFailed)
			return
		case !time.Now().Before(s.deadline):
			s.lastFailure = "reattach window passed; last: " + s.lastFailure
			s.finish(reattachFailed)
			return
		case !s.withinTimeout():
			s.lastFailure = "the call's timeout passed"
			s.finish(reattachFailed)
			return
		}
		ent, err := s.e.reattachRoute(s.ctx, s.st, s.ent)
		if err != nil {
			if s.ctx.Err() != nil {
				continue
			}
			s.lastFailure = "resolving route: " + err.Error()
			s.gone = isNotFound(err)
			if !moving(err) {
				s.finish(reattachFailed)
				return
			}
			s.wait()
			continue
		}
		s.ent = ent
		if ent.route == s.fromRoute {
			s.lastFailure = "control plane still names the replaced execution"
			s.wait()
			continue
		}
		s.attempts++
		res, cancel, timer, err := s.open(ent)
		if err != nil {
			if s.ctx.Err() == nil {
				s.lastFailure = "opening stream: " + err.Error()
				s.wait()
			}
			continue
		}
		if res.StatusCode == http.StatusOK && codecOf(res.Header.Get("Content-Type")) == s.codec {
			s.switchTo(res, cancel, timer)
			return
		}
		s.lastFailure = fmt.Sprintf("node answered %d", res.StatusCode)
		if o := res.Header.Get(spacev1.HeaderRouteOutcome); o != "" {
			s.lastFailure += " " + o
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, 64<<10))
		res.Body.Close()
		timer.Stop()
		cancel()
		if !retryableStatus(res.StatusCode) {
			s.finish(reattachFailed)
			return
		}
		s.wait()
	}
}

// open sends process.Process/Connect for s.pid to ent's node. The request
// is cancelled if it has not delivered its StartEvent when the window ends.
func (s *processStream) open(ent *entry) (*http.Response, context.CancelFunc, *time.Timer, error) {
	body, err := connectRequestBody(s.codec, s.pid)
	if err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithCancel(s.ctx)
	timer := time.AfterFunc(time.Until(s.deadline), cancel)
	req := s.out.Clone(ctx)
	u := *ent.node
	u.Path = joinPath(ent.node.Path, processConnectPath)
	u.RawPath, u.RawQuery = "", ""
	req.URL, req.Host, req.Method = &u, "", http.MethodPost
	req.Header.Set(spacev1.HeaderCapability, ent.token)
	req.Header.Set("Content-Type", s.codec.contentType())
	// The edge must read the new stream's StartEvent: ask for none.
	req.Header.Del("Connect-Content-Encoding")
	req.Header.Del("Connect-Accept-Encoding")
	req.Header.Del("Content-Length")
	if s.timeout > 0 {
		left := s.timeout - time.Since(s.started)
		req.Header.Set("Connect-Timeout-Ms", strconv.FormatInt(max(left.Milliseconds(), 1), 10))
	}
	req.Body = io.NopCloser(bytes.NewReader(body))
	req.ContentLength = int64(len(body))
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	res, err := s.e.cfg.NodeTransport.RoundTrip(req)
	if err != nil {
		timer.Stop()
		cancel()
		return nil, nil, nil, err
	}
	return res, cancel, timer, nil
}

// switchTo makes res the upstream; its first message decides.
func (s *processStream) switchTo(res *http.Response, cancel context.CancelFunc, timer *time.Timer) {
	s.closeCur()
	s.cur, s.curEnc, s.cancel, s.timer = res.Body, res.Header.Get("Connect-Content-Encoding"), cancel, timer
	s.pendingAttach = true
	s.hdrN, s.left, s.msgs, s.raw, s.held = 0, 0, 0, false, s.held[:0]
	s.switched = true
}

// reattachBackOff doubles from first up to maxReattachBackoff, without
// jitter: one stream's tries need spacing, not spreading.
func reattachBackOff(first time.Duration) *backoff.ExponentialBackOff {
	return &backoff.ExponentialBackOff{InitialInterval: first, Multiplier: 2, MaxInterval: maxReattachBackoff}
}

// wait sleeps the next backoff (bounded by the window).
func (s *processStream) wait() {
	d := min(s.backoff.NextBackOff(), time.Until(s.deadline))
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-s.ctx.Done():
	}
}

// finish gives up on this replacement: the client gets the original
// "execution replaced" end-of-stream message, or killedEnd when the
// sandbox is gone.
func (s *processStream) finish(result string) {
	s.closeCur()
	if s.gone {
		s.pending = append(s.pending, killedEnd(s.st.t.sandbox)...)
	} else {
		s.pending = append(s.pending, s.replacedEnd...)
	}
	s.err = io.EOF
	s.switched = true
	s.e.metrics.reattaches.WithLabelValues(result).Inc()
	end := "execution replaced"
	if s.gone {
		end = "terminated (sandbox gone)"
	}
	s.e.log.Warn("process stream not reattached; ending it", "end", end, "sandbox", s.st.t.sandbox,
		"pid", s.pid, "result", result, "generation", s.fromRoute.Generation, "execution", s.fromRoute.ExecutionID,
		"attempts", s.attempts, "reason", s.lastFailure)
}

// abandon ends everything for a client that went away.
func (s *processStream) abandon() {
	s.closeCur()
	if s.replacedEnd != nil {
		s.e.metrics.reattaches.WithLabelValues(reattachCancelled).Inc()
	}
	s.err = s.ctx.Err()
	s.switched = true
}

// reattachRoute resolves the current route for a stream that was served
// by old: route repair (edge key, same authorization bound) while the
// caller's authorization lasts, else a fresh authorization with the
// caller's token.
func (e *Edge) reattachRoute(ctx context.Context, st *reqState, old *entry) (*entry, error) {
	if e.cfg.Clock().Before(old.authorizedUntil) {
		return e.repair(ctx, st.key, st.t, old)
	}
	cr, err := e.fetchCapability(ctx, st.t, st.callerToken, false)
	if err != nil {
		return nil, err
	}
	until := cr.AuthorizedUntil
	if until.IsZero() {
		until = cr.ExpiresAt
	}
	ne := newEntry(cr, until)
	e.store(st.key, ne)
	return ne, nil
}

// moving reports a control-plane answer that may change while a move
// completes (the caller waits and asks again).
func moving(err error) bool {
	if !classified(err) || isNotFound(err) {
		return false
	}
	return retryableStatus(errorStatus(err))
}

// retryableStatus: paused, refresh-route, and unavailable answers.
func retryableStatus(code int) bool {
	switch code {
	case http.StatusConflict, http.StatusMisdirectedRequest, http.StatusTooManyRequests,
		http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// killedEnd ends a process stream whose sandbox was killed (or timed out)
// while it ran. E2B's proxy drops the connection then, which the e2b SDK
// sees as a Connect "unknown" error whose message names the dropped
// connection ("terminated" in Node); it then probes /health (502: the
// sandbox is gone) and raises TimeoutError "... The sandbox was killed or
// reached its end of life while the request was in flight". This
// end-of-stream message gives the SDK the same error, so it reaches the
// same conclusion (instead of "execution replaced", which it would
// present as a sandbox timeout).
func killedEnd(sandbox string) []byte {
	return envelope.EndStreamFrame("unknown", "terminated: sandbox "+sandbox+" is gone")
}
