package worker

import (
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
