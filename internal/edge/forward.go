package edge

// Forwarding to node-api: the proxy's rewrite, response and error hooks,
// and its transport, which attaches the capability and performs route
// repair and transport retries.

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"sync"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/telemetry"
)

// rewrite prepares the outbound request; the forwarder sets the node URL
// and capability per attempt.
func (e *Edge) rewrite(pr *httputil.ProxyRequest) {
	pr.SetXForwarded()
	pr.Out.Header.Del(spacev1.HeaderAccessToken)
	pr.Out.Header.Del(spacev1.HeaderCapability)
	pr.Out.Header.Del(spacev1.HeaderAPIKey)
	pr.Out.Header.Del(HeaderTrafficAccessToken)
	// The client's trace context stops here on every path out (attempts,
	// reattaches): the edge's span is what node-api continues.
	telemetry.Inject(pr.Out.Context(), pr.Out.Header)
	if st, _ := pr.In.Context().Value(stateKey{}).(*reqState); st != nil && st.t.purpose == capability.PurposeServicePort {
		// Whether the client addressed the port by Host or by header,
		// node-api and netgtw learn it from these (client values replaced).
		pr.Out.Header.Set(HeaderSandboxID, st.t.sandbox)
		pr.Out.Header.Set(HeaderSandboxPort, strconv.Itoa(st.t.port))
		// The Host the sandbox's service sees: the client's, or the
		// sandbox's maskRequestHost with ${PORT} filled in.
		host := pr.In.Host
		if st.entry != nil && st.entry.mask != "" {
			host = strings.ReplaceAll(st.entry.mask, "${PORT}", strconv.Itoa(st.t.port))
		}
		pr.Out.Header.Set(spacev1.HeaderRequestHost, host)
	} else {
		pr.Out.Header.Del(spacev1.HeaderRequestHost)
	}
	pr.Out.Host = ""
}

func (e *Edge) modifyResponse(res *http.Response) error {
	st, _ := res.Request.Context().Value(stateKey{}).(*reqState)
	if st != nil && isPausedAnswer(res) {
		// node-api refused because the execution is frozen: answer what
		// the control plane's refusal becomes (pausedError).
		status, h, b := errorResponse(pausedError(st.t.sandbox))
		res.Body.Close()
		res.StatusCode, res.Status = status, ""
		res.Header = h
		res.Body = io.NopCloser(bytes.NewReader(b))
		res.ContentLength = int64(len(b))
		return nil
	}
	if res.StatusCode == http.StatusForbidden && res.Header.Get(spacev1.HeaderRouteOutcome) == spacev1.OutcomeDeny && st != nil {
		e.metrics.denies.WithLabelValues(string(st.t.purpose)).Inc()
		e.log.WarnContext(res.Request.Context(), "receiver denied capability", "sandbox", st.t.sandbox, "purpose", st.t.purpose, "route", st.entry.route.String())
	}
	return nil
}

func (e *Edge) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case classified(err):
		writeError(w, err)
	case r.Context().Err() != nil:
		// Client went away; nothing to answer.
	default:
		e.log.WarnContext(r.Context(), "forwarding to node failed", "err", err)
		// The route may name a worker that is gone or restarted on another
		// address: the next request asks the control plane again instead
		// of dialing it until the capability expires.
		if st, _ := r.Context().Value(stateKey{}).(*reqState); st != nil && st.entry != nil {
			e.deleteIf(st.key, st.entry)
		}
		writeError(w, answer(errdefs.ErrUpstream, "node_unreachable", "sandbox node unreachable"))
	}
}

// forwarder is the proxy's transport: it addresses the selected node-api,
// attaches the capability and performs route repair and transport retries.
type forwarder struct{ e *Edge }

func (f *forwarder) RoundTrip(out *http.Request) (*http.Response, error) {
	e := f.e
	st, _ := out.Context().Value(stateKey{}).(*reqState)
	if st == nil {
		return nil, errors.New("edge: request without route state")
	}
	ctx := out.Context()
	res, err := f.send(out, st, st.entry)
	if err != nil && st.t.idempotent && st.held && ctx.Err() == nil {
		e.metrics.retries.Inc()
		e.log.Info("retrying idempotent read after transport failure", "sandbox", st.t.sandbox, "path", out.URL.Path, "err", err)
		res, err = f.send(out, st, st.entry)
	}
	if err != nil {
		return nil, err
	}
	if res, err = f.resumeOnPaused(out, st, res); err != nil { // autoresume.go
		return nil, err
	}
	if res.StatusCode != http.StatusMisdirectedRequest || res.Header.Get(spacev1.HeaderRouteOutcome) != spacev1.OutcomeRefreshRoute {
		return e.watchProcess(out, st, st.entry, res), nil
	}
	if !st.held {
		e.metrics.repairs.WithLabelValues("not_replayable").Inc()
		e.log.Warn("refresh-route for a streamed body; returned to client", "sandbox", st.t.sandbox)
		// The entry is stale anyway: the next request re-resolves it.
		e.deleteIf(st.key, st.entry)
		return res, nil
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, 64<<10))
	res.Body.Close()
	ne, err := e.repair(ctx, st.key, st.t, st.entry)
	if err != nil {
		e.metrics.repairs.WithLabelValues("resolve_failed").Inc()
		return nil, err
	}
	e.metrics.repairs.WithLabelValues("rebuilt").Inc()
	// Exactly one rebuilt attempt: its answer, even another 421, goes to
	// the client.
	res, err = f.send(out, st, ne)
	if err != nil {
		return nil, err
	}
	return e.watchProcess(out, st, ne, res), nil
}

// send makes one attempt against ent's node with ent's capability.
func (f *forwarder) send(out *http.Request, st *reqState, ent *entry) (*http.Response, error) {
	req := out.Clone(out.Context())
	u := *ent.node
	u.Path = joinPath(ent.node.Path, out.URL.Path)
	u.RawPath = ""
	u.RawQuery = out.URL.RawQuery
	req.URL = &u
	req.Host = ""
	req.Header.Set(spacev1.HeaderCapability, ent.token)
	telemetry.Inject(req.Context(), req.Header) // never the client's trace context
	switch {
	case st.held && len(st.body) > 0:
		req.Body = io.NopCloser(bytes.NewReader(st.body))
		req.ContentLength = int64(len(st.body))
		req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(st.body)), nil }
	case st.held:
		req.Body = nil
		req.ContentLength = 0
	default:
		req.Body = st.streamBody
		st.held = false
	}
	return f.e.cfg.NodeTransport.RoundTrip(req)
}

func joinPath(base, p string) string {
	if base == "" || base == "/" {
		return p
	}
	if base[len(base)-1] == '/' {
		return base + p[1:]
	}
	return base + p
}

// isPausedAnswer reports whether res is node-api's 409 for a paused
// execution (a small JSON error with reason "paused"). It reads at most a
// few KiB and restores the body when the answer is something else.
func isPausedAnswer(res *http.Response) bool {
	if res.StatusCode != http.StatusConflict || !strings.HasPrefix(res.Header.Get("Content-Type"), "application/json") {
		return false
	}
	const max = 4 << 10
	b, err := io.ReadAll(io.LimitReader(res.Body, max+1))
	res.Body = struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(b), res.Body), res.Body}
	if err != nil || len(b) > max {
		return false
	}
	var ae spacev1.Error
	return json.Unmarshal(b, &ae) == nil && ae.Reason == spacev1.ReasonPaused
}

// proxyBufSize is the proxy's copy buffer (httputil.ReverseProxy's own
// size); pooled, so a forwarded request does not allocate and zero 32 KiB.
const proxyBufSize = 32 << 10

type bufferPool struct{ p sync.Pool }

func newBufferPool() *bufferPool {
	return &bufferPool{p: sync.Pool{New: func() any { b := make([]byte, proxyBufSize); return &b }}}
}

func (bp *bufferPool) Get() []byte { return *(bp.p.Get().(*[]byte)) }

func (bp *bufferPool) Put(b []byte) {
	if cap(b) != proxyBufSize {
		return
	}
	b = b[:proxyBufSize]
	bp.p.Put(&b)
}
