package store

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func openTest(t *testing.T, dir string) *Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s, err := Open(ctx, Config{DataDir: dir, Logger: quietLogger()})
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	return s
}

func testRecord(id string) SandboxRecord {
	now := time.Now().UTC()
	return SandboxRecord{
		ID: id, TeamID: "team-a", TemplateID: "base", State: StateRunning, Generation: 1,
		Route: identity.Route{SandboxID: id, Generation: 1, ExecutionID: "e1", WorkerID: "w1",
			Substrate: identity.SubstrateNS, ActivationID: "a1"},
		CreatedAt: now, StartedAt: now, EndAt: now.Add(time.Minute),
	}
}

func TestConfigValidate(t *testing.T) {
	if err := (Config{}).Validate(); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("empty config: %v", err)
	}
	if err := (Config{DataDir: "x", ClientURL: "ftp://x"}).Validate(); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad url: %v", err)
	}
	if err := (Config{Endpoints: []string{"http://127.0.0.1:1"}}).Validate(); err != nil {
		t.Fatal(err)
	}
}

// One embedded etcd for most tests keeps the suite fast on a small machine.
func TestStore(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	}()
	t.Run("SandboxCRUD", func(t *testing.T) { testSandboxCRUD(t, s) })
	t.Run("CASConcurrentGenerationBump", func(t *testing.T) { testCAS(t, s) })
	t.Run("WorkerLeaseExpiry", func(t *testing.T) { testWorkerLease(t, s) })
	t.Run("BundleWatch", func(t *testing.T) { testBundleWatch(t, s) })
	t.Run("APIKeys", func(t *testing.T) { testAPIKeys(t, s) })
	t.Run("WatchSandboxes", func(t *testing.T) { testWatchSandboxes(t, s) })
}

func testSandboxCRUD(t *testing.T, s *Store) {
	ctx := context.Background()
	rec := testRecord("crud1")
	rec.AccessToken = "secret-token"
	rev, err := s.CreateSandbox(ctx, rec)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.CreateSandbox(ctx, rec); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second create: %v, want errdefs.ErrConflict", err)
	}
	got, grev, err := s.GetSandbox(ctx, "crud1")
	if err != nil || grev != rev || got.AccessToken != "secret-token" || got.Route != rec.Route {
		t.Fatalf("get: %+v rev %d/%d err %v", got, grev, rev, err)
	}
	if _, _, err := s.GetSandbox(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("get missing: %v", err)
	}
	if _, _, err := s.GetSandbox(ctx, "Bad/ID"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("get bad id: %v", err)
	}
	got.State = StateKilled
	nrev, err := s.UpdateSandbox(ctx, "crud1", rev, got)
	if err != nil || nrev <= rev {
		t.Fatalf("update: %d %v", nrev, err)
	}
	if _, err := s.UpdateSandbox(ctx, "crud1", rev, got); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("stale update: %v", err)
	}
	if _, err := s.UpdateSandbox(ctx, "ghost", 5, testRecord("ghost")); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("update missing: %v", err)
	}
	bad := got
	bad.State = "weird"
	if _, err := s.UpdateSandbox(ctx, "crud1", nrev, bad); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("invalid update: %v", err)
	}
	list, err := s.ListSandboxes(ctx)
	if err != nil || len(list) == 0 {
		t.Fatalf("list: %v %v", list, err)
	}
	if err := s.DeleteSandbox(ctx, "crud1", rev); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("conditional delete with stale rev: %v", err)
	}
	if err := s.DeleteSandbox(ctx, "crud1", nrev); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteSandbox(ctx, "crud1", 0); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("delete missing: %v", err)
	}
}

// Two operations read generation N and both try to write N+1: exactly one
// wins, the other sees errdefs.ErrConflict.
func testCAS(t *testing.T, s *Store) {
	ctx := context.Background()
	rec := testRecord("cas1")
	rev, err := s.CreateSandbox(ctx, rec)
	if err != nil {
		t.Fatal(err)
	}
	for round := 0; round < 10; round++ {
		cur, rev, err := s.GetSandbox(ctx, "cas1")
		if err != nil {
			t.Fatal(err)
		}
		const n = 4
		var wins, conflicts atomic.Int32
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				next := cur
				next.Generation++
				next.Route.Generation = next.Generation
				next.Route.ExecutionID = "e" + string(rune('a'+i))
				<-start
				_, err := s.UpdateSandbox(ctx, "cas1", rev, next)
				switch {
				case err == nil:
					wins.Add(1)
				case errors.Is(err, errdefs.ErrConflict):
					conflicts.Add(1)
				default:
					t.Errorf("update: %v", err)
				}
			}(i)
		}
		close(start)
		wg.Wait()
		if wins.Load() != 1 || conflicts.Load() != n-1 {
			t.Fatalf("round %d: %d wins, %d conflicts", round, wins.Load(), conflicts.Load())
		}
		after, _, _ := s.GetSandbox(ctx, "cas1")
		if after.Generation != cur.Generation+1 {
			t.Fatalf("generation %d, want %d", after.Generation, cur.Generation+1)
		}
	}
	_ = rev
	// MutateSandbox retries: concurrent increments all land.
	var wg sync.WaitGroup
	before, _, _ := s.GetSandbox(ctx, "cas1")
	for i := 0; i < 3; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, _, err := s.MutateSandbox(ctx, "cas1", func(r *SandboxRecord) error {
				r.Generation++
				return nil
			}); err != nil {
				t.Errorf("mutate: %v", err)
			}
		}()
	}
	wg.Wait()
	after, _, _ := s.GetSandbox(ctx, "cas1")
	if after.Generation != before.Generation+3 {
		t.Fatalf("mutate: generation %d want %d", after.Generation, before.Generation+3)
	}
}

func testWorkerLease(t *testing.T, s *Store) {
	ctx := context.Background()
	if _, err := s.RegisterWorker(ctx, spacev1.Worker{ID: "a/b", NodeURL: "http://x"}, 2*time.Second); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad id: %v", err)
	}
	live, err := s.RegisterWorker(ctx, spacev1.Worker{ID: "w-live", NodeURL: "http://127.0.0.1:1", State: "ready", Capacity: 4}, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	dead, err := s.RegisterWorker(ctx, spacev1.Worker{ID: "w-dead", NodeURL: "http://127.0.0.1:2", State: "ready", Capacity: 4}, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	ws, err := s.ListWorkers(ctx)
	if err != nil || len(ws) != 2 || ws[0].ID != "w-dead" || ws[0].Since.IsZero() {
		t.Fatalf("list: %+v %v", ws, err)
	}
	if err := live.Update(ctx, spacev1.Worker{ID: "w-live", NodeURL: "http://127.0.0.1:1", State: "ready", Capacity: 4, Load: 3}); err != nil {
		t.Fatal(err)
	}
	// The dead worker stops renewing: etcd expires its lease.
	dead.abandon()
	deadline := time.Now().Add(15 * time.Second)
	for {
		ws, err = s.ListWorkers(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(ws) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dead worker still listed: %+v", ws)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if ws[0].ID != "w-live" || ws[0].Load != 3 {
		t.Fatalf("live worker: %+v", ws[0])
	}
	// Still there well past its TTL: the keep-alive works.
	time.Sleep(2500 * time.Millisecond)
	if w, err := s.GetWorker(ctx, "w-live"); err != nil || w.Load != 3 {
		t.Fatalf("live worker after ttl: %+v %v", w, err)
	}
	if err := live.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetWorker(ctx, "w-live"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("closed registration still listed: %v", err)
	}
}

func newKey(t *testing.T, id string) capability.Key {
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return capability.Key{ID: id, Public: pub}
}

func testBundleWatch(t *testing.T, s *Store) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := s.GetBundle(ctx); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("no bundle yet: %v", err)
	}
	got := make(chan capability.Bundle, 16)
	done := make(chan error, 1)
	go func() { done <- s.WatchBundle(ctx, func(b capability.Bundle) { got <- b }) }()

	k1 := newKey(t, "k1")
	if err := s.PutBundle(ctx, capability.Bundle{Revision: 1, Keys: []capability.Key{k1}}); err != nil {
		t.Fatal(err)
	}
	expect := func(rev int64, nkeys int) {
		t.Helper()
		select {
		case b := <-got:
			if b.Revision != rev || len(b.Keys) != nkeys {
				t.Fatalf("got bundle rev %d with %d keys, want %d/%d", b.Revision, len(b.Keys), rev, nkeys)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("no bundle revision %d delivered", rev)
		}
	}
	expect(1, 1)
	if err := s.PutBundle(ctx, capability.Bundle{Revision: 1, Keys: []capability.Key{k1}}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("same revision: %v", err)
	}
	if err := s.PutBundle(ctx, capability.Bundle{Revision: 2, Keys: []capability.Key{k1, k1}}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("duplicate keys: %v", err)
	}
	b, err := s.UpdateBundle(ctx, func(cur capability.Bundle, found bool) (capability.Bundle, bool, error) {
		if !found {
			t.Error("bundle not found")
		}
		cur.Keys = append(cur.Keys, newKey(t, "k2"))
		return cur, true, nil
	})
	if err != nil || b.Revision != 2 {
		t.Fatalf("update: %+v %v", b, err)
	}
	expect(2, 2)
	// No change: nothing written.
	if _, err := s.UpdateBundle(ctx, func(cur capability.Bundle, _ bool) (capability.Bundle, bool, error) {
		return cur, false, nil
	}); err != nil {
		t.Fatal(err)
	}
	// A late watcher gets the current bundle first.
	got2 := make(chan capability.Bundle, 1)
	ctx2, cancel2 := context.WithCancel(ctx)
	done2 := make(chan error, 1)
	go func() { done2 <- s.WatchBundle(ctx2, func(b capability.Bundle) { got2 <- b; cancel2() }) }()
	select {
	case b := <-got2:
		if b.Revision != 2 {
			t.Fatalf("late watcher got %d", b.Revision)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("late watcher got nothing")
	}
	if err := <-done2; !errors.Is(err, context.Canceled) {
		t.Fatalf("watch returned %v", err)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("watch returned %v", err)
	}
	select {
	case b := <-got:
		t.Fatalf("unexpected bundle %d", b.Revision)
	default:
	}
}

func testAPIKeys(t *testing.T, s *Store) {
	ctx := context.Background()
	h := HashAPIKey("e2b_secret")
	if _, err := s.LookupAPIKey(ctx, h); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing: %v", err)
	}
	if err := s.PutAPIKey(ctx, "nothex", APIKeyRecord{TeamID: "t", KeyID: "k", Role: RoleUser}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad hash: %v", err)
	}
	if err := s.PutAPIKey(ctx, h, APIKeyRecord{TeamID: "t", KeyID: "k", Role: "root"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad role: %v", err)
	}
	if err := s.PutAPIKey(ctx, h, APIKeyRecord{TeamID: "t", KeyID: "k", Role: RoleUser}); err != nil {
		t.Fatal(err)
	}
	rec, err := s.LookupAPIKey(ctx, h)
	if err != nil || rec.TeamID != "t" {
		t.Fatalf("lookup: %+v %v", rec, err)
	}
	if _, err := s.LookupAPIKey(ctx, "zz"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("malformed hash: %v", err)
	}
	if err := s.DeleteAPIKey(ctx, h); err != nil {
		t.Fatal(err)
	}
}

func testWatchSandboxes(t *testing.T, s *Store) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := s.CreateSandbox(ctx, testRecord("watch1")); err != nil {
		t.Fatal(err)
	}
	evs := make(chan SandboxEvent, 64)
	done := make(chan error, 1)
	go func() { done <- s.WatchSandboxes(ctx, func(e SandboxEvent) { evs <- e }) }()
	waitFor := func(pred func(SandboxEvent) bool) {
		t.Helper()
		for {
			select {
			case e := <-evs:
				if pred(e) {
					return
				}
			case <-time.After(10 * time.Second):
				t.Fatal("event not delivered")
			}
		}
	}
	waitFor(func(e SandboxEvent) bool { return e.Record.ID == "watch1" && !e.Deleted })
	if _, _, err := s.MutateSandbox(ctx, "watch1", func(r *SandboxRecord) error { r.State = StateKilled; return nil }); err != nil {
		t.Fatal(err)
	}
	waitFor(func(e SandboxEvent) bool { return e.Record.ID == "watch1" && e.Record.State == StateKilled })
	if err := s.DeleteSandbox(ctx, "watch1", 0); err != nil {
		t.Fatal(err)
	}
	waitFor(func(e SandboxEvent) bool { return e.Record.ID == "watch1" && e.Deleted })
	cancel()
	<-done
}

// Restart: state survives closing and reopening the embedded etcd.
func TestReopenKeepsState(t *testing.T) {
	dir := t.TempDir()
	s := openTest(t, dir)
	if _, err := s.CreateSandbox(context.Background(), testRecord("persist1")); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s = openTest(t, dir)
	defer s.Close()
	if _, _, err := s.GetSandbox(context.Background(), "persist1"); err != nil {
		t.Fatalf("after reopen: %v", err)
	}
}

func TestOpenExternalUnreachable(t *testing.T) {
	p, err := FreePort()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = Open(ctx, Config{Endpoints: []string{"http://127.0.0.1:" + itoa(p)}, DialTimeout: 500 * time.Millisecond, Logger: quietLogger()})
	if err == nil {
		t.Fatal("open of unreachable etcd succeeded")
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

// A closed store is unavailable to the API edges; its text stays.
func TestClosedIsUnavailable(t *testing.T) {
	if err := wrapErr("get", clientv3.ErrNoAvailableEndpoints); !errors.Is(err, ErrClosed) || !errors.Is(err, errdefs.ErrUnavailable) ||
		!strings.Contains(err.Error(), "store closed") {
		t.Fatalf("%v", err)
	}
}

// A port found free can be taken before etcd binds it (another test
// process): the embedded start chooses again instead of failing.
func TestEmbeddedPortTakenIsChosenAgain(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	calls := 0
	freePort = func() (int, error) {
		calls++
		if calls == 1 {
			return taken.Addr().(*net.TCPAddr).Port, nil // taken "a moment later"
		}
		return FreePort()
	}
	defer func() { freePort = FreePort }()
	s := openTest(t, t.TempDir())
	defer s.Close()
	if calls < 3 {
		t.Fatalf("free port asked %d times; the taken one was not replaced", calls)
	}
	if _, err := s.CreateSandbox(context.Background(), testRecord("porttaken1")); err != nil {
		t.Fatal(err)
	}
}
