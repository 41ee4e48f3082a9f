package logsetup

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/trace"
)

// Both formats carry the same field names, and a record logged with the
// context of a traced request carries its trace_id and span_id.
func TestFormatsShareFieldsAndTraceIDs(t *testing.T) {
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))

	var jb bytes.Buffer
	jl, err := New(&jb, Options{Format: FormatJSON})
	if err != nil {
		t.Fatal(err)
	}
	jl.With(KeyWorker, "w1").InfoContext(ctx, "admitted", KeySandbox, "sbx1", KeyGeneration, 2)
	var rec map[string]any
	if err := json.Unmarshal(jb.Bytes(), &rec); err != nil {
		t.Fatalf("json line %q: %v", jb.String(), err)
	}
	for k, want := range map[string]any{KeySandbox: "sbx1", KeyGeneration: float64(2), KeyWorker: "w1", KeyTraceID: tid.String(), KeySpanID: sid.String(), "msg": "admitted"} {
		if rec[k] != want {
			t.Errorf("json %s = %v, want %v (%s)", k, rec[k], want, jb.String())
		}
	}

	var tb bytes.Buffer
	tl, err := New(&tb, Options{Format: FormatText})
	if err != nil {
		t.Fatal(err)
	}
	tl.With(KeyWorker, "w1").InfoContext(ctx, "admitted", KeySandbox, "sbx1", KeyGeneration, 2)
	for _, kv := range []string{"sandbox=sbx1", "generation=2", "worker=w1", "trace_id=" + tid.String(), "span_id=" + sid.String()} {
		if !strings.Contains(tb.String(), kv) {
			t.Errorf("text line %q lacks %s", tb.String(), kv)
		}
	}

	// No span: no trace fields.
	tb.Reset()
	tl.Info("plain")
	if strings.Contains(tb.String(), "trace_id") {
		t.Errorf("trace_id without a span: %q", tb.String())
	}
	if _, err := New(&tb, Options{Format: "yaml"}); err == nil {
		t.Error("unknown format accepted")
	}
}
