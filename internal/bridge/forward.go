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

	"github.com/spacesbx/space/api/spacev1"
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
	gc.mu.Lock()
	defer gc.mu.Unlock()
	if gc.broken != nil {
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
			return
		}
		gc.conn, gc.br = c.conn, c.br
	}
	if err := b.forward(w, r, gc); err != nil {
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
func (b *Bridge) forward(w http.ResponseWriter, r *http.Request, gc *guestConn) error {
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.URL.Scheme, out.URL.Host = "http", "guest"
	out.Close = false
	for _, h := range hopHeaders {
		out.Header.Del(h)
	}
	out.Header.Del(spacev1.HeaderCapability)
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
		return err
	}
	defer resp.Body.Close()
	for _, h := range hopHeaders {
		resp.Header.Del(h)
	}
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
		return copyErr
	}
	if resp.Close {
		return errors.New("guest closed the connection")
	}
	return nil
}
