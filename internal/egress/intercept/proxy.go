package intercept

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"

	"github.com/spacesbx/space/internal/errdefs"
)

// serve forwards the client's requests one at a time until one side
// closes, a request is refused or something breaks.
func (s *session) serve(ctx context.Context) error {
	for {
		s.lr.unlimited, s.lr.n = false, maxHeaderBytes
		req, err := http.ReadRequest(s.cbr)
		if err != nil {
			switch {
			case ctx.Err() != nil:
				return ctx.Err()
			case s.upstreamGone():
				return nil // the server closed the idle connection: so do we
			case errors.Is(err, errHeaderTooLarge) || s.lr.n <= 0:
				// The parser may see the cut-off line as malformed
				// before it sees the limit's error.
				s.fail(http.StatusRequestHeaderFieldsTooLarge)
				return fmt.Errorf("intercept: request to %s: %w: header over %d bytes", s.host, errdefs.ErrTooLarge, maxHeaderBytes)
			case errors.Is(err, io.EOF) && s.cbr.Buffered() == 0:
				return nil // closed between requests
			case isConnError(err):
				return fmt.Errorf("intercept: read request to %s: %w", s.host, err)
			}
			s.fail(http.StatusBadRequest)
			return fmt.Errorf("intercept: request to %s: %w: %v", s.host, errdefs.ErrInvalid, err)
		}
		s.lr.unlimited = true
		if req.ProtoMajor != 1 {
			s.fail(http.StatusHTTPVersionNotSupported)
			return fmt.Errorf("intercept: request to %s: %w: version %s", s.host, errdefs.ErrInvalid, req.Proto)
		}
		if got := requestHost(req.Host); got != s.host {
			s.fail(http.StatusMisdirectedRequest)
			return fmt.Errorf("intercept: request for host %q on a connection for %s: %w", req.Host, s.host, errdefs.ErrDenied)
		}
		for k, v := range s.headers {
			req.Header.Set(k, v)
		}
		if _, ok := req.Header["User-Agent"]; !ok {
			req.Header["User-Agent"] = []string{""} // keeps Request.Write from adding Go's
		}
		if !req.ProtoAtLeast(1, 1) {
			req.Close = true // an HTTP/1.0 client gets a close-delimited answer
		}
		if err := s.ensureUpstream(ctx); err != nil {
			s.fail(http.StatusBadGateway)
			return err
		}
		if !s.beginRequest() {
			return nil // the server closed the idle connection: the client may retry
		}
		more, err := s.roundTrip(ctx, req)
		if errors.Is(err, errIdleClosed) {
			return nil
		}
		if err != nil || !more {
			return err
		}
		s.startWatch()
	}
}

// errIdleClosed: the server closed the connection before answering a
// request sent on it after an idle time; the client gets the connection
// closed without an answer, as if it had talked to the server, and may
// retry.
var errIdleClosed = errors.New("upstream closed the idle connection")

// roundTrip forwards req and streams the answer back; more reports
// whether both connections may carry another request.
func (s *session) roundTrip(ctx context.Context, req *http.Request) (more bool, err error) {
	// The body goes up while the answer comes down: a server may answer
	// 100 Continue first, or answer before it has read a large upload.
	clientBody := &flushingReader{rc: req.Body, w: s.ubw, atEOF: func() {
		// A trailer is read with the body's end: one named like a
		// transformed header would reach the server after it.
		for k := range s.headers {
			req.Trailer.Del(k)
		}
	}}
	if req.Body != nil && req.Body != http.NoBody {
		req.Body = clientBody
	}
	sent := make(chan error, 1)
	go func() {
		err := req.Write(writerOnly{s.ubw})
		if err == nil {
			err = s.ubw.Flush()
		}
		if clientBody.readErr != nil {
			s.abort() // the client broke mid-body: the server would wait for the rest forever
		}
		sent <- err
	}()
	waited := false
	waitSent := func() error {
		if waited {
			return nil
		}
		waited = true
		if serr := <-sent; serr != nil {
			return fmt.Errorf("intercept: forward request to %s: %w: %v", s.host, errdefs.ErrUpstream, serr)
		}
		return nil
	}
	defer func() {
		if err != nil {
			s.abort()
		}
		if !more && !waited {
			select {
			case serr := <-sent:
				sent <- serr
			default:
				// The connection ends anyway: stop waiting for the rest
				// of the body, and for its failure.
				s.abort()
				<-sent
				waited = true
			}
		}
		if serr := waitSent(); serr != nil && err == nil {
			more, err = false, serr
		}
	}()

	if werr := s.waitWatch(); werr != nil {
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		return false, errIdleClosed
	}
	wrote := false // anything sent to the client for this request
	var resp *http.Response
	for interim := 0; ; interim++ {
		if interim > maxInterim {
			return false, fmt.Errorf("intercept: response from %s: %w: over %d interim responses", s.host, errdefs.ErrUpstream, maxInterim)
		}
		s.ulr.unlimited, s.ulr.n = false, maxResponseHeaderBytes
		resp, err = http.ReadResponse(s.ubr, req)
		s.ulr.unlimited = true
		if err != nil {
			if ctx.Err() != nil {
				return false, ctx.Err()
			}
			if !wrote {
				s.fail(http.StatusBadGateway)
			}
			return false, fmt.Errorf("intercept: response from %s: %w: %v", s.host, errdefs.ErrUpstream, err)
		}
		if resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			break
		}
		// 1xx: relay (HTTP/1.1 clients only) and keep waiting for the
		// final answer.
		if !req.ProtoAtLeast(1, 1) {
			continue
		}
		wrote = true
		if err = writeHead(s.cbw, resp); err != nil {
			return false, fmt.Errorf("intercept: write to client: %w", err)
		}
	}
	if resp.StatusCode == http.StatusSwitchingProtocols {
		if err = writeHead(s.cbw, resp); err != nil {
			return false, fmt.Errorf("intercept: write to client: %w", err)
		}
		if err = waitSent(); err != nil {
			return false, err
		}
		return false, s.splice()
	}

	chunked := len(resp.TransferEncoding) > 0 && resp.TransferEncoding[0] == "chunked"
	// Response.Write marks exactly these close-delimited.
	closeAfter := resp.Close || req.Close || (resp.ContentLength == -1 && !chunked)
	if !req.ProtoAtLeast(1, 1) {
		resp.ProtoMajor, resp.ProtoMinor = 1, 0
		resp.Close = true
		if chunked {
			resp.TransferEncoding, resp.ContentLength = nil, -1
		}
	}
	resp.Body = &flushingReader{rc: resp.Body, w: s.cbw}
	if err = resp.Write(writerOnly{s.cbw}); err == nil {
		err = s.cbw.Flush()
	}
	if err != nil {
		return false, fmt.Errorf("intercept: stream response from %s: %w", s.host, err)
	}
	if !closeAfter && strings.EqualFold(req.Header.Get("Expect"), "100-continue") {
		// Answered without a 100 Continue: the client may never send the
		// body it held back, so the connection cannot carry another
		// request (net/http's server does the same).
		select {
		case serr := <-sent:
			sent <- serr
		default:
			closeAfter = true
		}
	}
	return !closeAfter, nil
}

// writeHead relays an interim or 101 response (no body) at once, written
// by hand: Response.Write would add a Content-Length to a 1xx answering a
// POST.
func writeHead(w *bufio.Writer, resp *http.Response) error {
	fmt.Fprintf(w, "HTTP/1.1 %s\r\n", resp.Status)
	if err := resp.Header.Write(w); err != nil {
		return err
	}
	if _, err := w.WriteString("\r\n"); err != nil {
		return err
	}
	return w.Flush()
}

// splice copies raw bytes both ways after a 101, including what either
// reader already buffered; one side's end is passed on as a close_notify
// (CloseWrite), and it ends when both directions have.
func (s *session) splice() error {
	var wg sync.WaitGroup
	var upErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		upErr = pipe(s.up, s.cbr)
		if upErr != nil {
			s.abort()
		}
	}()
	downErr := pipe(s.client, s.ubr)
	if downErr != nil {
		s.abort()
	}
	wg.Wait()
	if err := errors.Join(upErr, downErr); err != nil {
		return fmt.Errorf("intercept: upgraded connection to %s: %w", s.host, err)
	}
	return nil
}

// pipe copies until src ends, then half-closes dst.
func pipe(dst net.Conn, src io.Reader) error {
	_, err := io.Copy(dst, src)
	if err != nil {
		return err
	}
	if cw, ok := dst.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// writerOnly hides bufio.Writer's ReadFrom: it reads into the writer's
// own buffer, which a flushingReader flushing that writer would corrupt.
type writerOnly struct{ w io.Writer }

func (w writerOnly) Write(p []byte) (int, error) { return w.w.Write(p) }

// flushingReader flushes w before each read of a body, so whatever was
// written out is sent before waiting for more: a streamed answer (SSE,
// tokens) reaches the client as it comes, while bulk data still moves in
// large writes.
type flushingReader struct {
	rc      io.ReadCloser
	w       *bufio.Writer
	atEOF   func() // may be nil
	readErr error  // a read failure other than EOF
}

func (f *flushingReader) Read(p []byte) (int, error) {
	if f.w.Buffered() > 0 {
		if err := f.w.Flush(); err != nil {
			return 0, err
		}
	}
	n, err := f.rc.Read(p)
	switch {
	case err == io.EOF && f.atEOF != nil:
		f.atEOF()
	case err != nil && err != io.EOF:
		f.readErr = err
	}
	return n, err
}

func (f *flushingReader) Close() error { return f.rc.Close() }

// requestHost is a request's Host without port, normalized like the
// connection's host; "" (never equal) when it is not a valid host.
func requestHost(h string) string {
	if host, port, err := net.SplitHostPort(h); err == nil {
		if len(port) > 5 || strings.Trim(port, "0123456789") != "" {
			return ""
		}
		h = host
	} else if len(h) > 1 && h[0] == '[' && h[len(h)-1] == ']' {
		h = h[1 : len(h)-1]
	}
	n, err := normHost(h)
	if err != nil {
		return ""
	}
	return n
}

// isConnError reports a failure of the connection itself (closed, reset,
// timed out) rather than of what it carried.
func isConnError(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, net.ErrClosed) || errors.Is(err, io.ErrUnexpectedEOF)
}
