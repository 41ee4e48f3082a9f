package bridge

import (
	"context"
	"net/http"
	"testing"

	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/spacesbx/space/internal/telemetry"
	"github.com/spacesbx/space/internal/telemetry/guestspan"
)

// The guest's span report: a well-formed one becomes the guest's span under
// spaced-host's (which continues the manager's trace, or starts one for a
// request that came without); a malformed one records nothing; none ever
// leaves spaced-host; the guest's parent is spaced-host's span, never the
// traceparent the caller sent.
func TestGuestSpanReport(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp, err := telemetry.Setup(context.Background(), telemetry.Config{Exporter: exp})
	if err != nil {
		t.Fatal(err)
	}
	defer tp.Shutdown(context.Background())
	var sawTP string
	e := start(t, want, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sawTP = r.Header.Get("Traceparent")
		switch r.URL.Path {
		case "/good":
			w.Header().Set(guestspan.Header, guestspan.Format(guestspan.Span{Duration: 2000, Status: 200}))
		case "/bad":
			w.Header().Set(guestspan.Header, "v9 dur_us=1 status=200")
		}
		w.WriteHeader(http.StatusOK)
	}))
	ctx, parent := telemetry.StartSpan(context.Background(), telemetry.ScopeSbxManager, "manager")
	for _, path := range []string{"/good", "/bad"} {
		req, _ := http.NewRequestWithContext(ctx, "GET", "http://x"+path, nil)
		telemetry.Inject(ctx, req.Header)
		resp, err := e.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.Header.Get(guestspan.Header) != "" {
			t.Fatalf("%s: the guest's report left spaced-host", path)
		}
		if !guestspan.Sampled(sawTP) || sawTP == req.Header.Get("Traceparent") {
			t.Fatalf("%s: guest saw traceparent %q (manager sent %q): want spaced-host's own span", path, sawTP, req.Header.Get("Traceparent"))
		}
	}
	// No traceparent from the manager: spaced-host's span is a root.
	req, _ := http.NewRequest("GET", "http://x/good", nil)
	resp, err := e.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.Header.Get(guestspan.Header) != "" {
		t.Fatal("the report left spaced-host")
	}
	parent.End()
	if err := tp.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}
	guests, hosts := 0, map[string]string{}
	for _, s := range exp.GetSpans() {
		switch s.InstrumentationScope.Name {
		case telemetry.ScopeGuest:
			guests++
			if s.Name != "guest /good" {
				t.Errorf("guest span %q", s.Name)
			}
		case telemetry.ScopeBridge:
			for _, a := range s.Attributes {
				if a.Key == "space.guest_span" {
					hosts[s.Name] = a.Value.AsString()
				}
			}
			if s.Parent.TraceID() != parent.SpanContext().TraceID() && s.Parent.IsValid() {
				t.Errorf("spaced-host span %q in another trace", s.Name)
			}
		}
	}
	if guests != 2 || hosts["spaced-host /bad"] != "malformed" {
		t.Fatalf("guest spans %d, spaced-host report states %v", guests, hosts)
	}
}
