package edge

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/envd/process/processpbconnect"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/envelope"
	"github.com/spacesbx/space/internal/identity"
)

const testPid = 42

// fakeProcess is a guest process service for fake nodes.
type fakeProcess struct {
	processpbconnect.UnimplementedProcessHandler
	start   func(context.Context, *connect.Request[processpb.StartRequest], *connect.ServerStream[processpb.StartResponse]) error
	connect func(context.Context, *connect.Request[processpb.ConnectRequest], *connect.ServerStream[processpb.ConnectResponse]) error
}

func (f *fakeProcess) Start(ctx context.Context, r *connect.Request[processpb.StartRequest], s *connect.ServerStream[processpb.StartResponse]) error {
	return f.start(ctx, r, s)
}

func (f *fakeProcess) Connect(ctx context.Context, r *connect.Request[processpb.ConnectRequest], s *connect.ServerStream[processpb.ConnectResponse]) error {
	return f.connect(ctx, r, s)
}

// serveProcess mounts f on node for Start and Connect.
func serveProcess(node *fakeNode, f *fakeProcess) {
	if f.start == nil {
		f.start = func(context.Context, *connect.Request[processpb.StartRequest], *connect.ServerStream[processpb.StartResponse]) error {
			return connect.NewError(connect.CodeUnimplemented, errors.New("no start"))
		}
	}
	if f.connect == nil {
		f.connect = func(context.Context, *connect.Request[processpb.ConnectRequest], *connect.ServerStream[processpb.ConnectResponse]) error {
			return connect.NewError(connect.CodeNotFound, errors.New("process not found"))
		}
	}
	_, h := processpbconnect.NewProcessHandler(f)
	node.handle(processpbconnect.ProcessStartProcedure, h.ServeHTTP)
	node.handle(processpbconnect.ProcessConnectProcedure, h.ServeHTTP)
}

func startEv(pid uint32) *processpb.ProcessEvent {
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: pid}}}
}

func stdoutEv(s string) *processpb.ProcessEvent {
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: &processpb.ProcessEvent_DataEvent{
		Output: &processpb.ProcessEvent_DataEvent_Stdout{Stdout: []byte(s)}}}}
}

func endEv(code int32) *processpb.ProcessEvent {
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_End{End: &processpb.ProcessEvent_EndEvent{
		ExitCode: code, Exited: true, Status: fmt.Sprintf("exit status %d", code)}}}
}

// replacedErr is what sbx-manager's leaseWriter ends a stream with.
func replacedErr(r identity.Route) error {
	return connect.NewError(connect.CodeUnavailable, fmt.Errorf("%s: sandbox %s execution %s (generation %d) is no longer served by worker %s; reconnect to the current execution",
		spacev1.ReasonExecutionReplaced, r.SandboxID, r.ExecutionID, r.Generation, r.WorkerID))
}

// movedRoute is gen 2 of sb on worker w2.
func movedRoute(sb string) identity.Route {
	r := route(sb, 2)
	r.WorkerID = "w2"
	return r
}

// move publishes r at node on the control plane.
func (cp *fakeCP) move(sb string, r identity.Route, node *fakeNode) {
	cp.mu.Lock()
	cp.routes[sb] = r
	cp.nodeURL = node.srv.URL
	cp.mu.Unlock()
}

type codecCase struct {
	name string
	opts []connect.ClientOption
	ct   string
}

var codecs = []codecCase{
	{"json", []connect.ClientOption{connect.WithProtoJSON()}, "application/connect+json"},
	{"proto", nil, "application/connect+proto"},
}

func (h *harness) processClient(c codecCase) processpbconnect.ProcessClient {
	return processpbconnect.NewProcessClient(h.cl, h.srv.URL, c.opts...)
}

func sandboxHeaders(h http.Header, sb string) {
	h.Set(HeaderSandboxID, sb)
	h.Set(HeaderSandboxPort, "49983")
	h.Set("Authorization", "Basic dXNlcjo=") // e2b's user selection
}

// received is what a client read from a process stream.
type received struct {
	starts []uint32
	out    string
	ends   []int32
	err    error
}

func collect[T interface {
	GetEvent() *processpb.ProcessEvent
}](s interface {
	Receive() bool
	Msg() T
	Err() error
}) received {
	var r received
	for s.Receive() {
		ev := s.Msg().GetEvent()
		switch {
		case ev.GetStart() != nil:
			r.starts = append(r.starts, ev.GetStart().GetPid())
		case ev.GetData() != nil:
			r.out += string(ev.GetData().GetStdout())
		case ev.GetEnd() != nil:
			r.ends = append(r.ends, ev.GetEnd().GetExitCode())
		}
	}
	r.err = s.Err()
	return r
}

func startProcess(t *testing.T, h *harness, c codecCase, sb string) received {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	req := connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "sh"}})
	sandboxHeaders(req.Header(), sb)
	stream, err := h.processClient(c).Start(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	return collect(stream)
}

func isReplaced(err error) bool {
	var ce *connect.Error
	return errors.As(err, &ce) && ce.Code() == connect.CodeUnavailable && strings.HasPrefix(ce.Message(), spacev1.ReasonExecutionReplaced)
}

// movingHarness: sandbox sb at gen 1 on h.node, whose Start emits "one"
// and then (after publishing the move to node2) ends with execution
// replaced; node2 serves gen 2 with connect.
func movingHarness(t *testing.T, sb string, connectFn func(context.Context, *connect.Request[processpb.ConnectRequest], *connect.ServerStream[processpb.ConnectResponse]) error, mod ...func(*Config)) (*harness, *fakeNode) {
	h := newHarness(t, mod...)
	h.edge.reattachBackoff = 5 * time.Millisecond
	r1 := h.sandbox(sb)
	node2 := newFakeNode(t, h.verifier)
	node2.install(movedRoute(sb))
	serveProcess(h.node, &fakeProcess{start: func(_ context.Context, _ *connect.Request[processpb.StartRequest], s *connect.ServerStream[processpb.StartResponse]) error {
		_ = s.Send(&processpb.StartResponse{Event: startEv(testPid)})
		_ = s.Send(&processpb.StartResponse{Event: stdoutEv("one\n")})
		h.cp.move(sb, movedRoute(sb), node2)
		return replacedErr(r1)
	}})
	serveProcess(node2, &fakeProcess{connect: connectFn})
	return h, node2
}

func connectOutput(more ...string) func(context.Context, *connect.Request[processpb.ConnectRequest], *connect.ServerStream[processpb.ConnectResponse]) error {
	return func(_ context.Context, r *connect.Request[processpb.ConnectRequest], s *connect.ServerStream[processpb.ConnectResponse]) error {
		if r.Msg.GetProcess().GetPid() != testPid {
			return connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", r.Msg.GetProcess().GetPid()))
		}
		_ = s.Send(&processpb.ConnectResponse{Event: startEv(testPid)})
		for _, m := range more {
			_ = s.Send(&processpb.ConnectResponse{Event: stdoutEv(m)})
		}
		return s.Send(&processpb.ConnectResponse{Event: endEv(0)})
	}
}

// reattachCount reads space_edge_stream_reattaches_total{result} from the
// edge's /metrics.
func reattachCount(h *harness, result string) float64 {
	h.t.Helper()
	res, err := h.cl.Get(h.srv.URL + "/metrics")
	if err != nil {
		h.t.Fatal(err)
	}
	prefix := `space_edge_stream_reattaches_total{result="` + result + `"} `
	for _, l := range strings.Split(readAll(h.t, res), "\n") {
		if v, ok := strings.CutPrefix(l, prefix); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				h.t.Fatal(err)
			}
			return f
		}
	}
	return 0
}

func TestReattachAcrossMove(t *testing.T) {
	for _, c := range codecs {
		t.Run(c.name, func(t *testing.T) {
			h, node2 := movingHarness(t, "sbx1", connectOutput("two\n", "three\n"))
			got := startProcess(t, h, c, "sbx1")
			if got.err != nil || len(got.starts) != 1 || got.starts[0] != testPid || got.out != "one\ntwo\nthree\n" || len(got.ends) != 1 {
				t.Fatalf("client saw %+v, want one StartEvent, all output, one EndEvent", got)
			}
			if calls := h.node.callsCopy(); len(calls) != 1 || calls[0].Path != processStartPath {
				t.Fatalf("old node calls: %+v", calls)
			}
			calls := node2.callsCopy()
			if len(calls) != 1 || calls[0].Path != processConnectPath || calls[0].Outcome != "allow" {
				t.Fatalf("new node calls: %+v", calls)
			}
			nc := calls[0]
			claims, err := h.verifier.Verify(nc.Header.Get(spacev1.HeaderCapability), capability.PurposeProcess)
			if err != nil || claims.Route != movedRoute("sbx1") {
				t.Fatalf("reattach capability: %+v %v", claims.Route, err)
			}
			if ct := nc.Header.Get("Content-Type"); ct != c.ct {
				t.Fatalf("reattach codec %q, want %q", ct, c.ct)
			}
			if nc.Header.Get("Authorization") != "Basic dXNlcjo=" || nc.Header.Get(spacev1.HeaderAccessToken) != "" {
				t.Fatalf("reattach headers: %v", nc.Header)
			}
			if h.cp.repairs() != 1 {
				t.Fatalf("repairs = %d, want 1", h.cp.repairs())
			}
			if n := reattachCount(h, reattachOK); n != 1 {
				t.Fatalf("reattached metric = %v", n)
			}
		})
	}
}

func TestReattachProcessGoneEndsWithExecutionReplaced(t *testing.T) {
	for _, c := range codecs {
		t.Run(c.name, func(t *testing.T) {
			h, node2 := movingHarness(t, "sbx1", nil) // ns substrate: the process is not there
			got := startProcess(t, h, c, "sbx1")
			if !isReplaced(got.err) || got.out != "one\n" || len(got.starts) != 1 || len(got.ends) != 0 {
				t.Fatalf("client saw %+v (err %v), want output then execution replaced", got, got.err)
			}
			if !strings.Contains(got.err.Error(), "generation 1") {
				t.Fatalf("not the original end: %v", got.err)
			}
			if n := len(node2.callsCopy()); n != 1 {
				t.Fatalf("new node calls = %d, want 1 (not_found is final)", n)
			}
			if n := reattachCount(h, reattachGone); n != 1 {
				t.Fatalf("process_gone metric = %v", n)
			}
		})
	}
}

func TestOtherStreamErrorsAreForwarded(t *testing.T) {
	for _, c := range codecs {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			h.sandbox("sbx1")
			serveProcess(h.node, &fakeProcess{start: func(_ context.Context, _ *connect.Request[processpb.StartRequest], s *connect.ServerStream[processpb.StartResponse]) error {
				_ = s.Send(&processpb.StartResponse{Event: startEv(testPid)})
				return connect.NewError(connect.CodeUnavailable, errors.New("guest restarting"))
			}})
			got := startProcess(t, h, c, "sbx1")
			var ce *connect.Error
			if !errors.As(got.err, &ce) || ce.Code() != connect.CodeUnavailable || ce.Message() != "guest restarting" {
				t.Fatalf("err = %v", got.err)
			}
			if h.cp.repairs() != 0 {
				t.Fatal("an ordinary error triggered a route resolution")
			}
			// A clean end passes too.
			serveProcess(h.node, &fakeProcess{start: func(_ context.Context, _ *connect.Request[processpb.StartRequest], s *connect.ServerStream[processpb.StartResponse]) error {
				_ = s.Send(&processpb.StartResponse{Event: startEv(testPid)})
				return s.Send(&processpb.StartResponse{Event: endEv(3)})
			}})
			got = startProcess(t, h, c, "sbx1")
			if got.err != nil || len(got.ends) != 1 || got.ends[0] != 3 {
				t.Fatalf("clean end: %+v", got)
			}
		})
	}
}

func TestReattachAttemptsAreBounded(t *testing.T) {
	h, node2 := movingHarness(t, "sbx1", nil, func(c *Config) { c.ReattachAttempts = 3 })
	node2.handle(processConnectPath, func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable) // still starting
	})
	got := startProcess(t, h, codecs[0], "sbx1")
	if !isReplaced(got.err) || got.out != "one\n" {
		t.Fatalf("client saw %+v", got)
	}
	if n := len(node2.callsCopy()); n != 3 {
		t.Fatalf("new node calls = %d, want 3", n)
	}
	if n := reattachCount(h, reattachFailed); n != 1 {
		t.Fatalf("failed metric = %v", n)
	}
}

func TestReattachWindowBoundsWaitForRoute(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.ReattachWindow = 300 * time.Millisecond })
	h.edge.reattachBackoff = 10 * time.Millisecond
	r1 := h.sandbox("sbx1")
	// The control plane never publishes a new route.
	serveProcess(h.node, &fakeProcess{start: func(_ context.Context, _ *connect.Request[processpb.StartRequest], s *connect.ServerStream[processpb.StartResponse]) error {
		_ = s.Send(&processpb.StartResponse{Event: startEv(testPid)})
		return replacedErr(r1)
	}})
	begin := time.Now()
	got := startProcess(t, h, codecs[1], "sbx1")
	if !isReplaced(got.err) {
		t.Fatalf("err = %v", got.err)
	}
	if d := time.Since(begin); d < 300*time.Millisecond || d > 5*time.Second {
		t.Fatalf("took %v, want about the window", d)
	}
	if n := len(h.node.callsCopy()); n != 1 {
		t.Fatalf("node calls = %d: the replaced route was tried again", n)
	}
	if h.cp.repairs() < 2 {
		t.Fatalf("repairs = %d, want the edge to poll", h.cp.repairs())
	}
}

func TestReattachWaitsWhileMoveIsPublished(t *testing.T) {
	const sb = "sbx1"
	h := newHarness(t)
	h.edge.reattachBackoff = 5 * time.Millisecond
	r1 := h.sandbox(sb)
	node2 := newFakeNode(t, h.verifier)
	node2.install(movedRoute(sb))
	serveProcess(node2, &fakeProcess{connect: connectOutput("after\n")})
	var polls atomic.Int32
	h.cp.onRepair = func() {
		switch polls.Add(1) {
		case 1:
			// still the old route
		case 2:
			h.cp.mu.Lock()
			h.cp.status = http.StatusConflict // moving
			h.cp.mu.Unlock()
		default:
			h.cp.mu.Lock()
			h.cp.status = 0
			h.cp.mu.Unlock()
			h.cp.move(sb, movedRoute(sb), node2)
		}
	}
	serveProcess(h.node, &fakeProcess{start: func(_ context.Context, _ *connect.Request[processpb.StartRequest], s *connect.ServerStream[processpb.StartResponse]) error {
		_ = s.Send(&processpb.StartResponse{Event: startEv(testPid)})
		return replacedErr(r1)
	}})
	got := startProcess(t, h, codecs[0], sb)
	if got.err != nil || got.out != "after\n" || len(got.starts) != 1 || len(got.ends) != 1 {
		t.Fatalf("client saw %+v", got)
	}
	if n := len(node2.callsCopy()); n != 1 {
		t.Fatalf("new node calls = %d, want 1 (waiting spends no attempt)", n)
	}
}

func TestReattachConnectBySelectorWithoutStartEvent(t *testing.T) {
	// A Connect whose old stream ended before any message (the lease
	// ended before the answer's headers): the pid comes from the request,
	// and the new stream's StartEvent is the client's first message.
	for _, c := range codecs {
		t.Run(c.name, func(t *testing.T) {
			const sb = "sbx1"
			h := newHarness(t)
			h.edge.reattachBackoff = 5 * time.Millisecond
			r1 := h.sandbox(sb)
			node2 := newFakeNode(t, h.verifier)
			node2.install(movedRoute(sb))
			serveProcess(node2, &fakeProcess{connect: connectOutput("later\n")})
			serveProcess(h.node, &fakeProcess{connect: func(context.Context, *connect.Request[processpb.ConnectRequest], *connect.ServerStream[processpb.ConnectResponse]) error {
				h.cp.move(sb, movedRoute(sb), node2)
				return replacedErr(r1)
			}})
			ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
			defer cancel()
			req := connect.NewRequest(&processpb.ConnectRequest{Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: testPid}}})
			sandboxHeaders(req.Header(), sb)
			stream, err := h.processClient(c).Connect(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			defer stream.Close()
			got := collect(stream)
			if got.err != nil || len(got.starts) != 1 || got.starts[0] != testPid || got.out != "later\n" || len(got.ends) != 1 {
				t.Fatalf("client saw %+v", got)
			}
		})
	}
}

func TestReattachClientCancelLeaksNothing(t *testing.T) {
	h := newHarness(t)
	h.edge.reattachBackoff = 5 * time.Millisecond
	r1 := h.sandbox("sbx1")
	serveProcess(h.node, &fakeProcess{start: func(_ context.Context, _ *connect.Request[processpb.StartRequest], s *connect.ServerStream[processpb.StartResponse]) error {
		_ = s.Send(&processpb.StartResponse{Event: startEv(testPid)})
		return replacedErr(r1) // the control plane keeps the old route: the edge waits
	}})
	ctx, cancel := context.WithCancel(t.Context())
	req := connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "sh"}})
	sandboxHeaders(req.Header(), "sbx1")
	// A connection of its own, never pooled: a cancelled stream's
	// connection must close (that is how the edge learns the client left),
	// not go back to a pool the metrics requests below would then wait on.
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	client := processpbconnect.NewProcessClient(&http.Client{Transport: tr}, h.srv.URL, codecs[0].opts...)
	stream, err := client.Start(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close() // after the cancel: connect-go drains an open body on Close
	if !stream.Receive() || stream.Msg().GetEvent().GetStart() == nil {
		t.Fatal("no StartEvent")
	}
	deadline := time.Now().Add(10 * time.Second)
	for h.cp.repairs() < 2 {
		if time.Now().After(deadline) {
			t.Fatal("edge is not reattaching")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	deadline = time.Now().Add(20 * time.Second)
	for reattachCount(h, reattachCancelled) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("reattach not abandoned after client cancel")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// TestMain's goleak check covers the rest.
}

// TestReattachParsesSplitEnvelopes: a node that writes its stream one byte
// at a time (envelopes split across reads) still reattaches, and bytes that
// are not Connect envelopes pass unparsed.
func TestReattachParsesSplitEnvelopes(t *testing.T) {
	const sb = "sbx1"
	h := newHarness(t)
	h.edge.reattachBackoff = 5 * time.Millisecond
	r1 := h.sandbox(sb)
	node2 := newFakeNode(t, h.verifier)
	node2.install(movedRoute(sb))
	serveProcess(node2, &fakeProcess{connect: connectOutput("b\n")})
	c := codecs[0]
	h.node.handle(processStartPath, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", c.ct)
		var stream []byte
		for _, ev := range []*processpb.ProcessEvent{startEv(testPid), stdoutEv("a\n")} {
			b, _ := c2(c).marshal(&processpb.StartResponse{Event: ev})
			stream = append(stream, envelope.Frame(0, b)...)
		}
		end := []byte(`{"error":{"code":"unavailable","message":"` + replacedErr(r1).(*connect.Error).Message() + `"}}`)
		stream = append(stream, envelope.Frame(envelope.FlagEndStream, end)...)
		h.cp.move(sb, movedRoute(sb), node2)
		rc := http.NewResponseController(w)
		for i := range stream {
			_, _ = w.Write(stream[i : i+1])
			_ = rc.Flush()
		}
	})
	got := startProcess(t, h, c, sb)
	if got.err != nil || got.out != "a\nb\n" || len(got.starts) != 1 || len(got.ends) != 1 {
		t.Fatalf("client saw %+v", got)
	}
}

func c2(c codecCase) codec { return codecOf(c.ct) }

func TestEnvelopeHelpers(t *testing.T) {
	for _, c := range []codec{codecJSON, codecProto} {
		body, err := connectRequestBody(c, 7)
		if err != nil {
			t.Fatal(err)
		}
		if pid, ok := selectedPid(c, body, ""); !ok || pid != 7 {
			t.Fatalf("selectedPid = %d %v", pid, ok)
		}
		if int(binary.BigEndian.Uint32(body[1:5])) != len(body)-5 {
			t.Fatal("bad envelope length")
		}
	}
	if codecOf("application/connect+json; charset=utf-8") != codecJSON || codecOf("application/json") != codecNone {
		t.Fatal("codecOf")
	}
	for in, want := range map[string]bool{
		`{"error":{"code":"unavailable","message":"execution replaced: x"}}`: true,
		`{"error":{"code":"unavailable","message":"other"}}`:                 false,
		`{}`: false,
	} {
		ee, err := envelope.ParseEnd([]byte(in))
		if err != nil || executionReplaced(ee) != want {
			t.Fatalf("%s: %+v %v", in, ee, err)
		}
	}
}

// TestProcessMessagesAreNotDelayed: each message reaches the client before
// the next is produced, before and after a reattach.
func TestProcessMessagesAreNotDelayed(t *testing.T) {
	const sb = "sbx1"
	h := newHarness(t)
	h.edge.reattachBackoff = 5 * time.Millisecond
	r1 := h.sandbox(sb)
	node2 := newFakeNode(t, h.verifier)
	node2.install(movedRoute(sb))
	next := make(chan struct{})
	step := func(ctx context.Context) bool {
		select {
		case <-next:
			return true
		case <-ctx.Done():
			return false
		case <-time.After(10 * time.Second):
			return false
		}
	}
	serveProcess(h.node, &fakeProcess{start: func(ctx context.Context, _ *connect.Request[processpb.StartRequest], s *connect.ServerStream[processpb.StartResponse]) error {
		_ = s.Send(&processpb.StartResponse{Event: startEv(testPid)})
		for _, m := range []string{"1", "2"} {
			if !step(ctx) {
				return ctx.Err()
			}
			_ = s.Send(&processpb.StartResponse{Event: stdoutEv(m)})
		}
		h.cp.move(sb, movedRoute(sb), node2)
		return replacedErr(r1)
	}})
	serveProcess(node2, &fakeProcess{connect: func(ctx context.Context, _ *connect.Request[processpb.ConnectRequest], s *connect.ServerStream[processpb.ConnectResponse]) error {
		_ = s.Send(&processpb.ConnectResponse{Event: startEv(testPid)})
		for _, m := range []string{"3", "4"} {
			if !step(ctx) {
				return ctx.Err()
			}
			_ = s.Send(&processpb.ConnectResponse{Event: stdoutEv(m)})
		}
		return s.Send(&processpb.ConnectResponse{Event: endEv(0)})
	}})
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	req := connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "sh"}})
	sandboxHeaders(req.Header(), sb)
	stream, err := h.processClient(codecs[0]).Start(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if !stream.Receive() || stream.Msg().GetEvent().GetStart() == nil {
		t.Fatal("no StartEvent")
	}
	for _, want := range []string{"1", "2", "3", "4"} {
		next <- struct{}{} // blocks until the node is waiting for it
		if !stream.Receive() || string(stream.Msg().GetEvent().GetData().GetStdout()) != want {
			t.Fatalf("want %q: %v %v", want, stream.Msg(), stream.Err())
		}
	}
	if !stream.Receive() || stream.Msg().GetEvent().GetEnd() == nil {
		t.Fatalf("no EndEvent: %v", stream.Err())
	}
}

func TestPayloadOfGzip(t *testing.T) {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	b, _ := codecProto.marshal(&processpb.StartResponse{Event: startEv(9)})
	_, _ = zw.Write(b)
	_ = zw.Close()
	pl, ok := payloadOf(envelope.FlagCompressed, buf.Bytes(), "gzip")
	if !ok {
		t.Fatal("gzip payload not decoded")
	}
	if pid, ok := startPid(codecProto, pl); !ok || pid != 9 {
		t.Fatalf("pid %d %v", pid, ok)
	}
	if _, ok := payloadOf(envelope.FlagCompressed, buf.Bytes(), "br"); ok {
		t.Fatal("unknown encoding decoded")
	}
}
