package telemetry

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const clientTP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

func setup(t *testing.T) *tracetest.InMemoryExporter {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	p, err := Setup(context.Background(), Config{Exporter: exp})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Shutdown(context.Background()) })
	t.Cleanup(func() { p.ForceFlush(context.Background()) })
	return exp
}

func TestOffIsNoop(t *testing.T) {
	if Enabled() {
		t.Fatal("tracing on without Setup")
	}
	r := httptest.NewRequest("GET", "/x", nil)
	r.Header.Set(HeaderTraceparent, clientTP)
	ctx, span := ServerSpan(r, ScopeEdge, "x", Untrusted)
	if span.IsRecording() || ctx != r.Context() {
		t.Fatal("a span recorded with tracing off")
	}
	h := http.Header{HeaderTraceparent: {clientTP}, HeaderTracestate: {"a=b"}}
	Inject(context.Background(), h)
	if len(h) != 0 {
		t.Fatalf("client trace headers kept with tracing off: %v", h)
	}
	if allocs := testing.AllocsPerRun(100, func() { _, s := StartSpan(context.Background(), ScopeEdge, "x"); s.End() }); allocs != 0 {
		t.Fatalf("StartSpan with tracing off allocates %v", allocs)
	}
}

func TestUntrustedClientStartsANewRoot(t *testing.T) {
	exp := setup(t)
	r := httptest.NewRequest("GET", "/x", nil)
	r.Header.Set(HeaderTraceparent, clientTP)
	r.Header.Set("Baggage", "space.identity.decision=allow")
	_, span := ServerSpan(r, ScopeEdge, "edge", Untrusted)
	sc := span.SpanContext()
	span.End()
	if sc.TraceID().String() == "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Fatal("the client chose the trace")
	}
	got := flush(t, exp)
	if len(got) != 1 || got[0].Parent.IsValid() {
		t.Fatalf("want one root span, got %+v", got)
	}
	if l := got[0].Links; len(l) != 1 || l[0].SpanContext.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Fatalf("client context not linked: %+v", l)
	}
	for _, a := range got[0].Attributes {
		if a.Key == AttrDecision {
			t.Fatalf("client set %v", a)
		}
	}
}

func TestTrustedHopContinuesTheTrace(t *testing.T) {
	exp := setup(t)
	ctx, parent := StartSpan(context.Background(), ScopeEdge, "edge")
	h := http.Header{HeaderTraceparent: {clientTP}}
	Inject(ctx, h)
	if h.Get(HeaderTraceparent) == clientTP {
		t.Fatal("Inject kept the client's traceparent")
	}
	r := httptest.NewRequest("GET", "/x", nil)
	r.Header = h
	_, child := ServerSpan(r, ScopeNodeAPI, "node-api", Trusted, attribute.String("k", "v"))
	child.End()
	parent.End()
	got := flush(t, exp)
	if len(got) != 2 || got[0].Parent.SpanID() != parent.SpanContext().SpanID() || got[0].SpanContext.TraceID() != parent.SpanContext().TraceID() {
		t.Fatalf("node-api span is not the edge span's child: %+v", got)
	}
}

func TestMalformedTraceparentIsANewRoot(t *testing.T) {
	exp := setup(t)
	for _, tp := range []string{"garbage", "00-00000000000000000000000000000000-00f067aa0ba902b7-01", "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"} {
		r := httptest.NewRequest("GET", "/x", nil)
		r.Header.Set(HeaderTraceparent, tp)
		_, span := ServerSpan(r, ScopeNodeAPI, "n", Trusted)
		span.End()
	}
	for _, s := range flush(t, exp) {
		if s.Parent.IsValid() || len(s.Links) != 0 {
			t.Fatalf("malformed traceparent used: %+v", s)
		}
	}
}

func TestValidate(t *testing.T) {
	for _, c := range []Config{{SampleRatio: -1}, {SampleRatio: 2}, {OTLPEndpoint: "nohost"}, {OTLPEndpoint: "host:"}} {
		if c.Validate() == nil {
			t.Errorf("%+v accepted", c)
		}
	}
	if err := (Config{OTLPEndpoint: "127.0.0.1:4317", SampleRatio: 0.5}).Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestMetricsListener(t *testing.T) {
	ms, err := ListenMetrics("127.0.0.1:0", NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ms.Run(ctx) }()
	res, err := http.Get(ms.URL())
	if err != nil || res.StatusCode != 200 {
		t.Fatalf("%v %v", res, err)
	}
	res.Body.Close()
	http.DefaultClient.CloseIdleConnections()
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if off, err := ListenMetrics("off", NewRegistry(), nil); off != nil || err != nil {
		t.Fatal("off listens")
	}
}

func flush(t *testing.T, exp *tracetest.InMemoryExporter) tracetest.SpanStubs {
	t.Helper()
	if !Enabled() {
		t.Fatal("not enabled")
	}
	if err := currentFlush(); err != nil {
		t.Fatal(err)
	}
	return exp.GetSpans()
}
