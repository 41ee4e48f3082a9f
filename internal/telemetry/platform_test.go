package telemetry_test

// The platform tier: one SDK request through a real `space up` yields one
// trace over every hop, exported over OTLP to a receiver in this test; each
// component's /metrics answers at its address with the documented series,
// and a killed sandbox's series go away.

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"

	"github.com/spacesbx/space/internal/telemetry"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// span is one received span, flattened.
type span struct {
	service, scope, name string
	trace, id, parent    string
	attrs                map[string]string
	links                []string // linked trace ids
}

// receiver is an in-test OTLP/gRPC trace collector that keeps every span.
type receiver struct {
	coltracepb.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans []span
}

func (r *receiver) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range req.ResourceSpans {
		svc := ""
		for _, a := range rs.GetResource().GetAttributes() {
			if a.Key == "service.name" {
				svc = a.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				sp := span{service: svc, scope: ss.GetScope().GetName(), name: s.Name,
					trace: hex.EncodeToString(s.TraceId), id: hex.EncodeToString(s.SpanId), parent: hex.EncodeToString(s.ParentSpanId), attrs: map[string]string{}}
				for _, l := range s.Links {
					sp.links = append(sp.links, hex.EncodeToString(l.TraceId))
				}
				for _, a := range s.Attributes {
					v := a.GetValue()
					switch {
					case v.GetStringValue() != "":
						sp.attrs[a.Key] = v.GetStringValue()
					default:
						sp.attrs[a.Key] = fmt.Sprint(v.GetIntValue())
					}
				}
				r.spans = append(r.spans, sp)
			}
		}
	}
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

func (r *receiver) snapshot() []span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]span(nil), r.spans...)
}

func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func TestPlatformTraceAndMetrics(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rcv := &receiver{}
	gs := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(gs, rcv)
	served := make(chan struct{})
	go func() { defer close(served); gs.Serve(lis) }()
	t.Cleanup(func() { gs.Stop(); <-served })

	apiM, edgeM, nodeM := freeAddr(t), freeAddr(t), freeAddr(t)
	p := testenv.StartPlatform(t, testenv.PlatformOptions{Args: []string{"--otlp-endpoint", lis.Addr().String(),
		"--api-metrics-addr", apiM, "--edge-metrics-addr", edgeM, "--node-metrics-addr", nodeM}})
	// Every SDK request carries a client's own trace context: SPACE must
	// not continue it (a link at most).
	c, err := sdk.New(sdk.Config{APIURL: p.APIURL, SandboxURL: p.SandboxURL, APIKey: p.APIKey,
		HTTPClient: &http.Client{Transport: clientTrace{http.DefaultTransport}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sbx, err := c.CreateSandbox(ctx, sdk.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if code, err := sbx.Run(ctx, "echo traced", sdk.RunOptions{Stdout: &out}); err != nil || code != 0 || out.String() != "traced\n" {
		t.Fatalf("run: %d %v %q", code, err, out.String())
	}

	t.Run("one trace over every hop", func(t *testing.T) {
		want := []string{telemetry.ScopeEdge, telemetry.ScopeControlPlane, telemetry.ScopeNodeAPI, telemetry.ScopeSbxManager, telemetry.ScopeBridge, telemetry.ScopeGuest}
		var got map[string][]span
		deadline := time.Now().Add(30 * time.Second) // batch exporters flush every 5 s
		for {
			got = traceOfProcessStart(rcv.snapshot(), sbx.ID)
			if len(got) == len(want) || time.Now().After(deadline) {
				break
			}
			time.Sleep(500 * time.Millisecond)
		}
		for _, s := range want {
			if len(got[s]) == 0 {
				t.Errorf("trace of process Start has no %s span (has %v)", s, keys(got))
			}
		}
		for _, s := range got[telemetry.ScopeSbxManager] {
			if s.attrs[string(telemetry.AttrDecision)] != "Allow" && s.attrs[string(telemetry.AttrDecision)] != "allow" {
				t.Errorf("sbx-manager span decision = %q, want allow (attrs %v)", s.attrs[string(telemetry.AttrDecision)], s.attrs)
			}
			if s.attrs[string(telemetry.AttrSandbox)] != sbx.ID || s.attrs[string(telemetry.AttrGeneration)] != "1" {
				t.Errorf("sbx-manager span names %v", s.attrs)
			}
		}
		// The hops are a chain: each span's parent is the previous hop's.
		byID := map[string]span{}
		for _, ss := range got {
			for _, s := range ss {
				byID[s.id] = s
			}
		}
		for child, parent := range map[string]string{telemetry.ScopeGuest: telemetry.ScopeBridge, telemetry.ScopeBridge: telemetry.ScopeSbxManager,
			telemetry.ScopeSbxManager: telemetry.ScopeNodeAPI, telemetry.ScopeNodeAPI: telemetry.ScopeEdge} {
			for _, s := range got[child] {
				if byID[s.parent].scope != parent {
					t.Errorf("%s span %q: parent %q is not a %s span", child, s.name, byID[s.parent].name, parent)
				}
			}
		}
		for _, e := range got[telemetry.ScopeEdge] {
			if e.parent != "" && e.parent != "0000000000000000" {
				t.Errorf("edge span %q has a parent: a client's traceparent was continued", e.name)
			}
			if len(e.links) != 1 || e.links[0] != clientTraceID {
				t.Errorf("edge span %q links %v, want the client's trace", e.name, e.links)
			}
		}
		issued := false
		for _, s := range got[telemetry.ScopeControlPlane] {
			issued = issued || s.name == "issue capability" && s.attrs[string(telemetry.AttrSandbox)] == sbx.ID
		}
		if !issued {
			t.Error("no capability issuance span in the trace")
		}
		for _, s := range rcv.snapshot() {
			if s.trace == clientTraceID {
				t.Fatalf("span %s/%s continues the client's trace", s.scope, s.name)
			}
		}
		// The create's install on the worker is in the control plane's trace.
		installTraced := false
		for _, s := range rcv.snapshot() {
			if s.scope == telemetry.ScopeNodeAPI && s.attrs["url.path"] == "/space/node/v1/executions" {
				for _, q := range rcv.snapshot() {
					installTraced = installTraced || q.trace == s.trace && q.scope == telemetry.ScopeControlPlane && q.attrs["http.route"] == "POST /sandboxes"
				}
			}
		}
		if !installTraced {
			t.Error("the install on the worker is not in the trace of POST /sandboxes")
		}
		for _, s := range got[telemetry.ScopeBridge] {
			if len(got[telemetry.ScopeGuest]) == 0 {
				t.Logf("spaced-host span: %s %v", s.name, s.attrs)
			}
			if s.service != "spaced-host" {
				t.Errorf("spaced-host span exported by %q", s.service)
			}
		}
	})

	t.Run("metrics", func(t *testing.T) {
		checkSeries(t, "http://"+apiM+"/metrics", "space_api_requests_total", "space_api_request_duration_seconds", "space_api_capabilities_total", "space_api_reaper_passes_total", "space_etcd_request_duration_seconds", "go_goroutines", "process_resident_memory_bytes")
		checkSeries(t, "http://"+edgeM+"/metrics", "space_edge_requests_total", "go_goroutines")
		perSandbox := []string{`space_sandbox_requests_total{sandbox="` + sbx.ID, `space_sandbox_network_bytes_total{direction="tx",sandbox="` + sbx.ID, `space_sandbox_memory_used_bytes{sandbox="` + sbx.ID}
		checkSeries(t, "http://"+nodeM+"/metrics", append([]string{"space_node_sandboxes{state=\"running\",worker=\"w1\"} 1", "space_node_installs_total", "space_node_lifecycle_op_seconds",
			"space_node_admission_decisions_total", "space_node_bridge_checks_total", "go_goroutines"}, perSandbox...)...)
		if err := sbx.Kill(ctx); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			body := scrape(t, "http://"+nodeM+"/metrics")
			if !strings.Contains(body, `sandbox="`+sbx.ID+`"`) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("killed sandbox's series still there:\n%s", grep(body, sbx.ID))
			}
			time.Sleep(200 * time.Millisecond)
		}
	})
}

const clientTraceID = "4bf92f3577b34da6a3ce929d0e0e4736"

// clientTrace adds a client's traceparent to every request.
type clientTrace struct{ rt http.RoundTripper }

func (c clientTrace) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Traceparent", "00-"+clientTraceID+"-00f067aa0ba902b7-01")
	return c.rt.RoundTrip(r)
}

// traceOfProcessStart finds the edge's span of the process Start for
// sandbox and returns the spans of its trace by scope.
func traceOfProcessStart(spans []span, sandbox string) map[string][]span {
	tid := ""
	for _, s := range spans {
		if s.scope == telemetry.ScopeEdge && s.attrs[string(telemetry.AttrSandbox)] == sandbox && s.attrs["url.path"] == "/process.Process/Start" {
			tid = s.trace
		}
	}
	out := map[string][]span{}
	if tid == "" {
		return out
	}
	for _, s := range spans {
		if s.trace == tid {
			out[s.scope] = append(out[s.scope], s)
		}
	}
	return out
}

func keys(m map[string][]span) []string {
	var k []string
	for s := range m {
		k = append(k, s)
	}
	return k
}

func scrape(t *testing.T, url string) string {
	t.Helper()
	res, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != 200 {
		t.Fatalf("%s: %s", url, res.Status)
	}
	return string(b)
}

func checkSeries(t *testing.T, url string, series ...string) {
	t.Helper()
	body := scrape(t, url)
	for _, s := range series {
		if !strings.Contains(body, s) {
			t.Errorf("%s lacks %s", url, s)
		}
	}
}

func grep(body, s string) string {
	var b strings.Builder
	for _, l := range strings.Split(body, "\n") {
		if strings.Contains(l, s) {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}
