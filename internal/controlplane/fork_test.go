package controlplane

import (
	"context"
	"errors"
	"io/fs"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

func putArchive(t *testing.T, e *env, id string) {
	t.Helper()
	if _, err := e.snaps.Put(context.Background(), id, strings.NewReader("archive of "+id)); err != nil {
		t.Fatal(err)
	}
}

func archiveExists(t *testing.T, e *env, id string) bool {
	t.Helper()
	rc, err := e.snaps.Open(context.Background(), id)
	if err == nil {
		rc.Close()
		return true
	}
	if !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, errdefs.ErrNotFound) && !strings.Contains(err.Error(), "not found") {
		t.Fatalf("open archive %s: %v", id, err)
	}
	return false
}

// A fork snapshots the source in place (paused for the archive, resumed,
// same generation) and creates count sandboxes that restore that snapshot;
// the snapshot is internal and gone afterwards.
func TestForkCreatesSandboxesFromSnapshot(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	lg := &callLog{}
	n1 := newFakeNode(t, "w1", st)
	attachLife(n1, lg)
	e.register(n1, 10)
	src := createV2(t, e, map[string]any{"templateID": "base", "envVars": map[string]string{"K": "v"}, "metadata": map[string]string{"m": "1"}})
	lg.reset()
	n1.mu.Lock()
	before := len(n1.installs)
	n1.mu.Unlock()

	r := e.api("POST", "/sandboxes/"+src.SandboxID+"/fork", map[string]any{"count": 2, "timeout": 60})
	if r.Code != 201 {
		t.Fatalf("fork: %d %s", r.Code, r.Body)
	}
	var res []e2bapi.SandboxForkResult
	r.decode(t, &res)
	if len(res) != 2 {
		t.Fatalf("fork results %s", r.Body)
	}
	expectEvents(t, lg.all(), "w1 pause g1", "w1 snapshot g1", "w1 resume g1",
		"w1 install g1 restore=true published=true", "w1 install g1 restore=true published=true")
	if rec := e.record(src.SandboxID); rec.State != store.StateRunning || rec.Route.Generation != 1 {
		t.Fatalf("source after fork %+v", rec)
	}
	n1.mu.Lock()
	installs := n1.installs[before:]
	n1.mu.Unlock()
	if len(installs) != 2 {
		t.Fatalf("%d installs for 2 forks", len(installs))
	}
	snapID := installs[0].RestoreSnapshot
	for i, f := range res {
		if f.Error != nil || f.Sandbox == nil || f.Sandbox.SandboxID == src.SandboxID || f.Sandbox.EnvdAccessToken == "" {
			t.Fatalf("fork %d: %+v", i, f)
		}
		in := installs[i]
		if in.Route.SandboxID != f.Sandbox.SandboxID || in.RestoreSnapshot == "" || in.RestoreSnapshot != snapID || in.EnvVars["K"] != "v" {
			t.Fatalf("fork %d install %+v", i, in)
		}
		rec := e.record(f.Sandbox.SandboxID)
		if rec.Metadata["m"] != "1" || rec.State != store.StateRunning {
			t.Fatalf("fork %d record %+v", i, rec)
		}
		if d := rec.EndAt.Sub(rec.StartedAt); d < 55*time.Second || d > 65*time.Second {
			t.Fatalf("fork %d timeout %s, want 60s", i, d)
		}
	}
	var list []SnapshotInfo
	e.api("GET", "/snapshots", nil).decode(t, &list)
	if len(list) != 0 {
		t.Fatalf("the fork's snapshot is listed: %+v", list)
	}

	expectError(t, e.api("POST", "/sandboxes/"+src.SandboxID+"/fork", map[string]any{"count": 0}), 400)
	expectError(t, e.api("POST", "/sandboxes/"+src.SandboxID+"/fork", map[string]any{"count": forkMaxCount + 1}), 400)
	expectError(t, e.api("POST", "/sandboxes/"+src.SandboxID+"/fork", map[string]any{"timeout": -1}), 400)
	expectError(t, e.api("POST", "/sandboxes/"+src.SandboxID+"/fork", `{"count": "two"}`), 400)
	expectError(t, e.api("POST", "/sandboxes/aaaaaaaaaaaaaaaaaaaa/fork", nil), 404)
	other := otherTeamKey(t, st)
	expectError(t, e.do("POST", "/sandboxes/"+src.SandboxID+"/fork", map[string]string{"X-API-Key": other}, nil), 404)
}

// A fork that cannot be installed is reported in its own entry.
func TestForkReportsFailedForkPerEntry(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	n1 := newFakeNode(t, "w1", st)
	attachLife(n1, &callLog{})
	e.register(n1, 10)
	src := createV2(t, e, map[string]any{"templateID": "base"})
	n1.mu.Lock()
	n1.failWith = 500
	n1.mu.Unlock()
	r := e.api("POST", "/sandboxes/"+src.SandboxID+"/fork", nil)
	if r.Code != 201 {
		t.Fatalf("fork: %d %s", r.Code, r.Body)
	}
	var res []e2bapi.SandboxForkResult
	r.decode(t, &res)
	if len(res) != 1 || res[0].Sandbox != nil || res[0].Error == nil || res[0].Error.Code < 400 {
		t.Fatalf("fork results %s", r.Body)
	}
	if rec := e.record(src.SandboxID); rec.State != store.StateRunning {
		t.Fatalf("source %+v", rec)
	}
}

func otherTeamKey(t *testing.T, st *store.Store) string {
	t.Helper()
	other := "e2b_" + strings.Repeat("c", 40)
	if err := st.PutAPIKey(context.Background(), store.HashAPIKey(other), store.APIKeyRecord{TeamID: "other", KeyID: "k3", Role: store.RoleAdmin}); err != nil {
		t.Fatal(err)
	}
	return other
}

// deleteSnapshot removes the record (by id or name) and the archive, but
// keeps the archive a paused sandbox still resumes from.
func TestDeleteSnapshot(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	n1 := newFakeNode(t, "w1", st)
	attachLife(n1, &callLog{})
	e.register(n1, 10)
	sb := createV2(t, e, map[string]any{"templateID": "base"})
	var a, b SnapshotInfo
	e.api("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", map[string]any{"name": "snap-a"}).decode(t, &a)
	e.api("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", nil).decode(t, &b)
	if a.SnapshotID == "" || b.SnapshotID == "" {
		t.Fatal("snapshots not created")
	}
	putArchive(t, e, a.SnapshotID)
	putArchive(t, e, b.SnapshotID)

	other := otherTeamKey(t, st)
	expectError(t, e.do("DELETE", "/templates/snap-a", map[string]string{"X-API-Key": other}, nil), 404)
	expectError(t, e.do("DELETE", "/templates/"+a.SnapshotID, map[string]string{"X-API-Key": other}, nil), 404)
	expectError(t, e.api("DELETE", "/templates/base", nil), 400)
	expectError(t, e.do("DELETE", "/templates/snap-a", nil, nil), 401)

	if r := e.api("DELETE", "/templates/snap-a", nil); r.Code != 204 {
		t.Fatalf("delete by name: %d %s", r.Code, r.Body)
	}
	if archiveExists(t, e, a.SnapshotID) {
		t.Fatal("archive of a deleted snapshot still stored")
	}
	expectError(t, e.api("DELETE", "/templates/snap-a", nil), 404)
	expectError(t, e.api("DELETE", "/templates/"+a.SnapshotID, nil), 404)
	expectError(t, e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "snap-a"}), 404)
	if r := e.api("DELETE", "/templates/"+b.SnapshotID, nil); r.Code != 204 {
		t.Fatalf("delete by id: %d %s", r.Code, r.Body)
	}
	var list []SnapshotInfo
	e.api("GET", "/snapshots", nil).decode(t, &list)
	if len(list) != 0 {
		t.Fatalf("listed after delete: %+v", list)
	}

	// A snapshot of a paused sandbox is also what its resume elsewhere
	// restores: the record goes, the archive stays.
	if r := e.api("POST", "/sandboxes/"+sb.SandboxID+"/pause", nil); r.Code != 204 {
		t.Fatalf("pause: %d %s", r.Code, r.Body)
	}
	var c SnapshotInfo
	e.api("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", nil).decode(t, &c)
	if rec := e.record(sb.SandboxID); rec.PausedSnapshot != c.SnapshotID {
		t.Fatalf("paused snapshot %q, want %q", rec.PausedSnapshot, c.SnapshotID)
	}
	putArchive(t, e, c.SnapshotID)
	if r := e.api("DELETE", "/templates/"+c.SnapshotID, nil); r.Code != 204 {
		t.Fatalf("delete: %d %s", r.Code, r.Body)
	}
	if !archiveExists(t, e, c.SnapshotID) {
		t.Fatal("archive a paused sandbox resumes from was removed")
	}
}

// updateNetwork: valid policies (closing or opening egress) are accepted
// and pushed to the worker; malformed ones are refused as invalid.
func TestUpdateNetwork(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	n1 := newFakeNode(t, "w1", st)
	e.register(n1, 10)
	sb := createV2(t, e, map[string]any{"templateID": "base"})
	path := "/sandboxes/" + sb.SandboxID + "/network"
	for _, body := range []any{
		map[string]any{"denyOut": []string{"0.0.0.0/0"}},
		map[string]any{"allow_internet_access": false},
		map[string]any{},
		map[string]any{"allowOut": []string{"8.8.8.8"}},
		map[string]any{"allow_internet_access": true},
	} {
		if r := e.api("PUT", path, body); r.Code != 204 {
			t.Fatalf("%v: %d %s", body, r.Code, r.Body)
		}
	}
	n1.mu.Lock()
	pushed := len(n1.networks)
	n1.mu.Unlock()
	if pushed != 5 {
		t.Fatalf("worker got %d network updates, want 5", pushed)
	}
	for _, body := range []any{
		map[string]any{"egressProxy": map[string]any{"url": "http://proxy"}},
		`{"allowOut": "x"}`,
		`not json`,
	} {
		expectError(t, e.api("PUT", path, body), 400)
	}
	expectError(t, e.api("PUT", "/sandboxes/aaaaaaaaaaaaaaaaaaaa/network", map[string]any{}), 404)
	expectError(t, e.do("PUT", path, map[string]string{"X-API-Key": otherTeamKey(t, st)}, map[string]any{}), 404)
}
