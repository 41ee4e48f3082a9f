package controlplane

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/store"
)

func createV2(t *testing.T, e *env, body any) e2bapi.Sandbox {
	t.Helper()
	r := e.api("POST", "/v2/sandboxes", body)
	if r.Code != 201 {
		t.Fatalf("create: %d %s", r.Code, r.Body)
	}
	var sb e2bapi.Sandbox
	r.decode(t, &sb)
	return sb
}

// The main lifecycle over one embedded etcd.
func TestLifecycle(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	node := newFakeNode(t, "w1", st)

	// No worker registered: 503.
	expectError(t, e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base"}), 503)
	e.register(node, 10)

	t.Run("CreateGetKill", func(t *testing.T) {
		sb := createV2(t, e, map[string]any{"templateID": "base", "timeout": 60, "metadata": map[string]string{"user": "abc"},
			"envVars": map[string]string{"FOO": "bar"}, "someFutureField": true})
		if len(sb.SandboxID) != 20 || sb.TemplateID != "base" || sb.EnvdVersion != "0.2.1" || sb.EnvdAccessToken == "" ||
			sb.Domain == nil || *sb.Domain != "localhost" || sb.ClientID == "" {
			t.Fatalf("create response: %+v", sb)
		}
		ins, _, tokErr := node.counts()
		if ins != 1 || tokErr != nil {
			t.Fatalf("installs %d, token error %v", ins, tokErr)
		}
		node.mu.Lock()
		req := node.installs[0]
		node.mu.Unlock()
		if req.Route.SandboxID != sb.SandboxID || req.Route.Generation != 1 || req.Route.WorkerID != "w1" ||
			req.Template != "base" || req.EnvVars["FOO"] != "bar" || req.Route.Validate() != nil {
			t.Fatalf("install request: %+v", req)
		}

		r := e.api("GET", "/sandboxes/"+sb.SandboxID, nil)
		var d e2bapi.SandboxDetail
		r.decode(t, &d)
		if r.Code != 200 || d.SandboxID != sb.SandboxID || d.State != "running" || d.Metadata["user"] != "abc" ||
			d.EndAt.Sub(d.StartedAt) != 60*time.Second || d.CPUCount == 0 || d.EnvdVersion != "0.2.1" {
			t.Fatalf("get: %d %+v", r.Code, d)
		}

		r = e.api("GET", "/space/v1/sandboxes/"+sb.SandboxID+"/executions", nil)
		var ex []spacev1.Execution
		r.decode(t, &ex)
		if r.Code != 200 || len(ex) != 1 || ex[0].State != "running" || ex[0].Route != req.Route {
			t.Fatalf("executions: %d %s", r.Code, r.Body)
		}

		if r := e.api("DELETE", "/sandboxes/"+sb.SandboxID, nil); r.Code != 204 {
			t.Fatalf("kill: %d %s", r.Code, r.Body)
		}
		if _, td, tokErr := node.counts(); td != 1 || tokErr != nil {
			t.Fatalf("teardowns %d, token error %v", td, tokErr)
		}
		expectError(t, e.api("GET", "/sandboxes/"+sb.SandboxID, nil), 404)
		expectError(t, e.api("DELETE", "/sandboxes/"+sb.SandboxID, nil), 404)
		r = e.api("GET", "/space/v1/sandboxes/"+sb.SandboxID+"/executions", nil)
		r.decode(t, &ex)
		if len(ex) != 1 || ex[0].State != "killed" || ex[0].EndedAt == nil {
			t.Fatalf("executions after kill: %s", r.Body)
		}
	})

	t.Run("V1Secure", func(t *testing.T) {
		r := e.api("POST", "/sandboxes", map[string]any{"templateID": "base"})
		var sb e2bapi.Sandbox
		r.decode(t, &sb)
		if r.Code != 201 || sb.EnvdAccessToken != "" {
			t.Fatalf("v1 insecure: %d %s", r.Code, r.Body)
		}
		r = e.api("POST", "/sandboxes", map[string]any{"templateID": "base", "secure": true})
		r.decode(t, &sb)
		if r.Code != 201 || sb.EnvdAccessToken == "" {
			t.Fatalf("v1 secure: %d %s", r.Code, r.Body)
		}
		r = e.api("GET", "/sandboxes", nil)
		var list []e2bapi.ListedSandbox
		r.decode(t, &list)
		if r.Code != 200 || len(list) < 2 {
			t.Fatalf("v1 list: %s", r.Body)
		}
	})

	t.Run("Workers", func(t *testing.T) {
		r := e.api("GET", "/space/v1/workers", nil)
		var ws []spacev1.Worker
		r.decode(t, &ws)
		if r.Code != 200 || len(ws) != 1 || ws[0].ID != "w1" || ws[0].Load < 2 {
			t.Fatalf("workers: %d %s", r.Code, r.Body)
		}
		if r := e.do("GET", "/space/v1/workers", map[string]string{"X-API-Key": edgeKey}, nil); r.Code != 200 {
			t.Fatalf("edge workers: %d", r.Code)
		}
	})

	t.Run("Timeout", func(t *testing.T) {
		sb := createV2(t, e, map[string]any{"templateID": "base", "timeout": 5})
		keep := createV2(t, e, map[string]any{"templateID": "base", "timeout": 5})
		if r := e.api("POST", "/sandboxes/"+keep.SandboxID+"/timeout", map[string]any{"timeout": 3600}); r.Code != 204 {
			t.Fatalf("set timeout: %d %s", r.Code, r.Body)
		}
		expectError(t, e.api("POST", "/sandboxes/"+keep.SandboxID+"/timeout", map[string]any{"timeout": 100000}), 400)
		expectError(t, e.api("POST", "/sandboxes/"+keep.SandboxID+"/timeout", map[string]any{}), 400)
		expectError(t, e.api("POST", "/sandboxes/zzzzzzzz/timeout", map[string]any{"timeout": 1}), 404)
		_, td0, _ := node.counts()
		e.clock.Advance(6 * time.Second)
		waitFor(t, func() bool { return e.api("GET", "/sandboxes/"+sb.SandboxID, nil).Code == 404 })
		waitFor(t, func() bool { _, td, _ := node.counts(); return td == td0+1 })
		if r := e.api("GET", "/sandboxes/"+keep.SandboxID, nil); r.Code != 200 {
			t.Fatalf("extended sandbox gone: %d", r.Code)
		}
		rec, _, _ := st.GetSandbox(context.Background(), sb.SandboxID)
		if rec.State != store.StateKilled || rec.Reason != "timeout" {
			t.Fatalf("record after timeout: %v %q", rec.State, rec.Reason)
		}
	})

	t.Run("InstallFailure", func(t *testing.T) {
		node.setFail(500)
		defer node.setFail(0)
		r := e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base"})
		expectError(t, r, 502)
		if !strings.Contains(string(r.Body), "boom") {
			t.Fatalf("node message not passed on: %s", r.Body)
		}
		// The record is a failed tombstone; nothing listed.
		entries, _ := st.ListSandboxes(context.Background())
		failed := 0
		for _, en := range entries {
			if en.Record.State == store.StateFailed {
				failed++
			}
		}
		if failed != 1 {
			t.Fatalf("%d failed records, want 1", failed)
		}
	})
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met in time")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestAuthAndBadInput(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	e.register(newFakeNode(t, "w1", st), 10)

	expectError(t, e.do("GET", "/v2/sandboxes", nil, nil), 401)
	expectError(t, e.do("GET", "/v2/sandboxes", map[string]string{"X-API-Key": "e2b_" + strings.Repeat("0", 40)}, nil), 401)
	expectError(t, e.do("GET", "/v2/sandboxes", map[string]string{"X-API-Key": strings.Repeat("x", 5000)}, nil), 401)
	expectError(t, e.do("POST", "/v2/sandboxes", map[string]string{"X-API-Key": edgeKey}, map[string]any{"templateID": "base"}), 403)

	cases := []struct {
		name, method, path string
		body               any
		code               int
	}{
		{"malformed", "POST", "/v2/sandboxes", `{"templateID":`, 400},
		{"syntax", "POST", "/v2/sandboxes", `{"templateID" "base"}`, 400},
		{"empty", "POST", "/v2/sandboxes", ``, 400},
		{"array", "POST", "/v2/sandboxes", `[]`, 400},
		{"trailing", "POST", "/v2/sandboxes", `{"templateID":"base"} {}`, 400},
		{"wrong type", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":"ten"}`, 400},
		{"overflow", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":99999999999}`, 400},
		{"oversized", "POST", "/v2/sandboxes", `{"templateID":"base","metadata":{"a":"` + strings.Repeat("x", 2<<20) + `"}}`, 413},
		{"no template", "POST", "/v2/sandboxes", `{}`, 400},
		{"unknown template", "POST", "/v2/sandboxes", `{"templateID":"nope"}`, 404},
		{"negative timeout", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":-1}`, 400},
		{"huge timeout", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":90000}`, 400},
		{"bad env", "POST", "/v2/sandboxes", `{"templateID":"base","envVars":{"1X":"y"}}`, 400},
		{"unknown volume", "POST", "/v2/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"v","path":"/v"}]}`, 404},
		{"bad id", "GET", "/sandboxes/UPPER", nil, 400},
		{"bad id kill", "DELETE", "/sandboxes/a_b", nil, 400},
		{"unknown id", "GET", "/sandboxes/doesnotexist", nil, 404},
		{"bad limit", "GET", "/v2/sandboxes?limit=0", nil, 400},
		{"big limit", "GET", "/v2/sandboxes?limit=1000", nil, 400},
		{"bad token", "GET", "/v2/sandboxes?nextToken=!!!", nil, 400},
		{"forged token", "GET", "/v2/sandboxes?nextToken=abc", nil, 400},
		{"bad state", "GET", "/v2/sandboxes?state=dead", nil, 400},
		{"bad order", "GET", "/v2/sandboxes?order=up", nil, 400},
		{"bad metadata", "GET", "/v2/sandboxes?metadata=" + url.QueryEscape("a=%zz"), nil, 400},
		{"no route", "GET", "/nothing/here", nil, 404},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { expectError(t, e.api(c.method, c.path, c.body), c.code) })
	}
	if r := e.do("GET", "/health", nil, nil); r.Code != 200 {
		t.Fatalf("health: %d", r.Code)
	}
}

func TestListFiltersAndPagination(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	e.register(newFakeNode(t, "w1", st), 100)
	ids := map[string]bool{}
	for i := 0; i < 5; i++ {
		md := map[string]string{"app": "prod", "idx": string(rune('a' + i))}
		if i%2 == 1 {
			md["app"] = "dev &= x"
		}
		sb := createV2(t, e, map[string]any{"templateID": "base", "metadata": md})
		ids[sb.SandboxID] = true
		e.clock.Advance(time.Millisecond)
	}
	// Another team's sandbox must never show.
	other := "e2b_" + strings.Repeat("ab", 20)
	if err := st.PutAPIKey(context.Background(), store.HashAPIKey(other), store.APIKeyRecord{TeamID: "other", KeyID: "k2", Role: store.RoleUser}); err != nil {
		t.Fatal(err)
	}
	if r := e.do("POST", "/v2/sandboxes", map[string]string{"X-API-Key": other}, map[string]any{"templateID": "base"}); r.Code != 201 {
		t.Fatal(r.Code)
	}

	var seen []string
	token := ""
	for page := 0; ; page++ {
		q := "/v2/sandboxes?limit=2"
		if token != "" {
			q += "&nextToken=" + url.QueryEscape(token)
		}
		r := e.api("GET", q, nil)
		var list []e2bapi.ListedSandbox
		r.decode(t, &list)
		if r.Code != 200 || len(list) > 2 {
			t.Fatalf("page %d: %d %s", page, r.Code, r.Body)
		}
		if r.Header.Get("X-Total-Running") != "5" {
			t.Fatalf("total running %q", r.Header.Get("X-Total-Running"))
		}
		for _, s := range list {
			seen = append(seen, s.SandboxID)
		}
		token = r.Header.Get("X-Next-Token")
		if token == "" {
			break
		}
		if page > 5 {
			t.Fatal("pagination does not end")
		}
	}
	if len(seen) != 5 {
		t.Fatalf("paged through %d sandboxes, want 5: %v", len(seen), seen)
	}
	for _, id := range seen {
		if !ids[id] {
			t.Fatalf("unexpected sandbox %s", id)
		}
	}

	// The metadata filter as the SDK encodes it: encodeURIComponent on key
	// and value, then URLSearchParams, then the query serializer.
	sdkMetadata := func(m map[string]string) string {
		v := url.Values{}
		for k, val := range m {
			v.Set(url.PathEscape(k), url.PathEscape(val))
		}
		return url.QueryEscape(v.Encode())
	}
	count := func(q string) int {
		r := e.api("GET", q, nil)
		var list []e2bapi.ListedSandbox
		r.decode(t, &list)
		if r.Code != 200 {
			t.Fatalf("%s: %d %s", q, r.Code, r.Body)
		}
		return len(list)
	}
	if n := count("/v2/sandboxes?metadata=" + sdkMetadata(map[string]string{"app": "dev &= x"})); n != 2 {
		t.Fatalf("metadata dev: %d", n)
	}
	if n := count("/v2/sandboxes?metadata=" + sdkMetadata(map[string]string{"app": "prod", "idx": "c"})); n != 1 {
		t.Fatalf("metadata prod+c: %d", n)
	}
	if n := count("/v2/sandboxes?state=paused"); n != 0 {
		t.Fatalf("paused: %d", n)
	}
	if n := count("/v2/sandboxes?state=running,paused&order=asc"); n != 5 {
		t.Fatalf("running,paused: %d", n)
	}
	if n := count("/sandboxes?metadata=" + sdkMetadata(map[string]string{"app": "prod"})); n != 3 {
		t.Fatalf("v1 metadata: %d", n)
	}
	// The other team cannot see or kill ours.
	for id := range ids {
		expectError(t, e.do("GET", "/sandboxes/"+id, map[string]string{"X-API-Key": other}, nil), 404)
		expectError(t, e.do("DELETE", "/sandboxes/"+id, map[string]string{"X-API-Key": other}, nil), 404)
		break
	}
}

func TestCapabilityAuthorization(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	e.register(newFakeNode(t, "w1", st), 10)
	secure := createV2(t, e, map[string]any{"templateID": "base", "timeout": 300})
	r := e.api("POST", "/sandboxes", map[string]any{"templateID": "base"})
	var open e2bapi.Sandbox
	r.decode(t, &open)

	other := "e2b_" + strings.Repeat("cd", 20)
	if err := st.PutAPIKey(context.Background(), store.HashAPIKey(other), store.APIKeyRecord{TeamID: "other", KeyID: "k3", Role: store.RoleUser}); err != nil {
		t.Fatal(err)
	}
	b, _ := st.GetBundle(context.Background())
	v, err := capability.NewVerifier(b)
	if err != nil {
		t.Fatal(err)
	}
	rec, _, _ := st.GetSandbox(context.Background(), secure.SandboxID)

	proc := map[string]any{"purpose": "process"}
	cases := []struct {
		name    string
		id      string
		headers map[string]string
		body    any
		code    int
	}{
		{"owner key", secure.SandboxID, map[string]string{"X-API-Key": e.key}, proc, 200},
		{"other team key", secure.SandboxID, map[string]string{"X-API-Key": other}, proc, 404},
		{"unknown key", secure.SandboxID, map[string]string{"X-API-Key": "e2b_" + strings.Repeat("9", 40)}, proc, 401},
		{"no credentials", secure.SandboxID, nil, proc, 401},
		{"access token", secure.SandboxID, map[string]string{"X-Access-Token": secure.EnvdAccessToken}, proc, 200},
		{"wrong token", secure.SandboxID, map[string]string{"X-Access-Token": "nope"}, proc, 401},
		{"token of tokenless", open.SandboxID, map[string]string{"X-Access-Token": secure.EnvdAccessToken}, proc, 401},
		{"edge on tokenless", open.SandboxID, map[string]string{"X-API-Key": edgeKey}, proc, 200},
		{"edge alone on secure", secure.SandboxID, map[string]string{"X-API-Key": edgeKey}, proc, 401},
		{"edge with token", secure.SandboxID, map[string]string{"X-API-Key": edgeKey, "X-Access-Token": secure.EnvdAccessToken}, proc, 200},
		{"edge with wrong token", secure.SandboxID, map[string]string{"X-API-Key": edgeKey, "X-Access-Token": "bad"}, proc, 401},
		{"edge repair", secure.SandboxID, map[string]string{"X-API-Key": edgeKey}, map[string]any{"purpose": "files", "repair": true}, 200},
		{"owner repair", secure.SandboxID, map[string]string{"X-API-Key": e.key}, map[string]any{"purpose": "files", "repair": true}, 403},
		{"token repair", secure.SandboxID, map[string]string{"X-Access-Token": secure.EnvdAccessToken}, map[string]any{"purpose": "files", "repair": true}, 403},
		{"control refused", secure.SandboxID, map[string]string{"X-API-Key": e.key}, map[string]any{"purpose": "control"}, 403},
		{"edge control refused", open.SandboxID, map[string]string{"X-API-Key": edgeKey}, map[string]any{"purpose": "control"}, 403},
		{"unknown purpose", secure.SandboxID, map[string]string{"X-API-Key": e.key}, map[string]any{"purpose": "root"}, 400},
		{"service-port no port", secure.SandboxID, map[string]string{"X-API-Key": e.key}, map[string]any{"purpose": "service-port", "protocol": "http"}, 400},
		{"service-port bad port", secure.SandboxID, map[string]string{"X-API-Key": e.key}, map[string]any{"purpose": "service-port", "port": 70000, "protocol": "http"}, 400},
		{"service-port bad proto", secure.SandboxID, map[string]string{"X-API-Key": e.key}, map[string]any{"purpose": "service-port", "port": 8080, "protocol": "udp"}, 400},
		{"service-port ok", secure.SandboxID, map[string]string{"X-API-Key": e.key}, map[string]any{"purpose": "service-port", "port": 8080, "protocol": "ws"}, 200},
		{"port on process", secure.SandboxID, map[string]string{"X-API-Key": e.key}, map[string]any{"purpose": "process", "port": 80}, 400},
		{"unknown field", secure.SandboxID, map[string]string{"X-API-Key": e.key}, map[string]any{"purpose": "process", "sandbox": "x"}, 400},
		{"malformed", secure.SandboxID, map[string]string{"X-API-Key": e.key}, `{"purpose":`, 400},
		{"unknown sandbox", "doesnotexist", map[string]string{"X-API-Key": e.key}, proc, 404},
		{"bad id", "BAD", map[string]string{"X-API-Key": e.key}, proc, 400},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := e.do("POST", "/space/v1/sandboxes/"+c.id+"/capabilities", c.headers, c.body)
			if c.code != 200 {
				expectError(t, r, c.code)
				return
			}
			if r.Code != 200 {
				t.Fatalf("status %d: %s", r.Code, r.Body)
			}
			var cr spacev1.CapabilityResponse
			r.decode(t, &cr)
			var req spacev1.CapabilityRequest
			switch b := c.body.(type) {
			case map[string]any:
				req.Purpose, _ = b["purpose"].(string)
			}
			var claims capability.Claims
			if req.Purpose == "service-port" {
				claims, err = v.VerifyServicePort(cr.Token, 8080, "ws")
			} else {
				claims, err = v.Verify(cr.Token, capability.Purpose(req.Purpose))
			}
			if err != nil {
				t.Fatalf("token does not verify: %v", err)
			}
			if claims.Route != cr.Route || cr.NodeURL == "" || cr.EnvdVersion == "" {
				t.Fatalf("response %+v vs claims %+v", cr, claims)
			}
			if c.id == secure.SandboxID && cr.Route != rec.Route {
				t.Fatalf("route %v, want %v", cr.Route, rec.Route)
			}
			now := e.clock.Now()
			if cr.AuthorizedUntil.After(now.Add(MaxAuthorization)) || cr.ExpiresAt.Sub(claims.IssuedAt) > capability.Lifetime {
				t.Fatalf("authorized until %v, expires %v", cr.AuthorizedUntil, cr.ExpiresAt)
			}
		})
	}

	// AuthorizedUntil never passes the sandbox's end.
	if r := e.api("POST", "/sandboxes/"+secure.SandboxID+"/timeout", map[string]any{"timeout": 30}); r.Code != 204 {
		t.Fatal(r.Code)
	}
	r = e.api("POST", "/space/v1/sandboxes/"+secure.SandboxID+"/capabilities", proc)
	var cr spacev1.CapabilityResponse
	r.decode(t, &cr)
	if cr.AuthorizedUntil.After(e.clock.Now().Add(30*time.Second)) || cr.ExpiresAt.After(e.clock.Now().Add(30*time.Second)) {
		t.Fatalf("authorization outlives the sandbox: %v / %v", cr.AuthorizedUntil, cr.ExpiresAt)
	}
	// Killed sandbox: 404.
	if r := e.api("DELETE", "/sandboxes/"+secure.SandboxID, nil); r.Code != 204 {
		t.Fatal(r.Code)
	}
	expectError(t, e.api("POST", "/space/v1/sandboxes/"+secure.SandboxID+"/capabilities", proc), 404)
	// Paused sandbox: 409.
	if _, _, err := st.MutateSandbox(context.Background(), open.SandboxID, func(r *store.SandboxRecord) error {
		r.State = store.StatePaused
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	expectError(t, e.do("POST", "/space/v1/sandboxes/"+open.SandboxID+"/capabilities", map[string]string{"X-API-Key": edgeKey}, proc), 409)
}

// A restarted control plane keeps its key (same kid, no bundle churn) and
// resumes timeouts from the store.
func TestRestart(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	node := newFakeNode(t, "w1", st)
	e.register(node, 10)
	sb := createV2(t, e, map[string]any{"templateID": "base", "timeout": 10})
	kid := e.srv.KeyID()
	b1, _ := st.GetBundle(context.Background())
	key := e.key
	e.srv.Close()

	e.start(func(c *Config) { c.BootstrapAPIKey = key })
	if _, gen := e.srv.BootstrapAPIKey(); gen || e.srv.KeyID() != kid {
		t.Fatalf("restart: generated=%v kid %s want %s", gen, e.srv.KeyID(), kid)
	}
	b2, _ := st.GetBundle(context.Background())
	if b2.Revision != b1.Revision || len(b2.Keys) != 1 {
		t.Fatalf("bundle changed on restart: %d -> %d, %d keys", b1.Revision, b2.Revision, len(b2.Keys))
	}
	e.clock.Advance(11 * time.Second)
	waitFor(t, func() bool { return e.api("GET", "/sandboxes/"+sb.SandboxID, nil).Code == 404 })

	// A second control plane (own data dir) shares the stored key: the
	// bundle does not change.
	e2 := newEnv(t, st, nil)
	b3, _ := st.GetBundle(context.Background())
	if b3.Revision != b2.Revision || len(b3.Keys) != 1 || e2.srv.KeyID() != kid {
		t.Fatalf("second replica: rev %d keys %d kid %s want %s", b3.Revision, len(b3.Keys), e2.srv.KeyID(), kid)
	}
}

func TestConfigAndKeyFile(t *testing.T) {
	if err := (Config{}).Validate(); err == nil {
		t.Fatal("empty config accepted")
	}
	if err := (Config{DataDir: "x", BootstrapAPIKey: "e2b_short"}).Validate(); err == nil {
		t.Fatal("bad api key accepted")
	}
	if err := (Config{DataDir: "x", EdgeKey: "short"}).Validate(); err == nil {
		t.Fatal("short edge key accepted")
	}
	if err := (Config{DataDir: "x", DefaultTimeout: time.Hour, MaxTimeout: time.Minute}).Validate(); err == nil {
		t.Fatal("default above max accepted")
	}
	dir := t.TempDir()
	if _, err := readKeyFile(filepath.Join(dir, SigningKeyFile)); !os.IsNotExist(err) {
		t.Fatalf("missing key file: %v", err)
	}
	_, priv, _ := ed25519.GenerateKey(rand.Reader)
	if err := writeKeyFile(dir, SigningKeyFile, priv); err != nil {
		t.Fatal(err)
	}
	if again, err := readKeyFile(filepath.Join(dir, SigningKeyFile)); err != nil || !again.Equal(priv) {
		t.Fatalf("reload: %v", err)
	}
	_ = os.Chmod(filepath.Join(dir, SigningKeyFile), 0o644)
	if _, err := readKeyFile(filepath.Join(dir, SigningKeyFile)); err == nil {
		t.Fatal("world-readable key accepted")
	}
	_ = os.WriteFile(filepath.Join(dir, SigningKeyFile), []byte("junk"), 0o600)
	if _, err := readKeyFile(filepath.Join(dir, SigningKeyFile)); err == nil {
		t.Fatal("junk key accepted")
	}
	if err := (Config{DataDir: "x", LeaderTTL: 500 * time.Millisecond}).Validate(); err == nil {
		t.Fatal("leader ttl below 1 s accepted")
	}
	if err := (Config{DataDir: "x", LeaderTTL: -time.Second}).Validate(); err == nil {
		t.Fatal("negative leader ttl accepted")
	}
	seen := map[string]bool{}
	for i := 0; i < 1000; i++ {
		id := newSandboxID()
		if len(id) != 20 || seen[id] || parseSandboxIDErr(id) != nil || id[0] < 'a' || id[0] > 'z' {
			t.Fatalf("bad id %q", id)
		}
		seen[id] = true
	}
}

func parseSandboxIDErr(id string) error { _, err := parseSandboxID(id); return err }
