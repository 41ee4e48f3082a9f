package controlplane

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/legacy"
)

// docChecker drives the real handlers and validates each request and
// response against the document: a handler answering a status, a header
// or a body the document does not describe fails.
type docChecker struct {
	t      reporter
	e      *env
	doc    *openapi3.T
	router routers.Router
	// covered counts the responses validated per operationId.
	covered map[string]int
}

func newDocChecker(t *testing.T, e *env) *docChecker {
	doc := loadDoc(t)
	doc.Servers = nil // match any host
	r, err := legacy.NewRouter(doc)
	if err != nil {
		t.Fatal(err)
	}
	return &docChecker{t: t, e: e, doc: doc, router: r, covered: map[string]int{}}
}

type call struct {
	method, path string
	headers      map[string]string
	body         any
	// want is the expected status (0: any).
	want int
	// strict also validates the request (a well-formed request of the
	// document's: the success paths).
	strict bool
}

func (d *docChecker) do(c call) resp {
	d.t.Helper()
	var raw []byte
	switch b := c.body.(type) {
	case nil:
	case []byte:
		raw = b
	default:
		raw, _ = json.Marshal(b)
	}
	req := httptest.NewRequest(c.method, c.path, bytes.NewReader(raw))
	if c.body != nil {
		req.Header.Set("Content-Type", "application/json")
		if _, ok := c.body.([]byte); ok {
			req.Header.Set("Content-Type", "application/octet-stream")
		}
	}
	for k, v := range c.headers {
		req.Header.Set(k, v)
	}
	rec := httptest.NewRecorder()
	d.e.srv.Handler().ServeHTTP(rec, req)
	out := resp{Code: rec.Code, Header: rec.Header(), Body: rec.Body.Bytes()}
	if c.want != 0 && out.Code != c.want {
		d.t.Errorf("%s %s: status %d, want %d: %.300s", c.method, c.path, out.Code, c.want, out.Body)
	}

	vreq := httptest.NewRequest(c.method, c.path, bytes.NewReader(raw))
	vreq.Header = req.Header.Clone()
	route, params, err := d.router.FindRoute(vreq)
	if err != nil {
		d.t.Errorf("%s %s: not in the document: %v", c.method, c.path, err)
		return out
	}
	if p := pending(route.Operation); p != "" && out.Code == 404 && bytes.Contains(out.Body, []byte("no route for")) {
		d.covered[route.Operation.OperationID]++
		return out
	}
	opts := &openapi3filter.Options{AuthenticationFunc: openapi3filter.NoopAuthenticationFunc, IncludeResponseStatus: true, MultiError: true}
	in := &openapi3filter.RequestValidationInput{Request: vreq, PathParams: params, Route: route, Options: opts}
	if c.strict {
		if err := openapi3filter.ValidateRequest(context.Background(), in); err != nil {
			d.t.Errorf("%s %s: the request does not match the document: %v", c.method, c.path, err)
		}
	}
	rin := &openapi3filter.ResponseValidationInput{RequestValidationInput: in, Status: out.Code, Header: out.Header,
		Body: io.NopCloser(bytes.NewReader(out.Body)), Options: opts}
	if err := openapi3filter.ValidateResponse(context.Background(), rin); err != nil {
		d.t.Errorf("%s %s: the response (%d %.200s) does not match the document: %v", c.method, c.path, out.Code, out.Body, err)
	}
	d.covered[route.Operation.OperationID]++
	return out
}

// The success paths the fake node supports, then every operation of the
// document once more with ids that do not exist: every answer, success or
// error, is one the document describes.
func TestOpenAPIHandlersMatchDocument(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	lg := &callLog{}
	node, node2 := newFakeNode(t, "w1", st), newFakeNode(t, "w2", st)
	attachLife(node, lg)
	attachLife(node2, lg)
	e.register(node, 10)
	e.register(node2, 10)
	d := newDocChecker(t, e)
	key := map[string]string{"X-API-Key": e.key}
	ok := func(method, path string, body any, want int) resp {
		t.Helper()
		return d.do(call{method: method, path: path, headers: key, body: body, want: want, strict: true})
	}

	ok("GET", "/health", nil, 200)
	ok("GET", "/openapi.yaml", nil, 200)
	ok("GET", "/openapi.json", nil, 200)

	var sb struct {
		SandboxID string `json:"sandboxID"`
	}
	ok("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "timeout": 60, "metadata": map[string]string{"a": "b"}}, 201).decode(t, &sb)
	ok("POST", "/sandboxes", map[string]any{"templateID": "base"}, 201)
	ok("GET", "/sandboxes", nil, 200)
	ok("GET", "/v2/sandboxes?state=running&limit=10", nil, 200)
	ok("GET", "/sandboxes/"+sb.SandboxID, nil, 200)
	ok("POST", "/sandboxes/"+sb.SandboxID+"/timeout", map[string]any{"timeout": 120}, 204)
	ok("GET", "/sandboxes/"+sb.SandboxID+"/metrics", nil, 200)
	ok("PUT", "/sandboxes/"+sb.SandboxID+"/network", map[string]any{"allowOut": []string{"1.1.1.1"}}, 204)
	ok("GET", "/space/v1/sandboxes/"+sb.SandboxID+"/executions", nil, 200)
	ok("GET", "/space/v1/workers", nil, 200)
	ok("GET", "/snapshots", nil, 200)
	ok("GET", "/templates", nil, 200)
	ok("GET", "/templates/aliases/base", nil, 200)
	ok("POST", "/v3/templates", map[string]any{"name": "mytpl"}, 202)
	ok("GET", "/templates/mytpl", nil, 200)
	ok("GET", "/templates/mytpl/tags", nil, 200)

	var sec struct {
		SecretID string `json:"secretID"`
	}
	ok("POST", "/secrets", map[string]any{"name": "tok", "value": "v1"}, 201).decode(t, &sec)
	ok("GET", "/secrets", nil, 200)
	ok("GET", "/secrets/"+sec.SecretID, nil, 200)
	ok("POST", "/secrets/"+sec.SecretID, map[string]any{"value": "v2"}, 200)
	ok("DELETE", "/secrets/"+sec.SecretID, nil, 204)

	var vol struct {
		VolumeID string `json:"volumeID"`
	}
	ok("POST", "/volumes", map[string]any{"name": "vol1"}, 201).decode(t, &vol)
	ok("GET", "/volumes", nil, 200)
	ok("GET", "/volumes/"+vol.VolumeID, nil, 200)
	ok("DELETE", "/volumes/"+vol.VolumeID, nil, 204)

	// Teams, keys, tokens.
	ok("GET", "/teams", nil, 200)
	var k struct {
		ID  string `json:"id"`
		Key string `json:"key"`
	}
	ok("POST", "/api-keys", map[string]any{"name": "ci"}, 201).decode(t, &k)
	ok("GET", "/api-keys", nil, 200)
	ok("PATCH", "/api-keys/"+k.ID, map[string]any{"name": "ci-2"}, 200)
	ok("DELETE", "/api-keys/"+k.ID, nil, 204)
	var inv struct {
		ID          string `json:"id"`
		AccessToken struct {
			Token string `json:"token"`
		} `json:"accessToken"`
	}
	ok("POST", "/teams/default/users", map[string]any{"email": "ann@example.com", "role": "admin"}, 201).decode(t, &inv)
	ok("GET", "/teams/default/users", nil, 200)
	user := map[string]string{"Authorization": "Bearer " + inv.AccessToken.Token}
	tok := func(method, path string, body any, want int) resp {
		t.Helper()
		return d.do(call{method: method, path: path, headers: user, body: body, want: want, strict: true})
	}
	tok("GET", "/teams", nil, 200)
	tok("POST", "/teams", map[string]any{"name": "second"}, 201)
	var at struct {
		ID string `json:"id"`
	}
	tok("POST", "/access-tokens", map[string]any{"name": "laptop"}, 201).decode(t, &at)
	tok("GET", "/access-tokens", nil, 200)
	tok("DELETE", "/access-tokens/"+at.ID, nil, 204)
	tok("GET", "/sandboxes", nil, 200)
	ok("DELETE", "/teams/default/users/"+inv.ID, nil, 204)

	// The lifecycle, on the fake workers.
	var snap struct {
		SnapshotID string `json:"snapshotID"`
	}
	ok("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", map[string]any{"name": "snap1"}, 201).decode(t, &snap)
	ok("GET", "/snapshots?sandboxID="+sb.SandboxID, nil, 200)
	ok("POST", "/sandboxes/"+sb.SandboxID+"/fork", map[string]any{"count": 1}, 201)
	ok("POST", "/sandboxes/"+sb.SandboxID+"/pause", map[string]any{}, 204)
	ok("POST", "/sandboxes/"+sb.SandboxID+"/connect", map[string]any{"timeout": 60}, 201)
	ok("POST", "/sandboxes/"+sb.SandboxID+"/connect", map[string]any{"timeout": 60}, 200)
	ok("POST", "/sandboxes/"+sb.SandboxID+"/pause", nil, 204)
	ok("POST", "/v2/sandboxes/"+sb.SandboxID+"/connect", map[string]any{"timeout": 60}, 201)
	ok("POST", "/sandboxes/"+sb.SandboxID+"/pause", nil, 204)
	ok("POST", "/sandboxes/"+sb.SandboxID+"/resume", map[string]any{"timeout": 60}, 201)
	ok("POST", "/space/v1/sandboxes/"+sb.SandboxID+"/migrate", map[string]any{}, 200)
	ok("POST", "/space/v1/sandboxes/"+sb.SandboxID+"/capabilities", map[string]any{"purpose": "envd"}, 0)
	ok("DELETE", "/templates/"+snap.SnapshotID, nil, 204)

	ok("POST", "/space/v1/keys/rotate", nil, 200)
	ok("DELETE", "/sandboxes/"+sb.SandboxID, nil, 204)

	// Every operation, with ids that do not exist and no body.
	for _, o := range docOps(d.doc) {
		path := strings.ReplaceAll(samplePath(o.path), "p0x1", "nosuchid0000000000000")
		if strings.HasPrefix(o.path, "/volumecontent/") || o.path == "/template-files/{team}/{hash}" {
			path += "?path=/x"
		}
		d.do(call{method: o.method, path: path, headers: key})
	}
	for _, o := range docOps(d.doc) {
		if d.covered[o.op.OperationID] == 0 {
			t.Errorf("%s %s (%s) was never exercised", o.method, o.path, o.op.OperationID)
		}
	}
	t.Logf("validated %d operations", len(d.covered))
}

// A handler that drifts from the document fails the check: the checker
// itself, against a handler answering another shape.
func TestOpenAPIHandlerCheckerCatches(t *testing.T) {
	e := newEnv(t, openStore(t), nil)
	real := e.srv.handler
	t.Cleanup(func() { e.srv.handler = real })
	for name, h := range map[string]http.HandlerFunc{
		"missing required field": func(w http.ResponseWriter, r *http.Request) {
			writeJSON(w, 200, []map[string]any{{"teamID": "t", "name": "n", "isDefault": true}})
		},
		"wrong type": func(w http.ResponseWriter, r *http.Request) {
			writeJSON(w, 200, []map[string]any{{"teamID": "t", "name": "n", "apiKey": "", "isDefault": "yes"}})
		},
		"undocumented status": func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) },
		"error not in E2B's shape": func(w http.ResponseWriter, r *http.Request) {
			writeJSON(w, 500, map[string]any{"error": "boom"})
		},
	} {
		ft := &fakeT{}
		e.srv.handler = h
		d := newDocChecker(t, e)
		d.t = ft
		d.do(call{method: "GET", path: "/teams", headers: map[string]string{"X-API-Key": e.key}})
		if !ft.failed {
			t.Errorf("%s: the checker passed a drifting handler", name)
		}
	}
}

// reporter is the part of testing.T the checker reports to.
type reporter interface {
	Helper()
	Errorf(format string, a ...any)
}

// fakeT records a failure instead of failing the test.
type fakeT struct{ failed bool }

func (f *fakeT) Helper()                        {}
func (f *fakeT) Errorf(format string, a ...any) { f.failed = true; _ = fmt.Sprintf(format, a...) }
