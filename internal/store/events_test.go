package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
)

func testEvent(team, sbx, typ string, seq string) EventRecord {
	return EventRecord{Seq: seq, Event: e2bapi.SandboxEvent{Version: "v2", ID: "id-" + seq, Type: typ, SandboxID: sbx, SandboxTeamID: team,
		EventData: json.RawMessage(`{}`), Timestamp: time.Now().UTC()}}
}

// Only the current leader's writes land; a second campaigner takes over
// once the first resigns, and the first's writes then fail.
func TestEventsLeadershipGuardsWrites(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a, err := s.CampaignEvents(ctx, "a", 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CommitEvents(ctx, a, EventCommit{Cursor: 7, SandboxID: "sbx-1", Observed: []byte(`{"s":"running"}`),
		Events: []EventRecord{testEvent("team-a", "sbx-1", e2bapi.EventCreated, EventSeq(time.Now(), 7, 0))}}); err != nil {
		t.Fatal(err)
	}
	got := make(chan *Leadership, 1)
	go func() {
		b, err := s.CampaignEvents(ctx, "b", 2*time.Second)
		if err != nil {
			t.Error(err)
		}
		got <- b
	}()
	select {
	case <-got:
		t.Fatal("second campaigner leads while the first does")
	case <-time.After(300 * time.Millisecond):
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	b := <-got
	if b == nil {
		t.FailNow()
	}
	defer b.Close()
	if err := s.CommitEvents(ctx, a, EventCommit{Cursor: 8}); !errors.Is(err, ErrNotLeader) || !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("old leader's write: %v", err)
	}
	st, err := s.LoadEventState(ctx)
	if err != nil || st.Cursor != 7 || string(st.Observed["sbx-1"]) != `{"s":"running"}` {
		t.Fatalf("state %+v %v", st, err)
	}
	if err := s.CommitEvents(ctx, b, EventCommit{SandboxID: "sbx-1", Forget: true}); err != nil {
		t.Fatal(err)
	}
	if st, _ := s.LoadEventState(ctx); len(st.Observed) != 0 {
		t.Fatalf("forgotten digest still there: %v", st.Observed)
	}
}

func TestListEventsPagingAndScope(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()
	l, err := s.CampaignEvents(ctx, "a", 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	base := time.Now()
	for i := range 5 {
		sbx := "sbx-1"
		if i%2 == 1 {
			sbx = "sbx-2"
		}
		ev := testEvent("team-a", sbx, e2bapi.EventTypes[i%len(e2bapi.EventTypes)], EventSeq(base.Add(time.Duration(i)*time.Millisecond), int64(10+i), 0))
		if err := s.CommitEvents(ctx, l, EventCommit{Events: []EventRecord{ev}}); err != nil {
			t.Fatal(err)
		}
	}
	all, err := s.ListEvents(ctx, EventQuery{TeamID: "team-a", Limit: 100, Asc: true})
	if err != nil || len(all) != 5 || all[0].Seq > all[4].Seq || all[0].Event.ID != "id-"+all[0].Seq {
		t.Fatalf("all: %d %v", len(all), err)
	}
	page, _ := s.ListEvents(ctx, EventQuery{TeamID: "team-a", Offset: 1, Limit: 2})
	if len(page) != 2 || page[0].Seq != all[3].Seq || page[1].Seq != all[2].Seq {
		t.Fatalf("desc page: %+v", page)
	}
	one, _ := s.ListEvents(ctx, EventQuery{TeamID: "team-a", SandboxID: "sbx-2", Limit: 10, Asc: true})
	if len(one) != 2 || one[0].Event.SandboxID != "sbx-2" {
		t.Fatalf("sandbox: %+v", one)
	}
	if none, _ := s.ListEvents(ctx, EventQuery{TeamID: "team-b", SandboxID: "sbx-2", Limit: 10}); len(none) != 0 {
		t.Fatalf("other team: %d", len(none))
	}
	if past, _ := s.ListEvents(ctx, EventQuery{TeamID: "team-a", Offset: 50, Limit: 10}); len(past) != 0 {
		t.Fatalf("past the end: %d", len(past))
	}
	// A type filter reads page after page (two events a page here).
	defer func(p int64) { eventPage = p }(eventPage)
	eventPage = 2
	for _, asc := range []bool{true, false} {
		var want []string
		for _, e := range all {
			if e.Event.Type == all[0].Event.Type || e.Event.Type == all[3].Event.Type {
				want = append(want, e.Seq)
			}
		}
		if !asc {
			slices.Reverse(want)
		}
		got, err := s.ListEvents(ctx, EventQuery{TeamID: "team-a", Limit: 100, Asc: asc, Types: []string{all[0].Event.Type, all[3].Event.Type}})
		var seqs []string
		for _, e := range got {
			seqs = append(seqs, e.Seq)
		}
		if err != nil || fmt.Sprint(seqs) != fmt.Sprint(want) {
			t.Fatalf("asc %t: filtered %v, want %v (%v)", asc, seqs, want, err)
		}
		got, _ = s.ListEvents(ctx, EventQuery{TeamID: "team-a", Offset: 1, Limit: 1, Asc: asc, Types: []string{all[0].Event.Type, all[3].Event.Type}})
		if len(got) != 1 || got[0].Seq != want[1] {
			t.Fatalf("asc %t: filtered page %+v, want %s", asc, got, want[1])
		}
	}
	eventPage = 500
	for _, q := range []EventQuery{{TeamID: "", Limit: 1}, {TeamID: "a/b", Limit: 1}, {TeamID: "t", Limit: 0}, {TeamID: "t", Offset: -1, Limit: 1},
		{TeamID: "t", SandboxID: "../x", Limit: 1}} {
		if _, err := s.ListEvents(ctx, q); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%+v: %v", q, err)
		}
	}
	if err := s.CommitEvents(ctx, l, EventCommit{Events: []EventRecord{testEvent("bad/team", "sbx-1", e2bapi.EventCreated, "x")}}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad team: %v", err)
	}
	// Pruning by age and by count, in both indexes.
	n, err := s.PruneEvents(ctx, l, base.Add(2*time.Millisecond), 0)
	if err != nil || n != 2 {
		t.Fatalf("pruned %d, %v", n, err)
	}
	if n, _ = s.PruneEvents(ctx, l, base, 1); n != 2 {
		t.Fatalf("pruned by count %d", n)
	}
	left, _ := s.ListEvents(ctx, EventQuery{TeamID: "team-a", Limit: 100})
	s1, _ := s.ListEvents(ctx, EventQuery{TeamID: "team-a", SandboxID: "sbx-1", Limit: 100})
	s2, _ := s.ListEvents(ctx, EventQuery{TeamID: "team-a", SandboxID: "sbx-2", Limit: 100})
	if len(left) != 1 || left[0].Seq != all[4].Seq || len(s1)+len(s2) != 1 {
		t.Fatalf("left %d (%d+%d in the sandbox index)", len(left), len(s1), len(s2))
	}
}

func TestWebhooksAndDeliveries(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()
	l, err := s.CampaignEvents(ctx, "a", 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	w := WebhookRecord{ID: "h1", TeamID: "team-a", Name: "n", URL: "https://example.com", Enabled: true, Events: []string{e2bapi.EventCreated},
		Secret: "topsecret", CreatedAt: time.Now().UTC()}
	if err := s.CreateWebhook(ctx, w, 2); err != nil {
		t.Fatal(err)
	}
	if err := s.CreateWebhook(ctx, w, 2); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("duplicate: %v", err)
	}
	w2 := w
	w2.ID = "h2"
	if err := s.CreateWebhook(ctx, w2, 2); err != nil {
		t.Fatal(err)
	}
	w3 := w
	w3.ID = "h3"
	if err := s.CreateWebhook(ctx, w3, 2); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("past the team bound: %v", err)
	}
	if _, _, err := s.GetWebhook(ctx, "team-b", "h1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("other team's get: %v", err)
	}
	if err := s.DeleteWebhook(ctx, "team-b", "h1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("other team's delete: %v", err)
	}
	if _, err := s.UpdateWebhook(ctx, "team-b", "h1", func(*WebhookRecord) error { return nil }); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("other team's update: %v", err)
	}
	w.URL = "https://example.com/hook?token=tok123"
	if got := fmt.Sprint(w.LogValue()); got == "" || strings.Contains(got, "topsecret") || strings.Contains(got, "tok123") {
		t.Fatalf("log value %q", got)
	}
	upd, err := s.UpdateWebhook(ctx, "team-a", "h1", func(r *WebhookRecord) error { r.Name = "renamed"; r.ID = "hijack"; r.TeamID = "team-b"; return nil })
	if err != nil || upd.Name != "renamed" || upd.ID != "h1" || upd.TeamID != "team-a" {
		t.Fatalf("update %+v %v", upd, err)
	}

	// Deliveries: retried, then done; another given up; counters follow.
	mk := func(seq string) DeliveryRecord {
		return DeliveryRecord{ID: "d-" + seq, WebhookID: "h1", TeamID: "team-a", Seq: seq, EventID: "e-" + seq, EventType: e2bapi.EventCreated,
			Body: json.RawMessage(`{"x":1}`), State: DeliveryPending, CreatedAt: time.Now().UTC()}
	}
	if err := s.CommitEvents(ctx, l, EventCommit{Deliveries: []DeliveryRecord{mk("0001"), mk("0002")}}); err != nil {
		t.Fatal(err)
	}
	p, _ := s.PendingDeliveries(ctx)
	if len(p) != 2 || p[0].Seq != "0001" {
		t.Fatalf("pending %+v", p)
	}
	d := p[0]
	d.Attempts, d.LastError, d.NextAt = 1, "status 500", time.Now().Add(time.Minute)
	if err := s.RecordAttempt(ctx, l, d, DeliveryRetry, 500, time.Now()); err != nil {
		t.Fatal(err)
	}
	d.Attempts, d.LastError = 2, ""
	if err := s.RecordAttempt(ctx, l, d, DeliveryDone, 200, time.Now()); err != nil {
		t.Fatal(err)
	}
	if err := s.RecordAttempt(ctx, l, d, DeliveryDone, 200, time.Now()); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("second completion: %v", err)
	}
	g := p[1]
	g.Attempts, g.LastError = 8, "post: connection refused"
	if err := s.RecordAttempt(ctx, l, g, DeliveryGiveUp, 0, time.Now()); err != nil {
		t.Fatal(err)
	}
	st, pending, failed, err := s.WebhookDeliveries(ctx, "h1")
	if err != nil || pending != 0 || st.Delivered != 1 || st.Failed != 1 || len(failed) != 1 || failed[0].ID != "d-0002" || st.LastError != g.LastError {
		t.Fatalf("status %+v pending %d failed %+v %v", st, pending, failed, err)
	}
	// Deleting the webhook takes its deliveries and status along.
	if err := s.CommitEvents(ctx, l, EventCommit{Deliveries: []DeliveryRecord{mk("0003")}}); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteWebhook(ctx, "team-a", "h1"); err != nil {
		t.Fatal(err)
	}
	if p, _ := s.PendingDeliveries(ctx); len(p) != 0 {
		t.Fatalf("deliveries of a deleted webhook: %+v", p)
	}
	if st, _, failed, _ := s.WebhookDeliveries(ctx, "h1"); st.Delivered != 0 || len(failed) != 0 {
		t.Fatalf("status of a deleted webhook: %+v", st)
	}
	if err := s.CommitEvents(ctx, l, EventCommit{Deliveries: []DeliveryRecord{{ID: "x", WebhookID: "a/b", Seq: "1"}}}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad delivery: %v", err)
	}
}

// The recorder's watch resumes after a cursor, and says so when that
// history is compacted away.
func TestWatchSandboxesFrom(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	rev1, err := s.CreateSandbox(ctx, testRecord("sbx-w1"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.CreateSandbox(ctx, testRecord("sbx-w2")); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteSandbox(ctx, "sbx-w1", 0); err != nil {
		t.Fatal(err)
	}
	var seen []string
	wctx, wcancel := context.WithCancel(ctx)
	err = s.WatchSandboxesFrom(wctx, rev1, func(c SandboxChange) error {
		seen = append(seen, fmt.Sprintf("%s:%t", c.ID, c.Record != nil))
		if len(seen) == 2 {
			wcancel()
		}
		return nil
	})
	wcancel()
	if !errors.Is(err, context.Canceled) || fmt.Sprint(seen) != "[sbx-w2:true sbx-w1:false]" {
		t.Fatalf("seen %v, err %v", seen, err)
	}
	_, rev, err := s.ListSandboxesAt(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.cli.Compact(ctx, rev); err != nil {
		t.Fatal(err)
	}
	err = s.WatchSandboxesFrom(ctx, rev1, func(SandboxChange) error { return nil })
	if !errors.Is(err, ErrCompacted) {
		t.Fatalf("compacted history: %v", err)
	}
}
