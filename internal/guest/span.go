package guest

// The guest's part of a trace: a request that arrives with a sampled
// traceparent (spaced-host's span) is answered with a Space-Guest-Span
// header giving the time to the answer and its status; spaced-host records
// the guest's span from it (package guestspan). The agent has no exporter
// and no network to send spans on.

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
		sw := &spanWriter{ResponseWriter: w, start: time.Now()}
		next.ServeHTTP(sw, r)
	})
}

// spanWriter records the status; Flush and Unwrap keep streaming and
// http.ResponseController (full duplex) working.
type spanWriter struct {
	http.ResponseWriter
	start time.Time
	done  bool
}

// report sets the header once, just before the response's headers go.
func (w *spanWriter) report(code int) {
	if w.done || code < 200 {
		return
	}
	w.done = true
	w.Header().Set(guestspan.Header, guestspan.Format(guestspan.Span{Duration: time.Since(w.start), Status: code}))
}

func (w *spanWriter) WriteHeader(code int) {
	w.report(code)
	w.ResponseWriter.WriteHeader(code)
}

func (w *spanWriter) Write(b []byte) (int, error) {
	w.report(http.StatusOK)
	return w.ResponseWriter.Write(b)
}

func (w *spanWriter) Flush() {
	w.report(http.StatusOK)
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (w *spanWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
