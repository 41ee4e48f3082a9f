package controlplane

import (
	"net/url"
	"strconv"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
)

// TestSignedFilesSandbox: for a signed /files URL that names no sandbox
// (built on E2B_SANDBOX_URL), the edge learns the sandbox whose access
// token made the signature; nothing else matches (401 with envd's words),
// only the edge may ask, and a killed sandbox is no candidate.
func TestSignedFilesSandbox(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	e.register(newFakeNode(t, "w1", st), 10)
	a := createV2(t, e, map[string]any{"templateID": "base", "timeout": 300, "secure": true})
	b := createV2(t, e, map[string]any{"templateID": "base", "timeout": 300, "secure": true})
	edge := map[string]string{"X-API-Key": edgeKey}
	past := strconv.FormatInt(e.clock.Now().Unix()-10, 10)
	ask := func(headers map[string]string, path, op, user, exp, sig string) resp {
		v := url.Values{"signature": {sig}, "path": {path}, "username": {user}, "operation": {op}}
		if exp != "" {
			v.Set("signature_expiration", exp)
		}
		return e.do("POST", spacev1.PathSignedFilesSandbox+"?"+v.Encode(), headers, nil)
	}
	for _, sb := range []struct {
		id, tok string
	}{{a.SandboxID, a.EnvdAccessToken}, {b.SandboxID, b.EnvdAccessToken}} {
		for _, c := range []struct{ path, op, user, exp string }{
			{"/home/user/f", "read", "user", ""}, {"/root/f", "write", "root", "1900000000"},
			// An expired signature still names its sandbox: the
			// capability request then answers "signature is already expired".
			{"/home/user/f", "read", "", past},
		} {
			r := ask(edge, c.path, c.op, c.user, c.exp, expectedFileSignature(c.path, c.op, c.user, sb.tok, c.exp))
			if r.Code != 200 {
				t.Fatalf("%+v: %d %s", c, r.Code, r.Body)
			}
			var got spacev1.SignedFilesSandbox
			r.decode(t, &got)
			if got.SandboxID != sb.id {
				t.Fatalf("%+v: sandbox %q, want %q", c, got.SandboxID, sb.id)
			}
		}
	}
	good := expectedFileSignature("/home/user/f", "read", "user", a.EnvdAccessToken, "")
	for name, r := range map[string]resp{
		"other path":        ask(edge, "/home/user/g", "read", "user", "", good),
		"other user":        ask(edge, "/home/user/f", "read", "root", "", good),
		"other operation":   ask(edge, "/home/user/f", "write", "user", "", good),
		"expiration added":  ask(edge, "/home/user/f", "read", "user", "1900000000", good),
		"unknown operation": ask(edge, "/home/user/f", "list", "user", "", good),
		"malformed":         ask(edge, "/home/user/f", "read", "user", "", "v1_short"),
		"no signature":      e.do("POST", spacev1.PathSignedFilesSandbox+"?path=/x&operation=read", edge, nil),
		"unknown token":     ask(edge, "/home/user/f", "read", "user", "", expectedFileSignature("/home/user/f", "read", "user", "nope", "")),
	} {
		expectError(t, r, 401)
		var body spacev1.Error
		r.decode(t, &body)
		if body.Message != "invalid signature" {
			t.Errorf("%s: message %q", name, body.Message)
		}
	}
	expectError(t, ask(map[string]string{"X-API-Key": e.key}, "/home/user/f", "read", "user", "", good), 403)
	expectError(t, ask(nil, "/home/user/f", "read", "user", "", good), 401)

	if r := e.api("DELETE", "/sandboxes/"+a.SandboxID, nil); r.Code != 204 {
		t.Fatalf("kill: %d %s", r.Code, r.Body)
	}
	expectError(t, ask(edge, "/home/user/f", "read", "user", "", good), 401)
}
