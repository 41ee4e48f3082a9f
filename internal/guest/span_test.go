package guest

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/spacesbx/space/internal/telemetry/guestspan"
)

// A sampled traceparent gets the span report header; anything else gets
// none (the agent reports only to a hop that traces).
func TestReportSpans(t *testing.T) {
	h := reportSpans(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusTeapot)
	}))
	for tp, want := range map[string]bool{
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01": true,
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00": false,
		"junk": false, "": false,
	} {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("GET", "/health", nil)
		if tp != "" {
			req.Header.Set("Traceparent", tp)
		}
		h.ServeHTTP(rec, req)
		v := rec.Header().Get(guestspan.Header)
		if (v != "") != want {
			t.Fatalf("traceparent %q: report %q", tp, v)
		}
		if want {
			s, err := guestspan.Parse(v)
			if err != nil || s.Status != http.StatusTeapot {
				t.Fatalf("report %q: %+v %v", v, s, err)
			}
		}
	}
}
