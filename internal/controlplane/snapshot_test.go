package controlplane

import (
	"context"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/store"
)

func TestSnapshotsAndCreateFromSnapshot(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	lg := &callLog{}
	n1 := newFakeNode(t, "w1", st)
	attachLife(n1, lg)
	e.register(n1, 10)
	sb := createV2(t, e, map[string]any{"templateID": "base", "envVars": map[string]string{"K": "v"}})
	lg.reset()

	r := e.api("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", map[string]any{"name": "my-snap"})
	if r.Code != 201 {
		t.Fatalf("snapshot: %d %s", r.Code, r.Body)
	}
	var info SnapshotInfo
	r.decode(t, &info)
	if info.SnapshotID == "" || len(info.Names) != 1 || info.Names[0] != DefaultTeamID+"/my-snap" {
		t.Fatalf("snapshot info %+v", info)
	}
	// A running sandbox is paused for the archive and thawed after.
	expectEvents(t, lg.all(), "w1 pause g1", "w1 snapshot g1", "w1 resume g1")
	if rec := e.record(sb.SandboxID); rec.State != store.StateRunning || rec.Route.Generation != 1 {
		t.Fatalf("record %+v", rec)
	}
	expectError(t, e.api("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", map[string]any{"name": "my-snap"}), 409)
	expectError(t, e.api("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", map[string]any{"name": "Bad Name!"}), 400)
	if r := e.api("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", nil); r.Code != 201 {
		t.Fatalf("unnamed snapshot: %d %s", r.Code, r.Body)
	}

	var list []SnapshotInfo
	r = e.api("GET", "/snapshots", nil)
	r.decode(t, &list)
	if r.Code != 200 || len(list) != 2 {
		t.Fatalf("list: %d %s", r.Code, r.Body)
	}
	e.api("GET", "/snapshots?name=my-snap", nil).decode(t, &list)
	if len(list) != 1 || list[0].SnapshotID != info.SnapshotID {
		t.Fatalf("list by name %+v", list)
	}
	e.api("GET", "/snapshots?sandboxID=aaaaaaaaaaaaaaaaaaaa", nil).decode(t, &list)
	if len(list) != 0 {
		t.Fatalf("list by other sandbox %+v", list)
	}
	r = e.api("GET", "/snapshots?limit=1", nil)
	r.decode(t, &list)
	if len(list) != 1 || r.Header.Get("X-Next-Token") == "" {
		t.Fatalf("paged list %+v %v", list, r.Header)
	}
	expectError(t, e.api("GET", "/snapshots?limit=0", nil), 400)
	expectError(t, e.api("GET", "/snapshots?nextToken=../x", nil), 400)

	// Create from the snapshot, by id and by name: the template's sandbox
	// with the files restored.
	for _, ref := range []string{info.SnapshotID, info.SnapshotID + ":default", "my-snap", DefaultTeamID + "/my-snap"} {
		lg.reset()
		c := createV2(t, e, map[string]any{"templateID": ref})
		if c.TemplateID != "base" {
			t.Fatalf("%s: template %q", ref, c.TemplateID)
		}
		n1.mu.Lock()
		inst := n1.installs[len(n1.installs)-1]
		n1.mu.Unlock()
		if inst.RestoreSnapshot != info.SnapshotID || inst.EnvVars["K"] != "v" || inst.Route.SandboxID != c.SandboxID {
			t.Fatalf("%s: install %+v", ref, inst)
		}
	}
	// Another team's key sees none of it.
	other := "e2b_" + strings.Repeat("b", 40)
	if err := st.PutAPIKey(context.Background(), store.HashAPIKey(other), store.APIKeyRecord{TeamID: "other", KeyID: "k2", Role: store.RoleAdmin}); err != nil {
		t.Fatal(err)
	}
	r = e.do("GET", "/snapshots", map[string]string{"X-API-Key": other}, nil)
	r.decode(t, &list)
	if len(list) != 0 {
		t.Fatalf("other team lists %+v", list)
	}
	expectError(t, e.do("POST", "/v2/sandboxes", map[string]string{"X-API-Key": other}, map[string]any{"templateID": info.SnapshotID}), 404)
	expectError(t, e.do("POST", "/sandboxes/"+sb.SandboxID+"/pause", map[string]string{"X-API-Key": other}, nil), 404)
	noTokenErr(t, n1)
}
