package bridge

// Forwarding: each manager request goes over its manager connection's
// own verified guest connection; hop-by-hop headers stay behind.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/telemetry"
	"github.com/spacesbx/space/internal/telemetry/guestspan"
)

var hopHeaders = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

func (b *Bridge) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	gc, _ := r.Context().Value(connKey{}).(*guestConn)
	if gc == nil {
		http.Error(w, "no connection state", http.StatusInternalServerError)
		return
	}
	// The guest may answer (and the stream's headers be flushed) before
	// the caller's body is fully sent; without full duplex the server
	// would close the unread body and cut the stream.
	_ = http.NewResponseController(w).EnableFullDuplex()
	// In full duplex the handler must close an unread body itself before
	// returning, or the server's next read panics (golang/go#68560).
	defer r.Body.Close()
	ctx, span := telemetry.ServerSpan(r, telemetry.ScopeBridge, "spaced-host "+r.URL.Path, telemetry.Trusted, b.spanAttrs...)
	status := http.StatusOK
	defer func() { telemetry.EndHTTP(span, status) }()
	r = r.WithContext(ctx)
	gc.mu.Lock()
	defer gc.mu.Unlock()
	if gc.broken != nil {
		status = http.StatusBadGateway
		b.fail(w, gc.broken)
		return
	}
	if gc.conn == nil {
		ctx, cancel := context.WithTimeout(r.Context(), b.cfg.DialTimeout)
		c, err := b.dialGuest(ctx)
		cancel()
		if err != nil {
			gc.broken = err
			b.cfg.Logger.Warn("bridge: guest connection refused", "sandbox", b.cfg.Expected.SandboxID, "err", err)
			b.fail(w, err)
			status = http.StatusBadGateway
			return
		}
		gc.conn, gc.br = c.conn, c.br
	}
	st, err := b.forward(w, r, gc)
	status = st
	if err != nil {
		gc.broken = err
		gc.conn.Close()
		if b.vm != nil && errors.Is(err, errGuestBodyCut) {
			// The response's headers are out: abort the manager's
			// connection so the cut stream cannot look complete.
			panic(http.ErrAbortHandler)
		}
	}
}

// errGuestBodyCut: the guest's response body failed midway.
var errGuestBodyCut = errors.New("guest response cut")

func (b *Bridge) fail(w http.ResponseWriter, err error) {
	w.Header().Set("Connection", "close")
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusBadGateway)
	json.NewEncoder(w).Encode(spacev1.Error{Code: http.StatusBadGateway, Message: "sandbox bridge: " + err.Error(), Reason: "bridge"})
}

// forward sends r over the dedicated guest connection and streams the
// response back, flushing as bytes arrive. An error means the guest
// connection can no longer be trusted to be in sync and must be dropped.
func (b *Bridge) forward(w http.ResponseWriter, r *http.Request, gc *guestConn) (int, error) {
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.URL.Scheme, out.URL.Host = "http", "guest"
	out.Close = false
	for _, h := range hopHeaders {
		out.Header.Del(h)
	}
	out.Header.Del(spacev1.HeaderCapability)
	telemetry.Inject(r.Context(), out.Header) // the guest's parent is this span, nothing else
	out.Header.Del(guestspan.Header)
	if r.ContentLength == 0 {
		out.Body = nil
	}
	writeErr := make(chan error, 1)
	go func() { writeErr <- out.Write(gc.conn) }()
	stop := context.AfterFunc(r.Context(), func() { gc.conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	resp, err := http.ReadResponse(gc.br, out)
	if err != nil {
		// The writer goroutine may still be blocked reading the caller's
		// body; it ends when the server closes that body after this
		// handler returns.
		gc.conn.Close()
		b.fail(w, fmt.Errorf("guest connection dropped: %w", err))
		return http.StatusBadGateway, err
	}
	defer resp.Body.Close()
	for _, h := range hopHeaders {
		resp.Header.Del(h)
	}
	b.recordGuestSpan(r, resp.Header.Get(guestspan.Header))
	resp.Header.Del(guestspan.Header) // the guest's report stops here
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.Header().Set(spacev1.HeaderExecution, b.label)
	if resp.Close {
		// The guest ends this connection: end the manager's too, so the
		// next request arrives on a new connection that is checked anew.
		w.Header().Set("Connection", "close")
	}
	w.WriteHeader(resp.StatusCode)
	fl, _ := w.(http.Flusher)
	if fl != nil {
		fl.Flush() // a stream's headers must not wait for its first event
	}
	buf := make([]byte, 32*1024)
	var copyErr error
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				copyErr = werr
				break
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			copyErr = rerr
			if b.vm != nil {
				copyErr = fmt.Errorf("%w: %w", errGuestBodyCut, rerr)
			}
			break
		}
	}
	if werr := <-writeErr; werr != nil && copyErr == nil {
		copyErr = werr
	}
	if copyErr != nil {
		return resp.StatusCode, copyErr
	}
	if resp.Close {
		return resp.StatusCode, errors.New("guest closed the connection")
	}
	return resp.StatusCode, nil
}

// recordGuestSpan records the guest's span of r from its Space-Guest-Span
// header v (package guestspan), ending now on this process's clock. A
// missing or malformed report records no guest span (the bridge's span
// says which).
func (b *Bridge) recordGuestSpan(r *http.Request, v string) {
	if !telemetry.Enabled() || !trace.SpanFromContext(r.Context()).IsRecording() {
		return
	}
	if v == "" {
		trace.SpanFromContext(r.Context()).SetAttributes(attribute.String("space.guest_span", "none"))
		return
	}
	gs, err := guestspan.Parse(v)
	if err != nil {
		trace.SpanFromContext(r.Context()).SetAttributes(attribute.String("space.guest_span", "malformed"))
		return
	}
	end := time.Now()
	_, span := otel.Tracer(telemetry.ScopeGuest).Start(r.Context(), "guest "+r.URL.Path,
		trace.WithSpanKind(trace.SpanKindServer), trace.WithTimestamp(end.Add(-gs.Duration)),
		trace.WithAttributes(append(b.spanAttrs[:len(b.spanAttrs):len(b.spanAttrs)],
			attribute.Int("http.response.status_code", gs.Status), attribute.String("space.reported_by", "spaced-host"))...))
	span.End(trace.WithTimestamp(end))
}
