package edge

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

// Request bodies. The edge reads no body byte before the caller is
// authorized (serveHTTP resolves first): an unauthenticated client costs a
// connection and its headers, never a buffer. Authorized bodies are held
// (for a rebuilt attempt) only within MaxBufferedBody per request and
// BufferedBodyBudget across requests, and every body that is not open-ended
// by design must keep arriving (BodyIdleTimeout; held ones also within
// BodyReadTimeout).

// rejectDrainTimeout bounds how long net/http may read an unread body
// after the edge answered without it (it drains up to 256 KiB to keep the
// connection): a stalled client must not hold the connection.
const rejectDrainTimeout = 2 * time.Second

// chunkedStep is the first buffer (and budget) step for a body of unknown
// length; the buffer doubles up to MaxBufferedBody.
const chunkedStep = 32 << 10

// bodyBudget counts the body bytes held across all in-flight requests.
type bodyBudget struct {
	max  int64
	used atomic.Int64
}

// tryAcquire reserves n bytes; it never waits.
func (b *bodyBudget) tryAcquire(n int64) bool {
	for {
		u := b.used.Load()
		if u+n > b.max {
			return false
		}
		if b.used.CompareAndSwap(u, u+n) {
			return true
		}
	}
}

func (b *bodyBudget) release(n int64) { b.used.Add(-n) }

// hasUnreadBody reports whether r carries a body nobody has read yet. For
// an HTTP/1 server request, net/http starts its background read (which a
// read deadline would break) only once the body has been read to EOF.
func hasUnreadBody(r *http.Request) bool {
	return r.Body != nil && r.Body != http.NoBody
}

// dropUnreadBody bounds net/http's drain of a body the edge answers
// without reading (rejections before authorization, own endpoints).
func dropUnreadBody(w http.ResponseWriter, r *http.Request) {
	if hasUnreadBody(r) {
		_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(rejectDrainTimeout))
	}
}

// progressReader moves the connection's read deadline before each read:
// idle from now, capped by end (zero: no cap). After the body's last read
// it sets no deadline any more: net/http's background read then owns the
// connection, and a deadline would cancel the request's context.
type progressReader struct {
	body      io.ReadCloser
	rc        *http.ResponseController
	idle      time.Duration
	end       time.Time
	done      bool
	onTimeout func()
}

func (p *progressReader) Read(b []byte) (int, error) {
	if !p.done {
		dl := time.Now().Add(p.idle)
		if !p.end.IsZero() && p.end.Before(dl) {
			dl = p.end
		}
		_ = p.rc.SetReadDeadline(dl)
	}
	n, err := p.body.Read(b)
	if err != nil && !p.done {
		p.done = true
		if errors.Is(err, os.ErrDeadlineExceeded) && p.onTimeout != nil {
			p.onTimeout()
		}
	}
	return n, err
}

func (p *progressReader) Close() error { return p.body.Close() }

// holdBody runs after the caller is authorized. It reads bodies up to
// MaxBufferedBody into memory, within the budget, so that a rebuilt attempt
// can resend them. Bodies of client-streaming calls and larger bodies are
// streamed (not retryable) and cost no budget.
func (e *Edge) holdBody(w http.ResponseWriter, r *http.Request, st *reqState) error {
	if !hasUnreadBody(r) || r.ContentLength == 0 {
		st.held = true
		return nil
	}
	if st.t.clientStream {
		// Open-ended by design (stdin, WebSocket, raw TCP): it may be idle
		// for long, and it is never held.
		st.streamBody = r.Body
		return nil
	}
	rc := http.NewResponseController(w)
	pr := &progressReader{body: r.Body, rc: rc, idle: e.cfg.BodyIdleTimeout, onTimeout: func() {
		e.metrics.bodyRejects.WithLabelValues("timeout").Inc()
		e.log.Info("request body stalled; cut", "sandbox", st.t.sandbox, "purpose", st.t.purpose, "idle_timeout", e.cfg.BodyIdleTimeout)
	}}
	// Until the first read: the transport of a streamed body may never read
	// it (node unreachable), and net/http would then drain it unbounded.
	_ = rc.SetReadDeadline(time.Now().Add(e.cfg.BodyIdleTimeout))
	if r.ContentLength > e.cfg.MaxBufferedBody {
		st.streamBody = pr
		return nil
	}
	pr.end = time.Now().Add(e.cfg.BodyReadTimeout)
	var err error
	if r.ContentLength > 0 {
		err = e.readKnown(pr, r.ContentLength, st)
	} else {
		err = e.readUnknown(pr, st)
	}
	if err != nil {
		if errors.Is(err, errdefs.ErrUnavailable) {
			dropUnreadBody(w, r)
		}
		return err
	}
	if !pr.done {
		// The body is in memory; the response may stream for long.
		_ = rc.SetReadDeadline(time.Time{})
	}
	return nil
}

// readKnown holds a body of declared length n (n <= MaxBufferedBody).
func (e *Edge) readKnown(pr *progressReader, n int64, st *reqState) error {
	if !e.budget.tryAcquire(n) {
		return e.overBudget(st, n)
	}
	e.reserve(st, n)
	buf := make([]byte, n)
	if _, err := io.ReadFull(pr, buf); err != nil {
		return bodyReadError(err)
	}
	st.body, st.held = buf, true
	return nil
}

// readUnknown holds a body of unknown length, reserving budget as the
// buffer grows. Beyond MaxBufferedBody it streams what was read and the
// rest, as a large body of known length does.
func (e *Edge) readUnknown(pr *progressReader, st *reqState) error {
	limit := e.cfg.MaxBufferedBody
	var buf []byte
	for {
		if len(buf) == cap(buf) {
			if int64(len(buf)) > limit {
				st.streamBody = struct {
					io.Reader
					io.Closer
				}{io.MultiReader(bytes.NewReader(buf), pr), pr}
				return nil
			}
			next := min(max(int64(2*cap(buf)), chunkedStep), limit+1)
			if !e.budget.tryAcquire(next - st.reserved) {
				return e.overBudget(st, next)
			}
			e.reserve(st, next-st.reserved)
			nb := make([]byte, len(buf), next)
			copy(nb, buf)
			buf = nb
		}
		n, err := pr.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			st.body, st.held = buf, true
			return nil
		}
		if err != nil {
			return bodyReadError(err)
		}
	}
}

func (e *Edge) reserve(st *reqState, n int64) {
	st.reserved += n
	e.metrics.heldBytes.Add(float64(n))
}

// releaseBody returns a request's reservation once its body is no longer
// needed (the response is done, including any reattach).
func (e *Edge) releaseBody(st *reqState) {
	if st.reserved > 0 {
		e.budget.release(st.reserved)
		e.metrics.heldBytes.Sub(float64(st.reserved))
		st.reserved = 0
	}
}

func (e *Edge) overBudget(st *reqState, n int64) error {
	e.metrics.bodyRejects.WithLabelValues("budget").Inc()
	e.log.Warn("request body refused: buffered-body budget in use", "sandbox", st.t.sandbox,
		"purpose", st.t.purpose, "bytes", n, "budget", e.budget.max)
	return budgetError()
}

func bodyReadError(err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return bodyTimeoutError()
	}
	return badRequest("reading request body failed")
}
