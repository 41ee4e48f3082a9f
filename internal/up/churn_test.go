package up

// TestChurn: 3 workers, 20 sandboxes, random pause/resume/migrate while
// client goroutines run reads, writes and execs through the edge. Runs for
// $SPACE_CHURN_DURATION (default 20s; `make churn` sets 10m).
//
// Counted and printed:
//   - requests (client operations; the edge's rebuilt attempts are inside);
//   - misroutes: a response whose Space-Execution names an execution that
//     was not the sandbox's published route at any point during the request
//     (reads and writes go through a raw HTTP client to see the header);
//     the published-route intervals come from the control plane's record
//     history (when an execution was retired) and a watch of the store (when
//     a route was first published); must be 0;
//   - errors after the edge's one rebuilt attempt, by class, with the count
//     and rate (target <= 0.0002%). 409s while the sandbox is paused or in a
//     lifecycle operation are expected and counted apart; requests cut with
//     "execution replaced" because they were in flight in the guest when a
//     move froze and retired it are errors, also shown apart;
//   - acknowledged writes later missing (in-run reads of acknowledged files
//     and a read-back of everything at the end): must be 0;
//   - client connections dropped (transport errors).

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"mime/multipart"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/sdk"
)

const (
	churnSandboxes = 20
	churnClients   = 6
	churnDrivers   = 2
	churnDir       = "/home/user/churn"
)

func churnDuration(t *testing.T) time.Duration {
	d := 20 * time.Second
	if v := os.Getenv("SPACE_CHURN_DURATION"); v != "" {
		var err error
		if d, err = time.ParseDuration(v); err != nil || d <= 0 {
			t.Fatalf("SPACE_CHURN_DURATION=%q: want a positive duration", v)
		}
	}
	return d
}

// ---- per-sandbox state ----

type window struct{ from, to time.Time }

type ackedWrite struct{ name, content string }

type churnSandbox struct {
	sbx *sdk.Sandbox

	mu sync.Mutex
	// disturbed is when the lifecycle operation in progress began (zero:
	// none); windows are the finished ones (pause ... resume, migrate).
	disturbed time.Time
	windows   []window
	acked     []ackedWrite
}

func (cs *churnSandbox) begin() {
	cs.mu.Lock()
	cs.disturbed = time.Now()
	cs.mu.Unlock()
}

func (cs *churnSandbox) end() {
	cs.mu.Lock()
	cs.windows = append(cs.windows, window{cs.disturbed, time.Now()})
	cs.disturbed = time.Time{}
	cs.mu.Unlock()
}

// inLifecycle reports whether a lifecycle operation overlapped [start, end].
func (cs *churnSandbox) inLifecycle(start, end time.Time) bool {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if !cs.disturbed.IsZero() && cs.disturbed.Before(end) {
		return true
	}
	for i := len(cs.windows) - 1; i >= 0; i-- {
		w := cs.windows[i]
		if !w.to.Before(start) && !w.from.After(end) {
			return true
		}
		if w.to.Before(start) {
			break // windows are in order
		}
	}
	return false
}

func (cs *churnSandbox) ack(w ackedWrite) {
	cs.mu.Lock()
	cs.acked = append(cs.acked, w)
	cs.mu.Unlock()
}

func (cs *churnSandbox) pickAcked(r *rand.Rand) (ackedWrite, bool) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if len(cs.acked) == 0 {
		return ackedWrite{}, false
	}
	return cs.acked[r.IntN(len(cs.acked))], true
}

// ---- published routes ----

// routeHistory records when each route was first seen published (a store
// watch in this process).
type routeHistory struct {
	mu        sync.Mutex
	firstSeen map[string]time.Time // execution label -> time
}

func (h *routeHistory) observe(ev store.SandboxEvent) {
	if ev.Deleted || ev.Record.Route.ExecutionID == "" {
		return
	}
	now := time.Now()
	l := ev.Record.Route.ExecutionLabel()
	h.mu.Lock()
	if _, ok := h.firstSeen[l]; !ok {
		h.firstSeen[l] = now
	}
	h.mu.Unlock()
}

type served struct {
	sandbox    string
	label      string
	start, end time.Time
}

// ---- stats ----

type churnStats struct {
	requests, ok      atomic.Int64
	reads, writes     atomic.Int64
	execs             atomic.Int64
	expected409       atomic.Int64
	dropped           atomic.Int64
	lostInRun         atomic.Int64
	missingHeader     atomic.Int64
	pauses, resumes   atomic.Int64
	migrates, lcFails atomic.Int64

	mu      sync.Mutex
	errs    map[string]int
	samples []string
	served  []served
}

func (s *churnStats) fail(class, detail string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.errs[class]++
	if len(s.samples) < 20 {
		s.samples = append(s.samples, class+": "+detail)
	}
}

func (s *churnStats) errorCount() (total, cut int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, n := range s.errs {
		total += n
		if strings.Contains(k, spacev1.ReasonExecutionReplaced) {
			cut += n
		}
	}
	return total, cut
}

// ---- the test ----

func TestChurn(t *testing.T) {
	dur := churnDuration(t)
	lp := startPlatform(t, 3)

	hist := &routeHistory{firstSeen: map[string]time.Time{}}
	wctx, wcancel := context.WithCancel(context.Background())
	watchDone := make(chan struct{})
	go func() { defer close(watchDone); _ = lp.st.WatchSandboxes(wctx, hist.observe) }()
	t.Cleanup(func() { wcancel(); <-watchDone })

	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 64
	t.Cleanup(tr.CloseIdleConnections)
	hc := &http.Client{Transport: tr}
	client, err := sdk.New(sdk.Config{APIURL: lp.APIURL, SandboxURL: lp.SandboxURL, APIKey: lp.APIKey, HTTPClient: hc})
	if err != nil {
		t.Fatal(err)
	}

	// Sandboxes, four created at a time.
	sbxs := make([]*churnSandbox, churnSandboxes)
	var cwg sync.WaitGroup
	sem := make(chan struct{}, 4)
	var createErr atomic.Value
	for i := range sbxs {
		cwg.Add(1)
		go func() {
			defer cwg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			sbx, err := client.CreateSandbox(ctx, sdk.CreateOptions{Secure: true, Timeout: time.Hour})
			if err == nil {
				_, err = sbx.Run(ctx, "mkdir -p "+churnDir, sdk.RunOptions{})
			}
			if err != nil {
				createErr.Store(err)
				return
			}
			sbxs[i] = &churnSandbox{sbx: sbx}
		}()
	}
	cwg.Wait()
	if err, _ := createErr.Load().(error); err != nil {
		t.Fatalf("create sandboxes: %v", err)
	}

	st := &churnStats{errs: map[string]int{}}
	repairs0 := lp.edgeRepairs(t)
	ctx, stop := context.WithTimeout(context.Background(), dur)
	defer stop()
	var wg sync.WaitGroup
	for d := range churnDrivers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []*churnSandbox
			for i, cs := range sbxs {
				if i%churnDrivers == d {
					mine = append(mine, cs)
				}
			}
			churnDriver(ctx, lp, hc, mine, st, rand.New(rand.NewPCG(uint64(d), uint64(time.Now().UnixNano()))))
		}()
	}
	for c := range churnClients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			churnClient(ctx, lp, hc, c, sbxs, st, rand.New(rand.NewPCG(uint64(100+c), uint64(time.Now().UnixNano()))))
		}()
	}
	started := time.Now()
	wg.Wait()
	elapsed := time.Since(started)
	repairs := lp.edgeRepairs(t) - repairs0

	// Every sandbox running again, then read back every acknowledged write.
	lost, checked := 0, 0
	var lostSamples []string
	for _, cs := range sbxs {
		if code, body, err := lcCall(context.Background(), hc, lp, http.MethodPost, "/v2/sandboxes/"+cs.sbx.ID+"/connect", map[string]int{"timeout": 3600}); err != nil || (code != http.StatusOK && code != http.StatusCreated) {
			t.Fatalf("connect %s after the churn: %d %s %v", cs.sbx.ID, code, body, err)
		}
		var out bytes.Buffer
		rctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		code, err := cs.sbx.Run(rctx, "cd "+churnDir+" && grep -r -H '' . || true", sdk.RunOptions{Stdout: &out})
		cancel()
		if err != nil || code != 0 {
			t.Fatalf("read back %s: code %d %v", cs.sbx.ID, code, err)
		}
		have := map[string]string{}
		sc := bufio.NewScanner(&out)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			name, content, ok := strings.Cut(strings.TrimPrefix(sc.Text(), "./"), ":")
			if ok {
				have[name] = content
			}
		}
		cs.mu.Lock()
		for _, w := range cs.acked {
			checked++
			if got, ok := have[w.name]; !ok || got != w.content {
				lost++
				if len(lostSamples) < 10 {
					lostSamples = append(lostSamples, fmt.Sprintf("%s %s: have %q (present %v), want %q", cs.sbx.ID, w.name, got, ok, w.content))
				}
			}
		}
		cs.mu.Unlock()
	}

	// Misroutes: each answer's execution must have been the published route
	// at some point during its request.
	type span struct{ from, to time.Time }
	spans := map[string]span{}
	for _, cs := range sbxs {
		rec, _, err := lp.st.GetSandbox(context.Background(), cs.sbx.ID)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range rec.Executions {
			l := e.Route.ExecutionLabel()
			sp := span{from: e.StartedAt, to: time.Now().Add(time.Hour)}
			hist.mu.Lock()
			if seen, ok := hist.firstSeen[l]; ok {
				// The watch sees a publication a little after it happened.
				sp.from = seen.Add(-250 * time.Millisecond)
			}
			hist.mu.Unlock()
			if e.EndedAt != nil {
				sp.to = e.EndedAt.Add(50 * time.Millisecond)
			}
			spans[l] = sp
		}
	}
	misroutes := 0
	var misSamples []string
	st.mu.Lock()
	for _, s := range st.served {
		sp, ok := spans[s.label]
		if ok && strings.HasPrefix(s.label, s.sandbox+"/") && !sp.from.After(s.end) && !sp.to.Before(s.start) {
			continue
		}
		misroutes++
		if len(misSamples) < 10 {
			misSamples = append(misSamples, fmt.Sprintf("%s answered by %s during [%s, %s]; published %v..%v (known %v)",
				s.sandbox, s.label, s.start.Format("15:04:05.000"), s.end.Format("15:04:05.000"),
				sp.from.Format("15:04:05.000"), sp.to.Format("15:04:05.000"), ok))
		}
	}
	nServed := len(st.served)
	st.mu.Unlock()

	reqs := st.requests.Load()
	errTotal, errCut := st.errorCount()
	rate := func(n int) float64 {
		if reqs == 0 {
			return 0
		}
		return 100 * float64(n) / float64(reqs)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "churn: %s, 3 workers, %d sandboxes, %d clients, %d lifecycle drivers\n", elapsed.Round(time.Second), churnSandboxes, churnClients, churnDrivers)
	fmt.Fprintf(&b, "  lifecycle: %d pauses, %d resumes, %d migrations, %d failed lifecycle calls\n", st.pauses.Load(), st.resumes.Load(), st.migrates.Load(), st.lcFails.Load())
	fmt.Fprintf(&b, "  requests: %d (%d reads, %d writes, %d execs), %d ok; edge rebuilt attempts: %d\n", reqs, st.reads.Load(), st.writes.Load(), st.execs.Load(), st.ok.Load(), repairs)
	fmt.Fprintf(&b, "  expected refusals (502 paused / 409 while paused or in a lifecycle operation): %d\n", st.expected409.Load())
	fmt.Fprintf(&b, "  misroutes: %d (of %d answers checked for %s)\n", misroutes, nServed, spacev1.HeaderExecution)
	fmt.Fprintf(&b, "  errors after the one rebuilt attempt: %d (%.5f%%; target <= 0.0002%%)", errTotal, rate(errTotal))
	fmt.Fprintf(&b, "; of which in flight when a move retired the execution (%q): %d; others: %d (%.5f%%)\n",
		spacev1.ReasonExecutionReplaced, errCut, errTotal-errCut, rate(errTotal-errCut))
	st.mu.Lock()
	classes := make([]string, 0, len(st.errs))
	for k := range st.errs {
		classes = append(classes, k)
	}
	sort.Strings(classes)
	for _, k := range classes {
		fmt.Fprintf(&b, "    %6d  %s\n", st.errs[k], k)
	}
	for _, s := range st.samples {
		fmt.Fprintf(&b, "    sample: %s\n", s)
	}
	st.mu.Unlock()
	fmt.Fprintf(&b, "  answers without %s: %d\n", spacev1.HeaderExecution, st.missingHeader.Load())
	fmt.Fprintf(&b, "  acknowledged writes later missing: %d of %d read back at the end, %d seen wrong by in-run reads\n", lost, checked, st.lostInRun.Load())
	fmt.Fprintf(&b, "  client connections dropped: %d\n", st.dropped.Load())
	for _, s := range misSamples {
		fmt.Fprintf(&b, "    misroute: %s\n", s)
	}
	for _, s := range lostSamples {
		fmt.Fprintf(&b, "    lost: %s\n", s)
	}
	t.Log("\n" + b.String())

	if misroutes > 0 {
		t.Errorf("%d misroutes", misroutes)
	}
	if lost > 0 || st.lostInRun.Load() > 0 {
		t.Errorf("acknowledged writes lost: %d at the end, %d in run", lost, st.lostInRun.Load())
	}
	if reqs < 100 {
		t.Errorf("only %d requests in %s: the platform barely served", reqs, elapsed)
	}
	if rate(errTotal) > 1 {
		t.Errorf("error rate %.3f%% after the rebuilt attempt: clearly broken", rate(errTotal))
	}
	if n := st.pauses.Load() + st.migrates.Load(); n == 0 || st.lcFails.Load()*10 > n {
		t.Errorf("lifecycle: %d operations, %d failed", n, st.lcFails.Load())
	}
}

// lcCall sends a control-plane request with the admin key.
func lcCall(ctx context.Context, hc *http.Client, lp *lcPlat, method, path string, body any) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, lp.APIURL+path, rd)
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set(spacev1.HeaderAPIKey, lp.APIKey)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	res, err := hc.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	return res.StatusCode, b, err
}

// churnDriver runs random lifecycle operations on its sandboxes until ctx
// ends: pause, then (after a short while) resume in place or migrate; or
// migrate a running sandbox. Each sandbox ends every cycle running.
func churnDriver(ctx context.Context, lp *lcPlat, hc *http.Client, mine []*churnSandbox, st *churnStats, r *rand.Rand) {
	bg := context.WithoutCancel(ctx)
	call := func(what, method, path string, body any, want ...int) bool {
		code, b, err := lcCall(bg, hc, lp, method, path, body)
		for _, w := range want {
			if err == nil && code == w {
				return true
			}
		}
		st.lcFails.Add(1)
		st.fail("lifecycle "+what, fmt.Sprintf("%d %s %v", code, bytes.TrimSpace(b), err))
		return false
	}
	target := func(cs *churnSandbox) string {
		if r.IntN(3) == 0 {
			return "" // the scheduler's pick
		}
		rec, _, err := lp.st.GetSandbox(bg, cs.sbx.ID)
		if err != nil {
			return ""
		}
		for {
			if w := fmt.Sprintf("w%d", 1+r.IntN(3)); w != rec.Route.WorkerID {
				return w
			}
		}
	}
	migrate := func(cs *churnSandbox) {
		st.migrates.Add(1)
		call("migrate", http.MethodPost, "/space/v1/sandboxes/"+cs.sbx.ID+"/migrate", spacev1.MigrateRequest{TargetWorker: target(cs)}, http.StatusOK)
	}
	for ctx.Err() == nil {
		cs := mine[r.IntN(len(mine))]
		cs.begin()
		if r.IntN(10) < 5 {
			st.pauses.Add(1)
			if call("pause", http.MethodPost, "/sandboxes/"+cs.sbx.ID+"/pause", nil, http.StatusNoContent) {
				time.Sleep(time.Duration(200+r.IntN(600)) * time.Millisecond)
				if r.IntN(2) == 0 {
					st.resumes.Add(1)
					call("connect", http.MethodPost, "/v2/sandboxes/"+cs.sbx.ID+"/connect", map[string]int{"timeout": 3600}, http.StatusCreated)
				} else {
					migrate(cs)
				}
			}
		} else {
			migrate(cs)
		}
		// Running again with a long timeout (a migration of a paused
		// sandbox gives it the default), whatever happened above.
		call("connect", http.MethodPost, "/v2/sandboxes/"+cs.sbx.ID+"/connect", map[string]int{"timeout": 3600}, http.StatusOK, http.StatusCreated)
		cs.end()
		time.Sleep(time.Duration(100+r.IntN(300)) * time.Millisecond)
	}
}

// churnClient runs reads, writes and execs through the edge until ctx ends.
func churnClient(ctx context.Context, lp *lcPlat, hc *http.Client, id int, sbxs []*churnSandbox, st *churnStats, r *rand.Rand) {
	seq := 0
	for ctx.Err() == nil {
		cs := sbxs[r.IntN(len(sbxs))]
		op := r.IntN(10)
		rctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		switch {
		case op < 4:
			seq++
			churnWrite(rctx, lp, hc, cs, ackedWrite{name: fmt.Sprintf("c%d-%d", id, seq), content: randHex(16)}, st)
		case op < 8:
			w, ok := cs.pickAcked(r)
			if !ok {
				cancel()
				continue
			}
			churnRead(rctx, lp, hc, cs, w, st)
		default:
			churnExec(rctx, cs, r, st)
		}
		cancel()
	}
}

func (st *churnStats) record(sandbox, label string, start, end time.Time) {
	if label == "" {
		return
	}
	st.mu.Lock()
	st.served = append(st.served, served{sandbox: sandbox, label: label, start: start, end: end})
	st.mu.Unlock()
}

// outcome classifies a failed answer (status and JSON error body).
func (st *churnStats) outcome(op string, cs *churnSandbox, start, end time.Time, status int, body []byte) {
	var e spacev1.Error
	_ = json.Unmarshal(body, &e)
	if pausedAnswer(status, e.Reason) && cs.inLifecycle(start, end) {
		st.expected409.Add(1)
		return
	}
	class := fmt.Sprintf("%s %d", op, status)
	if e.Reason != "" {
		class += " " + e.Reason
	}
	st.fail(class, fmt.Sprintf("%s: %s", cs.sbx.ID, bytes.TrimSpace(body)))
}

// pausedAnswer reports an expected refusal while a sandbox is paused or in
// a lifecycle operation: the edge's 502 "paused" (E2B's answer for a paused
// sandbox) or a 409 conflict.
func pausedAnswer(status int, reason string) bool {
	return status == http.StatusConflict || (status == http.StatusBadGateway && reason == spacev1.ReasonPaused)
}

func (st *churnStats) transport(op string, cs *churnSandbox, err error) {
	st.dropped.Add(1)
	st.fail(op+" transport", fmt.Sprintf("%s: %v", cs.sbx.ID, err))
}

func edgeRequest(ctx context.Context, lp *lcPlat, method string, cs *churnSandbox, name string, body io.Reader, n int64, ctype string) (*http.Request, error) {
	q := url.Values{"path": {churnDir + "/" + name}}
	req, err := http.NewRequestWithContext(ctx, method, lp.SandboxURL+"/files?"+q.Encode(), body)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.ContentLength = n
		req.Header.Set("Content-Type", ctype)
	}
	req.Header.Set(sdk.HeaderSandboxID, cs.sbx.ID)
	req.Header.Set(sdk.HeaderSandboxPort, "49983")
	req.Header.Set(sdk.HeaderAccessToken, cs.sbx.AccessToken)
	return req, nil
}

func churnWrite(ctx context.Context, lp *lcPlat, hc *http.Client, cs *churnSandbox, w ackedWrite, st *churnStats) {
	st.requests.Add(1)
	st.writes.Add(1)
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	part, _ := mw.CreateFormFile("file", churnDir+"/"+w.name)
	io.WriteString(part, w.content)
	mw.Close()
	req, err := edgeRequest(ctx, lp, http.MethodPost, cs, w.name, &buf, int64(buf.Len()), mw.FormDataContentType())
	if err != nil {
		panic(err)
	}
	start := time.Now()
	res, err := hc.Do(req)
	if err != nil {
		st.transport("write", cs, err)
		return
	}
	b, rerr := io.ReadAll(res.Body)
	res.Body.Close()
	end := time.Now()
	if rerr != nil {
		st.transport("write", cs, rerr)
		return
	}
	label := res.Header.Get(spacev1.HeaderExecution)
	st.record(cs.sbx.ID, label, start, end)
	if res.StatusCode != http.StatusOK {
		st.outcome("write", cs, start, end, res.StatusCode, b)
		return
	}
	if label == "" {
		st.missingHeader.Add(1)
	}
	st.ok.Add(1)
	cs.ack(w)
}

func churnRead(ctx context.Context, lp *lcPlat, hc *http.Client, cs *churnSandbox, w ackedWrite, st *churnStats) {
	st.requests.Add(1)
	st.reads.Add(1)
	req, err := edgeRequest(ctx, lp, http.MethodGet, cs, w.name, nil, 0, "")
	if err != nil {
		panic(err)
	}
	start := time.Now()
	res, err := hc.Do(req)
	if err != nil {
		st.transport("read", cs, err)
		return
	}
	b, rerr := io.ReadAll(res.Body)
	res.Body.Close()
	end := time.Now()
	if rerr != nil {
		st.transport("read", cs, rerr)
		return
	}
	label := res.Header.Get(spacev1.HeaderExecution)
	st.record(cs.sbx.ID, label, start, end)
	switch {
	case res.StatusCode == http.StatusOK && string(b) == w.content:
		if label == "" {
			st.missingHeader.Add(1)
		}
		st.ok.Add(1)
	case res.StatusCode == http.StatusOK || res.StatusCode == http.StatusNotFound:
		// An acknowledged write read back wrong or missing.
		st.lostInRun.Add(1)
		st.fail(fmt.Sprintf("read %d acknowledged write wrong", res.StatusCode),
			fmt.Sprintf("%s %s from %s: %q, want %q", cs.sbx.ID, w.name, label, truncate(b, 200), w.content))
	default:
		st.outcome("read", cs, start, end, res.StatusCode, b)
	}
}

func truncate(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}

func churnExec(ctx context.Context, cs *churnSandbox, r *rand.Rand, st *churnStats) {
	st.requests.Add(1)
	st.execs.Add(1)
	word := fmt.Sprintf("exec-%d", r.Uint32())
	var out bytes.Buffer
	start := time.Now()
	code, err := cs.sbx.Run(ctx, "echo "+word, sdk.RunOptions{Stdout: &out})
	end := time.Now()
	if err == nil {
		if code != 0 || out.String() != word+"\n" {
			st.fail("exec wrong result", fmt.Sprintf("%s: code %d stdout %q", cs.sbx.ID, code, out.String()))
			return
		}
		st.ok.Add(1)
		return
	}
	var se *sdk.Error
	if !errors.As(err, &se) {
		st.transport("exec", cs, err)
		return
	}
	if pausedAnswer(se.Status, se.Reason) && cs.inLifecycle(start, end) {
		st.expected409.Add(1)
		return
	}
	class := "exec"
	switch {
	case se.Status != 0:
		class += fmt.Sprintf(" %d %s", se.Status, se.Reason)
	case strings.Contains(se.Message, spacev1.ReasonExecutionReplaced):
		class += " " + se.Code + " " + spacev1.ReasonExecutionReplaced
	default:
		class += " " + se.Code
	}
	st.fail(class, fmt.Sprintf("%s: %v", cs.sbx.ID, err))
}
