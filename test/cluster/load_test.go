package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/sdk"
)

// labelKey carries, in a request's context, where the transport puts the
// Space-Execution header of the answer (the execution that served it).
type labelKey struct{}

// labelTransport records the answer's Space-Execution in the request
// context's *string (SDK requests keep the caller's context).
type labelTransport struct{ base http.RoundTripper }

func (t labelTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := t.base.RoundTrip(r)
	if err == nil {
		if p, ok := r.Context().Value(labelKey{}).(*string); ok {
			if l := resp.Header.Get(spacev1.HeaderExecution); l != "" {
				*p = l
			}
		}
	}
	return resp, err
}

// opResult is one client operation, after the client's retry.
type opResult struct {
	kind     string
	data     bool // a data-plane operation (through an edge)
	via      int  // the replica pair of the first attempt
	t0, t1   time.Time
	firstErr string // the first attempt's error (after the edge's one rebuilt attempt)
	err      string // after the retry against the other replica ("" ok)
}

// served is a data-plane answer and the execution that gave it.
type served struct {
	sandbox, label, kind string
	t0, t1               time.Time
}

// ack is a file write that got 200.
type ack struct {
	sandbox, path, content, label string
	t                             time.Time
}

// sbx is a sandbox the load uses; lc is held (Lock) by a lifecycle
// operation and (RLock) by data-plane requests, which skip it while a
// lifecycle operation runs.
type sbx struct {
	id, token string
	lc        sync.RWMutex
}

// load is the client: SDK clients for (control plane i, edge i), every
// operation through one pair and, when it fails, once through the other.
type load struct {
	c       *cluster
	clients [2]*sdk.Client
	rr      atomic.Uint64

	mu      sync.Mutex
	sbxs    []*sbx
	results []opResult
	served  []served
	acks    []ack
	// gone: acknowledged writes a later execution answered not found for
	// (the load reads them no more; verify judges them).
	gone    map[string]bool
	created map[string]time.Time // acknowledged creates
	nfiles  int
}

func newLoad(c *cluster) (*load, error) {
	l := &load{c: c, created: map[string]time.Time{}, gone: map[string]bool{}}
	hc := &http.Client{Transport: labelTransport{base: c.http.Transport}}
	for i := range l.clients {
		cl, err := sdk.New(sdk.Config{APIURL: c.apiURL(i), SandboxURL: c.edgeURL(i), APIKey: apiKey, HTTPClient: hc})
		if err != nil {
			return nil, err
		}
		l.clients[i] = cl
	}
	return l, nil
}

// try runs f against replica pair j (round robin), and once more against
// the other when it fails, as a client or load balancer in front of two
// replicas does. It records the result.
func (l *load) try(ctx context.Context, kind string, f func(ctx context.Context, j int) error) error {
	j := int(l.rr.Add(1) % 2)
	r := opResult{kind: kind, t0: time.Now(), via: j, data: kind == "exec" || kind == "write" || kind == "read"}
	err := f(ctx, j)
	if err != nil && ctx.Err() == nil {
		r.firstErr = errClass(err)
		err = f(ctx, 1-j)
	}
	r.t1 = time.Now()
	if err != nil {
		if ctx.Err() != nil && r.firstErr == "" {
			return err // the load stopped: not a result
		}
		r.err = errClass(err)
	}
	l.mu.Lock()
	l.results = append(l.results, r)
	l.mu.Unlock()
	return err
}

// errClass shortens an error to its class for the report.
func errClass(err error) string {
	var se *sdk.Error
	if errors.As(err, &se) {
		s := fmt.Sprintf("%d %s %s", se.Status, se.Code, se.Reason)
		if se.Status == 0 && se.Code == "" {
			s = se.Error()
		}
		return strings.Join(strings.Fields(s), " ")
	}
	s := err.Error()
	for _, k := range []string{"connection refused", "connection reset", "i/o timeout", "no route to host", "EOF", "deadline exceeded", "timeout"} {
		if strings.Contains(s, k) {
			return "transport: " + k
		}
	}
	if len(s) > 80 {
		s = s[:80]
	}
	return s
}

// create makes a sandbox through the API (an acknowledged create).
func (l *load) create(ctx context.Context) (*sbx, error) {
	var s *sbx
	err := l.try(ctx, "create", func(ctx context.Context, j int) error {
		cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		h, err := l.clients[j].CreateSandbox(cctx, sdk.CreateOptions{Template: "base", Timeout: time.Hour, Secure: true})
		if err != nil {
			return err
		}
		s = &sbx{id: h.ID, token: h.AccessToken}
		return nil
	})
	if err != nil {
		return nil, err
	}
	l.mu.Lock()
	l.sbxs = append(l.sbxs, s)
	l.created[s.id] = time.Now()
	l.mu.Unlock()
	return s, nil
}

// pick returns a random sandbox no lifecycle operation holds, read-locked.
func (l *load) pick(r *rand.Rand) *sbx {
	l.mu.Lock()
	defer l.mu.Unlock()
	for range 8 {
		if len(l.sbxs) == 0 {
			return nil
		}
		s := l.sbxs[r.IntN(len(l.sbxs))]
		if s.lc.TryRLock() {
			return s
		}
	}
	return nil
}

// dataOp runs one data-plane operation on s through an edge (and the
// other one when it fails), recording which execution answered.
func (l *load) dataOp(ctx context.Context, s *sbx, kind string, f func(ctx context.Context, h *sdk.Sandbox) error) error {
	return l.try(ctx, kind, func(ctx context.Context, j int) error {
		label := new(string)
		actx, cancel := context.WithTimeout(context.WithValue(ctx, labelKey{}, label), 30*time.Second)
		defer cancel()
		t0 := time.Now()
		err := f(actx, l.clients[j].Attach(s.id, s.token))
		if *label != "" {
			l.mu.Lock()
			l.served = append(l.served, served{sandbox: s.id, label: *label, kind: kind, t0: t0, t1: time.Now()})
			l.mu.Unlock()
		}
		return err
	})
}

// client is one load goroutine: commands, writes and read-backs.
func (l *load) client(ctx context.Context, seed uint64) {
	r := rand.New(rand.NewPCG(seed, seed*7+1))
	for ctx.Err() == nil {
		if s := l.pick(r); s != nil {
			l.oneOp(ctx, r, s)
			s.lc.RUnlock()
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(50+r.IntN(100)) * time.Millisecond):
		}
	}
}

func (l *load) oneOp(ctx context.Context, r *rand.Rand, s *sbx) {
	switch n := r.IntN(10); {
	case n < 4: // a command; its output must be its own
		word := fmt.Sprintf("w%d", r.Uint32())
		_ = l.dataOp(ctx, s, "exec", func(ctx context.Context, h *sdk.Sandbox) error {
			var out bytes.Buffer
			code, err := h.Run(ctx, "echo "+word, sdk.RunOptions{Stdout: &out})
			if err == nil && (code != 0 || out.String() != word+"\n") {
				return fmt.Errorf("wrong result: code %d stdout %q", code, out.String())
			}
			return err
		})
	case n < 7: // a write; acknowledged ones are read back at the end
		l.mu.Lock()
		l.nfiles++
		path := fmt.Sprintf("/tmp/cl/f%d", l.nfiles)
		l.mu.Unlock()
		content := fmt.Sprintf("%s %s %d", s.id, path, r.Uint64())
		label := ""
		err := l.dataOp(ctx, s, "write", func(ctx context.Context, h *sdk.Sandbox) error {
			_, err := h.WriteFile(ctx, path, []byte(content))
			if p, ok := ctx.Value(labelKey{}).(*string); ok && err == nil {
				label = *p
			}
			return err
		})
		if err == nil {
			l.mu.Lock()
			l.acks = append(l.acks, ack{sandbox: s.id, path: path, content: content, label: label, t: time.Now()})
			l.mu.Unlock()
		}
	default: // a read of an acknowledged write of s
		a, ok := l.ackOf(r, s.id)
		if !ok {
			return
		}
		_ = l.dataOp(ctx, s, "read", func(ctx context.Context, h *sdk.Sandbox) error {
			b, err := h.ReadFile(ctx, a.path)
			if err == nil && string(b) != a.content {
				return fmt.Errorf("acknowledged write read back wrong")
			}
			// Not there, answered by a later execution than the one
			// that acknowledged it: the sandbox was recovered from an
			// earlier snapshot after its worker was lost, which
			// verify judges at the end (lostWithWorker) for every
			// acknowledged write. The load stops reading it instead
			// of counting the same answer as a failure until the end.
			if errors.Is(err, sdk.ErrNotFound) {
				if p, ok := ctx.Value(labelKey{}).(*string); ok && *p != "" && *p != a.label && laterExecution(*p, a.label) {
					l.mu.Lock()
					l.gone[a.path] = true
					l.mu.Unlock()
					return nil
				}
			}
			return err
		})
	}
}

func (l *load) ackOf(r *rand.Rand, id string) (ack, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var mine []ack
	for _, a := range l.acks {
		if a.sandbox == id && !l.gone[a.path] {
			mine = append(mine, a)
		}
	}
	if len(mine) == 0 {
		return ack{}, false
	}
	return mine[r.IntN(len(mine))], true
}

// lifecycle is the load's lifecycle goroutine: every few seconds a create
// (up to maxSbx sandboxes) or a pause then resume of a sandbox.
func (l *load) lifecycle(ctx context.Context, maxSbx int) {
	r := rand.New(rand.NewPCG(99, 1))
	for i := 0; ctx.Err() == nil; i++ {
		select {
		case <-ctx.Done():
			return
		case <-time.After(4 * time.Second):
		}
		l.mu.Lock()
		n := len(l.sbxs)
		l.mu.Unlock()
		if i%3 == 0 && n < maxSbx {
			_, _ = l.create(ctx)
			continue
		}
		l.mu.Lock()
		s := l.sbxs[r.IntN(n)]
		l.mu.Unlock()
		s.lc.Lock()
		_ = l.try(ctx, "pause", func(ctx context.Context, j int) error {
			cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			defer cancel()
			return l.clients[j].PauseSandbox(cctx, s.id)
		})
		// Resume (connect), again until it takes, as a client that wants
		// its sandbox back does: a failed resume leaves it paused.
		for attempt := 0; ctx.Err() == nil && attempt < 30; attempt++ {
			if err := l.resume(ctx, s); err == nil {
				break
			}
			select {
			case <-ctx.Done():
			case <-time.After(2 * time.Second):
			}
		}
		s.lc.Unlock()
	}
}

// resume connects to s (resuming it when paused).
func (l *load) resume(ctx context.Context, s *sbx) error {
	return l.try(ctx, "resume", func(ctx context.Context, j int) error {
		cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		_, _, err := l.clients[j].ConnectSandbox(cctx, s.id, time.Hour)
		return err
	})
}

// slowOp is how long an operation may take before it counts against
// recovery (a request that hung on a cut-off host, then succeeded).
const slowOp = 5 * time.Second

// window sums the results with t0 in [from, to).
type windowStats struct {
	ops, firstErrs, errs int
	dataFirstErrsVia     [2]int        // data-plane operations whose first attempt (edge i) failed
	slow                 int           // succeeded, but took longer than slowOp
	maxLatency           time.Duration // of the operations that succeeded
	lastErr              time.Time     // end of the last failed or slow operation
	classes              map[string]int
}

func (l *load) window(from, to time.Time) windowStats {
	l.mu.Lock()
	defer l.mu.Unlock()
	w := windowStats{classes: map[string]int{}}
	for _, r := range l.results {
		if r.t0.Before(from) || !r.t0.Before(to) {
			continue
		}
		w.ops++
		if r.firstErr != "" {
			w.firstErrs++
			if r.data {
				w.dataFirstErrsVia[r.via]++
			}
		}
		d := r.t1.Sub(r.t0)
		if r.err == "" && d > w.maxLatency {
			w.maxLatency = d
		}
		if r.err == "" && d > slowOp && r.kind != "create" && r.kind != "pause" && r.kind != "resume" {
			w.slow++
		} else if r.err == "" {
			continue
		}
		if r.err != "" {
			w.errs++
			w.classes[r.kind+": "+r.err]++
		}
		if r.t1.After(w.lastErr) {
			w.lastErr = r.t1
		}
	}
	return w
}

// lastFailure is the end of the last failed (after the retry) or slow
// data-plane operation.
func (l *load) lastFailure() time.Time {
	return l.window(time.Time{}, time.Now().Add(time.Hour)).lastErr
}

func topClasses(m map[string]int, n int) string {
	type kv struct {
		k string
		v int
	}
	var all []kv
	for k, v := range m {
		all = append(all, kv{k, v})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].v > all[j].v })
	var parts []string
	for i, e := range all {
		if i == n {
			break
		}
		parts = append(parts, fmt.Sprintf("%dx %s", e.v, e.k))
	}
	return strings.Join(parts, "; ")
}

// laterExecution reports whether execution label cur ("sandbox/generation/
// execution") is of a later generation than was.
func laterExecution(cur, was string) bool {
	gen := func(l string) int {
		parts := strings.Split(l, "/")
		if len(parts) < 2 {
			return -1
		}
		n, err := strconv.Atoi(parts[1])
		if err != nil {
			return -1
		}
		return n
	}
	c, w := gen(cur), gen(was)
	return c > 0 && w > 0 && c > w
}
