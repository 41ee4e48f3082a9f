package worker

import (
	"log/slog"
	"testing"

	"github.com/spacesbx/space/internal/identity"
)

func rt(gen uint64, exec, worker string) identity.Route {
	return identity.Route{SandboxID: "sbx", Generation: gen, ExecutionID: exec, WorkerID: worker, Substrate: "ns", ActivationID: "a"}
}

func TestSupersedes(t *testing.T) {
	in7 := identity.Record{Route: rt(7, "e7", "wa")}
	cases := []struct {
		name      string
		ev        SandboxEvent
		installed identity.Record
		want      bool
	}{
		{"route moved to 8 elsewhere", SandboxEvent{SandboxID: "sbx", Route: rt(8, "e8", "wb")}, in7, true},
		{"route moved to 8 here (installed 7 left behind)", SandboxEvent{SandboxID: "sbx", Route: rt(8, "e8", "wa")}, in7, true},
		{"route still names ours", SandboxEvent{SandboxID: "sbx", Route: rt(7, "e7", "wa")}, in7, false},
		{"same route, other activation attempt", SandboxEvent{SandboxID: "sbx", Route: func() identity.Route { r := rt(7, "e7", "wa"); r.ActivationID = "b"; return r }()}, in7, false},
		{"same generation, other execution", SandboxEvent{SandboxID: "sbx", Route: rt(7, "x", "wb")}, in7, true},
		{"delayed event for an older generation", SandboxEvent{SandboxID: "sbx", Route: rt(6, "e6", "wb")}, in7, false},
		{"record lags our install (not yet published)", SandboxEvent{SandboxID: "sbx", Route: rt(6, "e6", "wa")}, in7, false},
		{"no route published yet", SandboxEvent{SandboxID: "sbx"}, in7, false},
		{"killed at our generation", SandboxEvent{SandboxID: "sbx", Ended: true, Route: rt(7, "e7", "wa")}, in7, true},
		{"killed before any route", SandboxEvent{SandboxID: "sbx", Ended: true}, in7, true},
		{"killed at an older generation than ours", SandboxEvent{SandboxID: "sbx", Ended: true, Route: rt(6, "e6", "wb")}, in7, false},
		{"deleted", SandboxEvent{SandboxID: "sbx", Deleted: true}, in7, true},
		{"already retired", SandboxEvent{SandboxID: "sbx", Route: rt(8, "e8", "wb")}, identity.Record{Route: rt(7, "e7", "wa"), Retired: true}, false},
		{"other sandbox", SandboxEvent{SandboxID: "other", Deleted: true}, in7, false},
	}
	for _, c := range cases {
		if got := supersedes(c.ev, c.installed); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

// TestAbandoned: an execution re-adopted at start above the published
// generation is retired once an event shows no operation installing it,
// and never while one does or for an install made since the start.
func TestAbandoned(t *testing.T) {
	in7 := identity.Record{Route: rt(7, "e7", "wa")}
	cases := []struct {
		name      string
		atStart   bool
		ev        SandboxEvent
		installed identity.Record
		want      bool
	}{
		{"move given up while the worker was down", true, SandboxEvent{SandboxID: "sbx", Route: rt(6, "e6", "wb")}, in7, true},
		{"move still installing it", true, SandboxEvent{SandboxID: "sbx", Route: rt(6, "e6", "wb"), Pending: rt(7, "e7", "wa")}, in7, false},
		{"another pending execution", true, SandboxEvent{SandboxID: "sbx", Route: rt(6, "e6", "wb"), Pending: rt(7, "x", "wc")}, in7, true},
		{"published", true, SandboxEvent{SandboxID: "sbx", Route: rt(7, "e7", "wa")}, in7, false},
		{"installed since the start (not judged)", false, SandboxEvent{SandboxID: "sbx", Route: rt(6, "e6", "wb")}, in7, false},
		{"a newer install than the one at start", true, SandboxEvent{SandboxID: "sbx", Route: rt(6, "e6", "wb")}, identity.Record{Route: rt(8, "e8", "wa")}, false},
	}
	for _, c := range cases {
		r := &retirer{w: &Worker{log: slog.New(slog.DiscardHandler)}, unconfirmed: map[string]identity.Record{}}
		if c.atStart {
			r.unconfirmed["sbx"] = in7
		}
		if got := r.abandoned(c.ev, c.installed); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
	// Once published, a later lagging event no longer retires it.
	r := &retirer{w: &Worker{log: slog.New(slog.DiscardHandler)}, unconfirmed: map[string]identity.Record{"sbx": in7}}
	r.abandoned(SandboxEvent{SandboxID: "sbx", Route: rt(7, "e7", "wa")}, in7)
	if r.abandoned(SandboxEvent{SandboxID: "sbx", Route: rt(6, "e6", "wb")}, in7) {
		t.Error("a published execution was judged abandoned by a later lagging event")
	}
}
