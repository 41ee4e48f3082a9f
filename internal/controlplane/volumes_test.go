package controlplane

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/internal/volume"
)

func createVolume(t *testing.T, e *env, name string) volumeInfo {
	t.Helper()
	r := e.api("POST", "/volumes", map[string]any{"name": name})
	if r.Code != 201 {
		t.Fatalf("create volume: %d %s", r.Code, r.Body)
	}
	var v volumeInfo
	r.decode(t, &v)
	if !strings.HasPrefix(v.VolumeID, "vol_") || v.Name != name || len(v.Token) != 64 || v.Domain == "" {
		t.Fatalf("create volume answer %+v", v)
	}
	return v
}

// The management API as the e2b SDK drives it: create, get (by id and by
// name), list, unique names, delete; bad names refused.
func TestVolumeAPI(t *testing.T) {
	e := newEnv(t, openStore(t), nil)
	v := createVolume(t, e, "data")
	expectError(t, e.api("POST", "/volumes", map[string]any{"name": "data"}), 409)
	for _, bad := range []string{"", "a/b", "../x", "-x", strings.Repeat("a", 200)} {
		expectError(t, e.api("POST", "/volumes", map[string]any{"name": bad}), 400)
	}
	for _, key := range []string{v.VolumeID, "data"} {
		var got volumeInfo
		r := e.api("GET", "/volumes/"+key, nil)
		if r.Code != 200 {
			t.Fatalf("get %s: %d %s", key, r.Code, r.Body)
		}
		r.decode(t, &got)
		if got != v {
			t.Fatalf("get %s: %+v, want %+v", key, got, v)
		}
	}
	createVolume(t, e, "other")
	var list []volumeInfo
	e.api("GET", "/volumes", nil).decode(t, &list)
	if len(list) != 2 || list[0].Name != "data" || list[0].VolumeID != v.VolumeID || list[0].Token != "" {
		t.Fatalf("list %+v", list)
	}
	if r := e.api("DELETE", "/volumes/"+v.VolumeID, nil); r.Code != 204 {
		t.Fatalf("delete: %d %s", r.Code, r.Body)
	}
	expectError(t, e.api("GET", "/volumes/"+v.VolumeID, nil), 404)
	expectError(t, e.api("DELETE", "/volumes/"+v.VolumeID, nil), 404)
	// The name is free again, under a new id.
	if v2 := createVolume(t, e, "data"); v2.VolumeID == v.VolumeID {
		t.Fatal("a recreated volume got the old id")
	}
}

// Another team's key never reaches a volume: 404 on get, delete and
// mount, its list is empty, and it may use the same name for its own.
func TestVolumeOtherTeam(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	e.register(newFakeNode(t, "w1", st), 10)
	v := createVolume(t, e, "data")
	other := map[string]string{"X-API-Key": otherTeamKey(t, st)}
	for _, key := range []string{v.VolumeID, "data"} {
		expectError(t, e.do("GET", "/volumes/"+key, other, nil), 404)
		expectError(t, e.do("DELETE", "/volumes/"+key, other, nil), 404)
	}
	expectError(t, e.do("POST", "/v2/sandboxes", other, map[string]any{"templateID": "base",
		"volumeMounts": []map[string]string{{"name": "data", "path": "/mnt/data"}}}), 404)
	r := e.do("GET", "/volumes", other, nil)
	if r.Code != 200 || strings.TrimSpace(string(r.Body)) != "[]" {
		t.Fatalf("other team's list: %d %s", r.Code, r.Body)
	}
	if r := e.do("POST", "/volumes", other, map[string]any{"name": "data"}); r.Code != 201 {
		t.Fatalf("other team, same name: %d %s", r.Code, r.Body)
	}
	// The owner's volume is untouched.
	if r := e.api("GET", "/volumes/"+v.VolumeID, nil); r.Code != 200 {
		t.Fatalf("owner after the other team's attempts: %d %s", r.Code, r.Body)
	}
}

// A create's volumeMounts reach the worker as ids with their paths, show
// in the sandbox's info, follow it to another worker on a move, and keep
// the volume from being deleted (409) until the sandbox is killed.
func TestVolumeMounts(t *testing.T) {
	e, n1, n2, _, _ := twoWorkers(t, nil)
	v := createVolume(t, e, "data")
	w := createVolume(t, e, "work")
	for _, bad := range [][]map[string]string{
		{{"name": "data", "path": "relative"}},
		{{"name": "data", "path": "/proc/x"}},
		{{"name": "data", "path": "/"}},
		{{"name": "data", "path": "/mnt/../etc"}},
		{{"name": "data", "path": "/mnt/a"}, {"name": "work", "path": "/mnt/a/b"}},
	} {
		expectError(t, e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "volumeMounts": bad}), 400)
	}
	expectError(t, e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base",
		"volumeMounts": []map[string]string{{"name": "nope", "path": "/mnt/x"}}}), 404)

	n1.mu.Lock()
	before := len(n1.installs) + len(n2.installs)
	n1.mu.Unlock()
	sb := createV2(t, e, map[string]any{"templateID": "base", "volumeMounts": []map[string]string{
		{"name": "data", "path": "/mnt/data"}, {"name": w.VolumeID, "path": "/home/user/work"}}})
	want := []spacev1.VolumeMount{{ID: v.VolumeID, Name: "data", Path: "/mnt/data"}, {ID: w.VolumeID, Name: "work", Path: "/home/user/work"}}
	var ins []spacev1.InstallRequest
	for _, n := range []*fakeNode{n1, n2} {
		n.mu.Lock()
		ins = append(ins, n.installs...)
		n.mu.Unlock()
	}
	if len(ins) != before+1 || !sameMounts(ins[len(ins)-1].Volumes, want) {
		t.Fatalf("install requests %+v", ins)
	}
	var d e2bapi.SandboxDetail
	e.api("GET", "/sandboxes/"+sb.SandboxID, nil).decode(t, &d)
	if len(d.VolumeMounts) != 2 || d.VolumeMounts[0] != (e2bapi.SandboxVolumeMount{Name: "data", Path: "/mnt/data"}) {
		t.Fatalf("detail volumeMounts %+v", d.VolumeMounts)
	}
	var l []e2bapi.ListedSandbox
	e.api("GET", "/v2/sandboxes", nil).decode(t, &l)
	for _, s := range l {
		if s.SandboxID == sb.SandboxID && len(s.VolumeMounts) != 2 {
			t.Fatalf("listed volumeMounts %+v", s.VolumeMounts)
		}
	}
	expectError(t, e.api("DELETE", "/volumes/data", nil), 409)
	// Still there, and not half-deleted: mountable by another sandbox.
	createV2(t, e, map[string]any{"templateID": "base", "volumeMounts": []map[string]string{{"name": "data", "path": "/data"}}})

	// A move installs the next execution with the same mounts.
	rec := e.record(sb.SandboxID)
	target := "w2"
	if rec.Route.WorkerID == "w2" {
		target = "w1"
	}
	if r := e.api("POST", "/space/v1/sandboxes/"+sb.SandboxID+"/migrate", map[string]any{"target_worker": target}); r.Code != 200 {
		t.Fatalf("migrate: %d %s", r.Code, r.Body)
	}
	tn := map[string]*fakeNode{"w1": n1, "w2": n2}[target]
	tn.mu.Lock()
	last := tn.installs[len(tn.installs)-1]
	tn.mu.Unlock()
	if last.Route.SandboxID != sb.SandboxID || !sameMounts(last.Volumes, want) {
		t.Fatalf("move install %+v", last)
	}
	if got := e.record(sb.SandboxID).VolumeMounts; !sameMounts(got, want) {
		t.Fatalf("record after move %+v", got)
	}

	// A fork mounts what its source mounts.
	r := e.api("POST", "/sandboxes/"+sb.SandboxID+"/fork", map[string]any{"count": 1, "timeout": 60})
	if r.Code != 201 {
		t.Fatalf("fork: %d %s", r.Code, r.Body)
	}
	var forks []e2bapi.SandboxForkResult
	r.decode(t, &forks)
	if len(forks) != 1 || forks[0].Sandbox == nil {
		t.Fatalf("fork results %s", r.Body)
	}
	if got := e.record(forks[0].Sandbox.SandboxID).VolumeMounts; !sameMounts(got, want) {
		t.Fatalf("fork's mounts %+v", got)
	}
	if r := e.api("DELETE", "/sandboxes/"+forks[0].Sandbox.SandboxID, nil); r.Code != 204 {
		t.Fatalf("kill fork: %d %s", r.Code, r.Body)
	}

	// Killed: the work volume is free; data still has the second sandbox.
	if r := e.api("DELETE", "/sandboxes/"+sb.SandboxID, nil); r.Code != 204 {
		t.Fatalf("kill: %d %s", r.Code, r.Body)
	}
	if r := e.api("DELETE", "/volumes/work", nil); r.Code != 204 {
		t.Fatalf("delete after kill: %d %s", r.Code, r.Body)
	}
	expectError(t, e.api("DELETE", "/volumes/data", nil), 409)
}

// A create that names a volume deleted after it was resolved fails rather
// than mount a volume whose record is gone.
func TestVolumeDeletedDuringCreate(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	e.register(newFakeNode(t, "w1", st), 10)
	v := createVolume(t, e, "data")
	rec, rev, err := st.GetVolume(context.Background(), teamOf(t, e), v.VolumeID)
	if err != nil {
		t.Fatal(err)
	}
	rec.Deleting = true
	if _, err := st.UpdateVolume(context.Background(), rev, rec); err != nil {
		t.Fatal(err)
	}
	// resolveVolumeMounts already refuses a volume being deleted; the
	// check after the record write is what a racing delete meets.
	srec := store.SandboxRecord{TeamID: rec.TeamID, VolumeMounts: []spacev1.VolumeMount{{ID: v.VolumeID, Name: "data", Path: "/mnt"}}}
	if err := e.srv.checkVolumesLive(context.Background(), srec); err == nil {
		t.Fatal("a volume being deleted passed the check")
	}
	expectError(t, e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base",
		"volumeMounts": []map[string]string{{"name": "data", "path": "/mnt/data"}}}), 404)
	// A delete that never finished (the mark left behind) is finished by
	// the next one.
	if r := e.api("DELETE", "/volumes/"+v.VolumeID, nil); r.Code != 204 {
		t.Fatalf("delete of a marked volume: %d %s", r.Code, r.Body)
	}
	if _, _, err := st.GetVolume(context.Background(), rec.TeamID, v.VolumeID); err == nil {
		t.Fatal("record left")
	}
}

func teamOf(t *testing.T, e *env) string {
	t.Helper()
	k, err := e.st.LookupAPIKey(context.Background(), store.HashAPIKey(e.key))
	if err != nil {
		t.Fatal(err)
	}
	return k.TeamID
}

func sameMounts(a, b []spacev1.VolumeMount) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// The volume content API: authorized by the volume's token only, file
// operations through the volume manager, 404 for a deleted volume.
func TestVolumeContentAPI(t *testing.T) {
	testenv.RequireRoot(t, "loop devices and mounts for the volume's file system")
	if why := volume.Unsupported(); why != "" {
		testenv.Skipf(t, "volumes unsupported here: %s", why)
	}
	m, err := volume.New(volume.Config{Root: filepath.Join(t.TempDir(), "volumes"), SizeBytes: 16 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	st := openStore(t)
	e := newEnv(t, st, nil)
	srv, err := New(Config{DataDir: t.TempDir(), EdgeKey: edgeKey}, Deps{Store: st, Logger: quiet(), Volumes: m})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	v := createVolume(t, e, "files")
	do := func(method, path, token string, body any) resp {
		t.Helper()
		r := e.srv
		e.srv = srv
		defer func() { e.srv = r }()
		h := map[string]string{}
		if token != "" {
			h["Authorization"] = "Bearer " + token
		}
		return e.do(method, "/volumecontent/"+v.VolumeID+path, h, body)
	}
	expectError(t, do("GET", "/path?path=/", "", nil), 401)
	expectError(t, do("GET", "/path?path=/", strings.Repeat("0", 64), nil), 401)
	expectError(t, e.do("GET", "/volumecontent/vol_000000000000000000000000/path?path=/", map[string]string{"Authorization": "Bearer " + v.Token}, nil), 404)

	if r := do("PUT", "/file?path=/docs/a.txt&mode=0600", v.Token, "hello"); r.Code != 200 {
		t.Fatalf("write: %d %s", r.Code, r.Body)
	}
	r := do("GET", "/file?path=docs/a.txt", v.Token, nil)
	if r.Code != 200 || string(r.Body) != "hello" {
		t.Fatalf("read: %d %q", r.Code, r.Body)
	}
	var ent volume.Entry
	do("GET", "/path?path=/docs/a.txt", v.Token, nil).decode(t, &ent)
	if ent.Type != "file" || ent.Mode != 0o600 || ent.UID != volume.UserID || ent.Size != 5 {
		t.Fatalf("stat %+v", ent)
	}
	expectError(t, do("POST", "/dir?path=/p/q", v.Token, nil), 404)
	if r := do("POST", "/dir?path=/p/q&force=true", v.Token, nil); r.Code != 201 {
		t.Fatalf("mkdir -p: %d %s", r.Code, r.Body)
	}
	do("PATCH", "/path?path=/p", v.Token, map[string]any{"mode": 0o700, "uid": 0}).decode(t, &ent)
	if ent.Mode != 0o700 || ent.UID != 0 || ent.Type != "directory" {
		t.Fatalf("patch %+v", ent)
	}
	var list []volume.Entry
	do("GET", "/dir?path=/&depth=2", v.Token, nil).decode(t, &list)
	if len(list) != 4 {
		t.Fatalf("list %+v", list)
	}
	expectError(t, do("GET", "/file?path=/nope", v.Token, nil), 404)
	if r := do("DELETE", "/path?path=/docs", v.Token, nil); r.Code != 204 {
		t.Fatalf("remove: %d %s", r.Code, r.Body)
	}
	expectError(t, do("GET", "/path?path=/docs/a.txt", v.Token, nil), 404)
	expectError(t, do("DELETE", "/path?path=/", v.Token, nil), 400)
	// Deleted: the token opens nothing.
	if r := e.api("DELETE", "/volumes/"+v.VolumeID, nil); r.Code != 204 {
		t.Fatalf("delete: %d %s", r.Code, r.Body)
	}
	expectError(t, do("GET", "/path?path=/", v.Token, nil), 404)
}
