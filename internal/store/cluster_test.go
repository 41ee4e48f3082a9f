package store

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

// openClient opens a second client (another process's view) on s's etcd.
func openClient(t *testing.T, s *Store) *Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Open(ctx, Config{Endpoints: s.Endpoints(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// One leader at a time; a crashed leader (its client gone without
// resigning) is replaced within the TTL; a resigning one at once.
func TestElection(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, bad := range []struct {
		name, id string
		ttl      time.Duration
	}{{"Bad/Name", "a", time.Second}, {"", "a", time.Second}, {"ok", "", time.Second}, {"ok", "a", 500 * time.Millisecond}} {
		if _, err := s.Campaign(ctx, bad.name, bad.id, bad.ttl); !errors.Is(err, errdefs.ErrInvalid) {
			t.Fatalf("campaign %+v: %v", bad, err)
		}
	}
	if _, err := s.Leader(ctx, "cp"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("leader of an empty election: %v", err)
	}
	crashing := openClient(t, s)
	a, err := crashing.Campaign(ctx, "cp", "a", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if id, err := s.Leader(ctx, "cp"); err != nil || id != "a" {
		t.Fatalf("leader %q %v", id, err)
	}
	if err := a.Check(ctx); err != nil {
		t.Fatal(err)
	}
	got := make(chan *Leadership, 1)
	go func() {
		b, err := s.Campaign(ctx, "cp", "b", time.Second)
		if err != nil {
			t.Error(err)
		}
		got <- b
	}()
	select {
	case <-got:
		t.Fatal("two leaders")
	case <-time.After(500 * time.Millisecond):
	}
	// Crash: the client goes away without resigning (the lease is left
	// to expire).
	crashed := time.Now()
	_ = crashing.cli.Close()
	var b *Leadership
	select {
	case b = <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("no takeover after the leader crashed")
	}
	if b == nil {
		t.FailNow()
	}
	// etcd's lease TTL is at least its minimum (the embedded etcd's
	// election timeout based; a few seconds), plus the keep-alive slack.
	if d := time.Since(crashed); d > 8*time.Second {
		t.Fatalf("takeover after %s", d)
	}
	if id, _ := s.Leader(ctx, "cp"); id != "b" {
		t.Fatalf("leader %q, want b", id)
	}
	// A resigning leader is replaced at once.
	go func() {
		c, err := s.Campaign(ctx, "cp", "c", time.Second)
		if err != nil {
			t.Error(err)
		}
		got <- c
	}()
	time.Sleep(100 * time.Millisecond)
	resigned := time.Now()
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-b.Done():
	default:
		t.Fatal("Done not closed after Close")
	}
	c := <-got
	if c == nil {
		t.FailNow()
	}
	defer c.Close()
	if d := time.Since(resigned); d > 2*time.Second {
		t.Fatalf("takeover after resign took %s", d)
	}
	if err := b.Check(ctx); !errors.Is(err, ErrNotLeader) {
		t.Fatalf("old leadership check: %v", err)
	}
	_ = crashing.Close()
}

// Two replicas storing a key at once agree on one; rotations are
// serialised and commit once.
func TestSigningKeyStore(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()
	if _, err := s.GetSigningKey(ctx); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("no key: %v", err)
	}
	if _, _, err := s.InitSigningKey(ctx, SigningKey{ID: "k"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("empty key stored: %v", err)
	}
	var wg sync.WaitGroup
	got := make([]SigningKey, 8)
	won := make([]bool, 8)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			k, ours, err := s.InitSigningKey(ctx, SigningKey{ID: "k" + itoa(i), PKCS8: []byte{byte(i)}})
			if err != nil {
				t.Error(err)
			}
			got[i], won[i] = k, ours
		}()
	}
	wg.Wait()
	winners := 0
	for i := range got {
		if won[i] {
			winners++
		}
		if got[i].ID != got[0].ID {
			t.Fatalf("replicas disagree: %s vs %s", got[i].ID, got[0].ID)
		}
	}
	if winners != 1 {
		t.Fatalf("%d winners", winners)
	}
	watched := make(chan string, 4)
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = s.WatchSigningKey(wctx, func(k SigningKey) { watched <- k.ID })
	}()
	defer func() { cancel(); <-done }()
	if id := <-watched; id != got[0].ID {
		t.Fatalf("watch saw %s", id)
	}

	r := Rotation{Key: SigningKey{ID: "k-new", PKCS8: []byte{9}}, Owner: "cp-a", SignAfter: time.Now()}
	if _, err := s.BeginRotation(ctx, Rotation{Key: r.Key}, 0); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("rotation without owner: %v", err)
	}
	rev, err := s.BeginRotation(ctx, r, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.BeginRotation(ctx, Rotation{Key: SigningKey{ID: "k-other", PKCS8: []byte{1}}, Owner: "cp-b"}, 0); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second rotation: %v", err)
	}
	// Taken over at its revision (its owner died): the old revision is
	// stale for the first owner's commit.
	r2 := r
	r2.Owner = "cp-b"
	rev2, err := s.BeginRotation(ctx, r2, rev)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CommitRotation(ctx, r, rev); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("stale commit: %v", err)
	}
	if err := s.CommitRotation(ctx, r2, rev2); err != nil {
		t.Fatal(err)
	}
	if k, _ := s.GetSigningKey(ctx); k.ID != "k-new" {
		t.Fatalf("current %s", k.ID)
	}
	if _, _, err := s.GetRotation(ctx); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("rotation left: %v", err)
	}
	if err := s.CommitRotation(ctx, r2, rev2); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second commit: %v", err)
	}
	if id := <-watched; id != "k-new" {
		t.Fatalf("watch saw %s", id)
	}
}

// A placement commits only if the worker took no other placement since it
// was read.
func TestPlacementGuard(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()
	_, revs, err := s.PlacementView(ctx)
	if err != nil || len(revs) != 0 {
		t.Fatalf("view %v %v", revs, err)
	}
	a, b := testRecord("placement000000000a"), testRecord("placement000000000b")
	if _, err := s.CreateSandboxPlaced(ctx, a, Placement{WorkerID: "w1", Rev: revs["w1"]}); err != nil {
		t.Fatal(err)
	}
	// b was placed from the same view: refused.
	if _, err := s.CreateSandboxPlaced(ctx, b, Placement{WorkerID: "w1", Rev: revs["w1"]}); !errors.Is(err, ErrPlacementMoved) || !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("stale placement: %v", err)
	}
	if _, _, err := s.GetSandbox(ctx, b.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatal("refused placement wrote its record")
	}
	// Another worker's placement is independent.
	if _, err := s.CreateSandboxPlaced(ctx, b, Placement{WorkerID: "w2", Rev: revs["w2"]}); err != nil {
		t.Fatal(err)
	}
	entries, revs2, err := s.PlacementView(ctx)
	if err != nil || len(entries) != 2 || revs2["w1"] == 0 || revs2["w2"] == 0 {
		t.Fatalf("view %d %v %v", len(entries), revs2, err)
	}
	// A record that exists is a conflict, not a moved placement.
	if _, err := s.CreateSandboxPlaced(ctx, a, Placement{WorkerID: "w1", Rev: revs2["w1"]}); err == nil || errors.Is(err, ErrPlacementMoved) {
		t.Fatalf("duplicate create: %v", err)
	}
	_, rev, _ := s.GetSandbox(ctx, a.ID)
	a.Generation = 2
	a.Route.Generation, a.Route.WorkerID = 2, "w2"
	if _, err := s.UpdateSandboxPlaced(ctx, a.ID, rev, a, Placement{WorkerID: "w2", Rev: revs["w2"]}); !errors.Is(err, ErrPlacementMoved) {
		t.Fatalf("stale update placement: %v", err)
	}
	if _, err := s.UpdateSandboxPlaced(ctx, a.ID, rev+100, a, Placement{WorkerID: "w2", Rev: revs2["w2"]}); !errors.Is(err, errdefs.ErrConflict) || errors.Is(err, ErrPlacementMoved) {
		t.Fatalf("stale record revision: %v", err)
	}
	if _, err := s.UpdateSandboxPlaced(ctx, a.ID, rev, a, Placement{WorkerID: "w2", Rev: revs2["w2"]}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.UpdateSandboxPlaced(ctx, "placement000000000c", 5, testRecord("placement000000000c"), Placement{WorkerID: "w2"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing record: %v", err)
	}
}

// A guard taken at a revision through which a watch delivered everything
// (not the worker's key's own) commits while the worker's key is older,
// and is refused once a placement on the worker committed after it.
func TestPlacementGuardAtViewRevision(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()
	a, b, c := testRecord("placementview00000a"), testRecord("placementview00000b"), testRecord("placementview00000c")
	rev, err := s.CreateSandboxPlaced(ctx, a, Placement{WorkerID: "w1"})
	if err != nil {
		t.Fatal(err)
	}
	// Another worker's placement moves the store's revision, not w1's key.
	viewRev, err := s.CreateSandboxPlaced(ctx, b, Placement{WorkerID: "w2"})
	if err != nil {
		t.Fatal(err)
	}
	if viewRev <= rev {
		t.Fatalf("revisions %d then %d", rev, viewRev)
	}
	if _, err := s.CreateSandboxPlaced(ctx, c, Placement{WorkerID: "w1", Rev: viewRev}); err != nil {
		t.Fatalf("w1's key older than the view's revision: %v", err)
	}
	d := testRecord("placementview00000d")
	if _, err := s.CreateSandboxPlaced(ctx, d, Placement{WorkerID: "w1", Rev: viewRev}); !errors.Is(err, ErrPlacementMoved) {
		t.Fatalf("a placement on w1 after the view's revision: %v", err)
	}
}

// Cluster keys: the first stored wins, later callers get it, bad input
// is refused.
func TestClusterKey(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()
	k1, k2 := []byte("0123456789abcdef-first"), []byte("0123456789abcdef-second")
	got, created, err := s.InitClusterKey(ctx, "links", k1)
	if err != nil || !created || string(got) != string(k1) {
		t.Fatalf("first: %q %v %v", got, created, err)
	}
	got, created, err = s.InitClusterKey(ctx, "links", k2)
	if err != nil || created || string(got) != string(k1) {
		t.Fatalf("second: %q %v %v", got, created, err)
	}
	for _, bad := range []struct {
		name string
		k    []byte
	}{{"", k1}, {"short", []byte("tooshort")}} {
		if _, _, err := s.InitClusterKey(ctx, bad.name, bad.k); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%q: %v", bad.name, err)
		}
	}
}
