package guest

// The guest's part of a trace: a request that arrives with a sampled
// traceparent (spaced-host's span) is answered with a Space-Guest-Span
// trailer giving the handling time and status; spaced-host records the
// guest's span from it (package guestspan). The agent has no exporter and
// no network to send spans on.

import (
	"net/http"
	"time"

	"github.com/spacesbx/space/internal/telemetry/guestspan"
)

func reportSpans(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !guestspan.Sampled(r.Header.Get("Traceparent")) {
			next.ServeHTTP(w, r)
			return
		}
		start := time.Now()
		w.Header().Add("Trailer", guestspan.Trailer)
		sw := &spanWriter{ResponseWriter: w}
		next.ServeHTTP(sw, r)
		status := sw.status
		if status == 0 {
			status = http.StatusOK
		}
		w.Header().Set(guestspan.Trailer, guestspan.Format(guestspan.Span{Duration: time.Since(start), Status: status}))
	})
}

// spanWriter records the status; Flush and Unwrap keep streaming and
// http.ResponseController (full duplex) working.
type spanWriter struct {
	http.ResponseWriter
	status int
}

func (w *spanWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *spanWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *spanWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (w *spanWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
