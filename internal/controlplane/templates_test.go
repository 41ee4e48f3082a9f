package controlplane

import (
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
)

const filesHash = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

func TestTemplateBuildAPIRejects(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, func(c *Config) { c.MaxTemplateFileBytes = 1024 })
	for _, bad := range []string{"", "Bad Name", "UPPER", "x:bad tag", "default/a/b", strings.Repeat("a", 200)} {
		expectError(t, e.api("POST", "/v3/templates", map[string]any{"name": bad}), 400)
	}
	expectError(t, e.api("POST", "/v3/templates", map[string]any{"name": "base"}), 409)
	expectError(t, e.api("POST", "/v3/templates", map[string]any{"name": "other/x"}), 404) // another team's namespace
	expectError(t, e.api("POST", "/v3/templates", map[string]any{"name": "ok", "cpuCount": 0}), 400)

	r := e.api("POST", "/v3/templates", map[string]any{"name": "web:v1", "tags": []string{"stable"}})
	var req e2bapi.TemplateRequestResponseV3
	r.decode(t, &req)
	if r.Code != 202 || req.TemplateID == "" || req.BuildID == "" || len(req.Tags) != 2 {
		t.Fatalf("request build: %d %s", r.Code, r.Body)
	}
	tid, bid := req.TemplateID, req.BuildID

	// File upload links: bad hash, unknown template, another team.
	expectError(t, e.api("GET", "/templates/"+tid+"/files/nothex", nil), 400)
	expectError(t, e.api("GET", "/templates/tpl-nosuch/files/"+filesHash, nil), 404)
	other := otherTeamKey(t, e.st)
	expectError(t, e.do("GET", "/templates/"+tid+"/files/"+filesHash, map[string]string{"X-API-Key": other}, nil), 404)
	expectError(t, e.do("GET", "/templates/"+tid, map[string]string{"X-API-Key": other}, nil), 404)
	expectError(t, e.do("GET", "/templates/aliases/web", map[string]string{"X-API-Key": other}, nil), 404)
	expectError(t, e.do("DELETE", "/templates/"+tid, map[string]string{"X-API-Key": other}, nil), 404)

	r = e.api("GET", "/templates/"+tid+"/files/"+filesHash, nil)
	var link e2bapi.TemplateBuildFileUpload
	r.decode(t, &link)
	if r.Code != 201 || link.Present || link.URL == nil {
		t.Fatalf("upload link: %d %s", r.Code, r.Body)
	}
	u, err := url.Parse(*link.URL)
	if err != nil {
		t.Fatal(err)
	}
	good := u.RequestURI()
	// Tampered links are refused: another hash, another team, another
	// expiry, no signature.
	for _, bad := range []string{
		strings.Replace(good, filesHash, strings.Repeat("f", 64), 1),
		strings.Replace(good, "/default/", "/other/", 1),
		strings.Replace(good, "exp=", "exp=9", 1),
		strings.Split(good, "&sig=")[0],
	} {
		expectError(t, e.do("PUT", bad, nil, "data"), 403)
	}
	expectError(t, e.do("PUT", good, nil, strings.Repeat("x", 2048)), 400) // over MaxTemplateFileBytes
	if r := e.do("PUT", good, nil, "tar bytes"); r.Code != 200 {
		t.Fatalf("upload: %d %s", r.Code, r.Body)
	}
	r = e.api("GET", "/templates/"+tid+"/files/"+filesHash, nil)
	r.decode(t, &link)
	if !link.Present {
		t.Fatalf("uploaded files not present: %s", r.Body)
	}
	e.clock.Advance(2 * uploadLinkTTL)
	expectError(t, e.do("PUT", good, nil, "late"), 403)

	// Starting the build: bad steps, missing files, unsupported sources,
	// no sandbox URL on this control plane.
	start := "/v2/templates/" + tid + "/builds/" + bid
	for _, steps := range [][]map[string]any{
		{{"type": "RUN"}},
		{{"type": "EXPLODE", "args": []string{"x"}}},
		{{"type": "ENV", "args": []string{"1BAD", "x"}}},
		{{"type": "WORKDIR", "args": []string{"relative"}}},
		{{"type": "USER", "args": []string{"bad user"}}},
		{{"type": "COPY", "args": []string{"a", "/b"}, "filesHash": "nothex"}},
		{{"type": "RUN", "args": []string{"a\x00b"}}},
	} {
		expectError(t, e.api("POST", start, map[string]any{"fromTemplate": "base", "steps": steps}), 400)
	}
	missing := strings.Repeat("e", 64)
	expectError(t, e.api("POST", start, map[string]any{"fromTemplate": "base",
		"steps": []map[string]any{{"type": "COPY", "args": []string{"a", "/b"}, "filesHash": missing}}}), 400)
	expectError(t, e.api("POST", start, map[string]any{"fromImage": "debian 12", "steps": []any{}}), 400)
	expectError(t, e.api("POST", start, map[string]any{"fromImage": strings.Repeat("a", 600), "steps": []any{}}), 400)
	expectError(t, e.api("POST", start, map[string]any{"fromImage": "debian:12", "steps": []any{},
		"fromImageRegistry": map[string]string{"type": "aws", "awsAccessKeyId": "x"}}), 400)
	expectError(t, e.api("POST", start, map[string]any{"fromTemplate": "web", "steps": []any{}}), 400) // itself
	expectError(t, e.api("POST", start, map[string]any{"fromTemplate": "nosuch", "steps": []any{}}), 404)
	expectError(t, e.api("POST", start, map[string]any{"fromTemplate": "base", "steps": []any{}}), 503)
	expectError(t, e.api("POST", "/v2/templates/"+tid+"/builds/bld-nosuch", map[string]any{"steps": []any{}}), 404)

	// Status of the waiting build, the alias, the lists.
	r = e.api("GET", "/templates/"+tid+"/builds/"+bid+"/status", nil)
	var info e2bapi.TemplateBuildInfo
	r.decode(t, &info)
	if r.Code != 200 || info.Status != e2bapi.BuildWaiting {
		t.Fatalf("status: %d %s", r.Code, r.Body)
	}
	expectError(t, e.api("GET", "/templates/"+tid+"/builds/"+bid+"/status?logsOffset=-1", nil), 400)
	if r := e.api("GET", "/templates/aliases/base", nil); r.Code != 200 {
		t.Fatalf("alias base: %d", r.Code)
	}
	if r := e.api("GET", "/templates/aliases/web", nil); r.Code != 200 {
		t.Fatalf("alias web: %d %s", r.Code, r.Body)
	}
	expectError(t, e.api("GET", "/templates/aliases/nosuch", nil), 404)
	expectError(t, e.api("GET", "/templates/"+tid+"/nosuch", nil), 404)
	// Not built yet: no tag points anywhere, so neither a create from it
	// nor a tag assignment works.
	expectError(t, e.api("POST", "/templates/tags", map[string]any{"target": "web:v1", "tags": []string{"x"}}), 404)
	expectError(t, e.api("POST", "/sandboxes", map[string]any{"templateID": "web"}), 404)
	if r := e.api("DELETE", "/templates/"+tid, nil); r.Code != 204 {
		t.Fatalf("delete: %d %s", r.Code, r.Body)
	}
	expectError(t, e.api("GET", "/templates/"+tid, nil), 404)
}

func TestTemplateBuildFailsWithoutWorkers(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, func(c *Config) { c.SandboxURL = "http://127.0.0.1:1" })
	r := e.api("POST", "/v3/templates", map[string]any{"name": "web"})
	var req e2bapi.TemplateRequestResponseV3
	r.decode(t, &req)
	start := "/v2/templates/" + req.TemplateID + "/builds/" + req.BuildID
	if r := e.api("POST", start, map[string]any{"fromTemplate": "base", "steps": []map[string]any{{"type": "RUN", "args": []string{"true"}}}}); r.Code != 202 {
		t.Fatalf("start: %d %s", r.Code, r.Body)
	}
	expectError(t, e.api("POST", start, map[string]any{"fromTemplate": "base", "steps": []any{}}), 409)
	var info e2bapi.TemplateBuildInfo
	deadline := time.Now().Add(20 * time.Second)
	for {
		e.api("GET", "/templates/"+req.TemplateID+"/builds/"+req.BuildID+"/status", nil).decode(t, &info)
		if info.Status == e2bapi.BuildError || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if info.Status != e2bapi.BuildError || info.Reason == nil || info.Reason.Step != "base" || !strings.Contains(info.Reason.Message, "build sandbox") {
		t.Fatalf("a build with no worker to run on: %+v", info)
	}
}

// A build sandbox asks for the internet (the operator's policy bounds it);
// a team denied egress builds without it.
func TestBuildSandboxNetwork(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, func(c *Config) { c.SandboxURL = "http://127.0.0.1:1" })
	node := newFakeNode(t, "w1", st)
	e.register(node, 10)
	p := &buildPlatform{s: e.srv, c: caller{TeamID: "default", KeyID: "template-build"}}
	if _, _, err := p.Start(t.Context(), "base", nil); err != nil {
		t.Fatal(err)
	}
	node.mu.Lock()
	req := node.installs[len(node.installs)-1]
	node.mu.Unlock()
	if req.Network == nil || req.Network.Spec.AllowInternetAccess == nil || !*req.Network.Spec.AllowInternetAccess {
		t.Fatalf("build sandbox network: %+v", req.Network)
	}
}
