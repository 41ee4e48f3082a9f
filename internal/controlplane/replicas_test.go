package controlplane

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/store"
)

// Several control plane replicas on one etcd (leader.go, keys.go,
// rotate.go, placement.go).

// replica starts another control plane on st with its own data dir,
// sharing clk.
func replica(t *testing.T, st *store.Store, clk *fakeClock, mut func(*Config)) *env {
	t.Helper()
	e := &env{t: t, st: st, dir: t.TempDir(), clock: clk}
	e.start(func(c *Config) {
		c.LeaderTTL = time.Second
		if mut != nil {
			mut(c)
		}
	})
	return e
}

// openClient is another process's client of st's etcd.
func openClient(t *testing.T, st *store.Store) *store.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := store.Open(ctx, store.Config{Endpoints: st.Endpoints(), Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func counter(t *testing.T, c interface{ Write(*dto.Metric) error }) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	if m.Counter != nil {
		return m.Counter.GetValue()
	}
	return m.GetGauge().GetValue()
}

// leaders returns the replicas that lead now.
func leaders(es ...*env) []*env {
	var out []*env
	for _, e := range es {
		if e.srv.Leading() {
			out = append(out, e)
		}
	}
	return out
}

// Exactly one replica runs the reaper; when it closes, the other takes
// over at once and reaps what timed out; the capabilities the first one
// signed still verify, and the second one's control calls are accepted
// by the workers.
func TestReplicasOneLeaderTakeover(t *testing.T) {
	st := openStore(t)
	clk := &fakeClock{t: time.Now()}
	e1 := replica(t, st, clk, nil)
	waitFor(t, func() bool { return e1.srv.Leading() })
	e2 := replica(t, st, clk, nil)
	node := newFakeNode(t, "w1", st)
	e1.register(node, 10)
	if e1.srv.KeyID() != e2.srv.KeyID() {
		t.Fatalf("replicas sign with different keys: %s, %s", e1.srv.KeyID(), e2.srv.KeyID())
	}

	// One leader, for a while; the follower never reaps.
	for range 10 {
		if l := leaders(e1, e2); len(l) != 1 || l[0] != e1 {
			t.Fatalf("leaders: %d", len(l))
		}
		time.Sleep(30 * time.Millisecond)
	}
	if n := counter(t, e2.srv.obs.reaps); n != 0 {
		t.Fatalf("follower ran %v reaper passes", n)
	}
	if counter(t, e1.srv.obs.leader) != 1 || counter(t, e2.srv.obs.leader) != 0 {
		t.Fatal("space_api_leader gauge wrong")
	}
	if id, err := st.Leader(context.Background(), LeaderElection); err != nil || id != e1.srv.Instance() {
		t.Fatalf("election leader %q %v, want %s", id, err, e1.srv.Instance())
	}

	sb := createV2(t, e1, map[string]any{"templateID": "base", "timeout": 5})
	keep := createV2(t, e2, map[string]any{"templateID": "base", "timeout": 3600})
	cp, r := e1.capability(keep.SandboxID)
	if r.Code != 200 {
		t.Fatalf("capability: %d %s", r.Code, r.Body)
	}

	// The leader goes away: the other leads within the TTL.
	gone := time.Now()
	e1.srv.Close()
	waitFor(t, func() bool { return e2.srv.Leading() })
	// Close resigns, so the takeover does not wait for the lease: well
	// within the TTL (1 s) plus Close's own work on a loaded machine.
	if d := time.Since(gone); d > 3*time.Second {
		t.Fatalf("takeover after %s (ttl 1 s)", d)
	}
	if counter(t, e1.srv.obs.leader) != 0 {
		t.Fatal("closed replica still reports leadership")
	}
	clk.Advance(6 * time.Second)
	waitFor(t, func() bool { return e2.api("GET", "/sandboxes/"+sb.SandboxID, nil).Code == 404 })
	if rec, _, _ := st.GetSandbox(context.Background(), sb.SandboxID); rec.State != store.StateKilled || rec.Reason != "timeout" {
		t.Fatalf("record after the new leader's reap: %v %q", rec.State, rec.Reason)
	}
	noTokenErr(t, node) // the teardown's capability, signed by replica 2, verified

	// Replica 1's capability verifies after replica 1 is gone.
	b, err := st.GetBundle(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	v, err := capability.NewVerifier(b)
	if err != nil {
		t.Fatal(err)
	}
	now := clk.Now()
	v.SetClock(func() time.Time { return now })
	if c, err := v.Verify(cp.Token, capability.PurposeProcess); err != nil || c.Route.SandboxID != keep.SandboxID {
		t.Fatalf("replica 1's capability after it is gone: %v", err)
	}
}

// A leader that crashes (its etcd client gone, its lease left to expire)
// is replaced within the lease TTL.
func TestReplicasCrashedLeaderReplaced(t *testing.T) {
	st := openStore(t)
	clk := &fakeClock{t: time.Now()}
	crashing := openClient(t, st)
	e1 := replica(t, crashing, clk, nil)
	waitFor(t, func() bool { return e1.srv.Leading() })
	e2 := replica(t, st, clk, nil)
	if e2.srv.Leading() {
		t.Fatal("two leaders")
	}
	crashed := time.Now()
	_ = crashing.Close() // no resign, no lease revoke: a crash as etcd sees it
	waitFor(t, func() bool { return e2.srv.Leading() })
	// A 1 s lease; etcd may lengthen short leases to its minimum (1.5 x
	// the election timeout) and the expiry is checked on its ticks.
	if d := time.Since(crashed); d > 5*time.Second {
		t.Fatalf("takeover after %s", d)
	}
	waitFor(t, func() bool { return !e1.srv.Leading() })
	if counter(t, e2.srv.obs.leaderChanges.WithLabelValues("won")) != 1 {
		t.Fatal("won transition not counted")
	}
}

// A rotation asked of replica 2 is used by replica 1 once it propagated:
// replica 1's capabilities carry the new kid, and its old ones still
// verify until the old key retires.
func TestReplicasRotation(t *testing.T) {
	st := openStore(t)
	clk := &fakeClock{t: time.Now()}
	e1 := replica(t, st, clk, func(c *Config) { c.KeyPropagation = 100 * time.Millisecond })
	e2 := replica(t, st, clk, func(c *Config) { c.KeyPropagation = 100 * time.Millisecond })
	node := newFakeNode(t, "w1", st)
	e1.register(node, 10)
	sb := createV2(t, e1, map[string]any{"templateID": "base"})
	old, _ := e1.capability(sb.SandboxID)
	oldKID := e1.srv.KeyID()

	r := e2.api("POST", "/space/v1/keys/rotate", nil)
	if r.Code != 200 {
		t.Fatalf("rotate: %d %s", r.Code, r.Body)
	}
	var out spacev1.RotateResponse
	r.decode(t, &out)
	if out.KeyID == "" || out.KeyID == oldKID {
		t.Fatalf("rotate response %+v", out)
	}
	waitFor(t, func() bool { return e1.srv.KeyID() == out.KeyID })
	fresh, _ := e1.capability(sb.SandboxID)
	if tokenKID(t, fresh.Token) != out.KeyID || tokenKID(t, old.Token) != oldKID {
		t.Fatal("replica 1 does not sign with the rotated key")
	}
	b, _ := st.GetBundle(context.Background())
	v, err := capability.NewVerifier(b)
	if err != nil {
		t.Fatal(err)
	}
	now := clk.Now()
	v.SetClock(func() time.Time { return now })
	for _, tok := range []string{old.Token, fresh.Token} {
		if _, err := v.Verify(tok, capability.PurposeProcess); err != nil {
			t.Fatal(err)
		}
	}
	// Replica 1's control calls use the new key and are accepted.
	if r := e1.api("DELETE", "/sandboxes/"+sb.SandboxID, nil); r.Code != 204 {
		t.Fatalf("kill: %d %s", r.Code, r.Body)
	}
	noTokenErr(t, node)
}

// Creates on two replicas at once against limited capacity: no worker is
// given more sandboxes than its capacity (each placement is guarded by
// the worker's placement revision), and every slot is used.
func TestReplicasConcurrentCreatesRespectCapacity(t *testing.T) {
	st := openStore(t)
	clk := &fakeClock{t: time.Now()}
	e1 := replica(t, st, clk, nil)
	e2 := replica(t, st, clk, nil)
	const capacity, workers, creates = 3, 2, 24
	var nodes []*fakeNode
	for i := range workers {
		n := newFakeNode(t, fmt.Sprintf("w%d", i+1), st)
		e1.register(n, capacity)
		nodes = append(nodes, n)
	}
	var wg sync.WaitGroup
	codes := make([]int, creates)
	for i := range creates {
		e := e1
		if i%2 == 1 {
			e = e2
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			codes[i] = e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base"}).Code
		}()
	}
	wg.Wait()
	ok := 0
	for _, c := range codes {
		switch c {
		case 201:
			ok++
		case 503:
		default:
			t.Fatalf("create answered %d", c)
		}
	}
	entries, err := st.ListSandboxes(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	per := map[string]int{}
	for _, e := range entries {
		if e.Record.State == store.StateRunning {
			per[e.Record.Route.WorkerID]++
		}
	}
	for w, n := range per {
		if n > capacity {
			t.Fatalf("worker %s over-committed: %d sandboxes, capacity %d", w, n, capacity)
		}
	}
	if ok != capacity*workers {
		t.Fatalf("%d creates succeeded, want %d (every slot, no more)", ok, capacity*workers)
	}
	retries := counter(t, e1.srv.obs.placementRetries) + counter(t, e2.srv.obs.placementRetries)
	t.Logf("%d creates, %d placed, %v placements re-picked", creates, ok, retries)
	for _, n := range nodes {
		if ins, _, _ := n.counts(); ins > capacity {
			t.Fatalf("worker %s got %d installs", n.id, ins)
		}
	}
}

// Replicas starting together on an empty store agree on one key, and
// the bundle holds only it.
func TestReplicasStartTogetherShareOneKey(t *testing.T) {
	st := openStore(t)
	clk := &fakeClock{t: time.Now()}
	es := make([]*env, 3)
	var wg sync.WaitGroup
	for i := range es {
		es[i] = &env{t: t, st: st, dir: t.TempDir(), clock: clk}
		wg.Add(1)
		go func() {
			defer wg.Done()
			srv, err := New(Config{DataDir: es[i].dir, EdgeKey: edgeKey, LeaderTTL: time.Second}, Deps{Store: st, Logger: quiet(), Clock: clk.Now})
			if err != nil {
				t.Error(err)
				return
			}
			es[i].srv = srv
		}()
	}
	wg.Wait()
	for _, e := range es {
		if e.srv != nil {
			t.Cleanup(func() { e.srv.Close() })
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	kid := es[0].srv.KeyID()
	for _, e := range es[1:] {
		if e.srv.KeyID() != kid {
			t.Fatalf("replicas disagree: %s vs %s", e.srv.KeyID(), kid)
		}
	}
	b, _ := st.GetBundle(context.Background())
	if len(b.Keys) != 1 || b.Keys[0].ID != kid {
		t.Fatalf("bundle %+v", b)
	}
	waitFor(t, func() bool { return len(leaders(es...)) == 1 })
}

// A template-file upload link one replica signs is accepted by another,
// and with a shared TemplateFilesDir the files uploaded through one are
// present for a build started through the other. A replica whose files
// directory is its own does not see them (the reason the directory must
// be shared).
func TestReplicasShareTemplateUploads(t *testing.T) {
	st := openStore(t)
	clk := &fakeClock{t: time.Now()}
	shared := t.TempDir()
	r1 := replica(t, st, clk, func(c *Config) { c.TemplateFilesDir = shared })
	r2 := replica(t, st, clk, func(c *Config) { c.TemplateFilesDir = shared })
	r3 := replica(t, st, clk, nil) // files under its own data dir

	r := r1.api("POST", "/v3/templates", map[string]any{"name": "shared-files"})
	var req e2bapi.TemplateRequestResponseV3
	r.decode(t, &req)
	if r.Code != 202 {
		t.Fatalf("request build: %d %s", r.Code, r.Body)
	}
	r = r1.api("GET", "/templates/"+req.TemplateID+"/files/"+filesHash, nil)
	var link e2bapi.TemplateBuildFileUpload
	r.decode(t, &link)
	if r.Code != 201 || link.URL == nil {
		t.Fatalf("upload link: %d %s", r.Code, r.Body)
	}
	u, err := url.Parse(*link.URL)
	if err != nil {
		t.Fatal(err)
	}
	// Signed by r1, uploaded through r2.
	if r := r2.do("PUT", u.RequestURI(), nil, "tar bytes"); r.Code != 200 {
		t.Fatalf("upload through another replica: %d %s", r.Code, r.Body)
	}
	for name, e := range map[string]*env{"r1": r1, "r2": r2} {
		r = e.api("GET", "/templates/"+req.TemplateID+"/files/"+filesHash, nil)
		r.decode(t, &link)
		if !link.Present {
			t.Errorf("%s: files uploaded through r2 not present: %s", name, r.Body)
		}
	}
	r = r3.api("GET", "/templates/"+req.TemplateID+"/files/"+filesHash, nil)
	r.decode(t, &link)
	if link.Present {
		t.Error("a replica with its own files directory sees files it never received")
	}
	// A tampered link is still refused by the other replica.
	bad := strings.Replace(u.RequestURI(), "sig=", "sig=0", 1)
	expectError(t, r2.do("PUT", bad, nil, "data"), 403)
}
