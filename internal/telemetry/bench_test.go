package telemetry

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
)

// One hop's instrumentation: the receiver's span and the injection into
// the next request, with tracing off and on (recorded, no exporter).
func BenchmarkHop(b *testing.B) {
	for _, on := range []bool{false, true} {
		name := "off"
		if on {
			name = "on"
		}
		b.Run(name, func(b *testing.B) {
			if on {
				p, err := Setup(context.Background(), Config{Record: true})
				if err != nil {
					b.Fatal(err)
				}
				defer p.Shutdown(context.Background())
			}
			r := httptest.NewRequest("GET", "/files", nil)
			h := http.Header{}
			b.ReportAllocs()
			for b.Loop() {
				ctx, span := ServerSpan(r, ScopeNodeAPI, "node-api /files", Trusted)
				Inject(ctx, h)
				EndHTTP(span, 200)
			}
		})
	}
}
