package controlplane

import (
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
)

// The e2b SDK's getSignature, computed by the SDK itself (node) for these
// inputs: the format is pinned, not just self-consistent.
func TestExpectedFileSignatureMatchesSDK(t *testing.T) {
	for _, c := range []struct{ path, op, user, token, exp, want string }{
		{"/home/user/a.txt", "read", "", "tok", "", "v1_Zkbb3914oLJLvMBzCAHQhm2ydBLxbSx2eQUR/kLdvIY"},
		{"up.txt", "write", "root", "tok", "1700000000", "v1_6aW+EBoOxSlptzljsCYsQ6q7xYfbfxSvO/5J+xK/2lo"},
	} {
		if got := expectedFileSignature(c.path, c.op, c.user, c.token, c.exp); got != c.want {
			t.Errorf("signature(%q %q %q %q) = %s, want %s", c.path, c.op, c.user, c.exp, got, c.want)
		}
	}
}

// TestSignedFilesCapability: the edge forwards a signed /files URL's
// signature instead of an access token; the control plane verifies it
// against the sandbox's token, operation and expiry as envd does (401 for
// anything wrong), and bounds the authorization by the expiry.
func TestSignedFilesCapability(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	e.register(newFakeNode(t, "w1", st), 10)
	secure := createV2(t, e, map[string]any{"templateID": "base", "timeout": 300, "secure": true})
	tok := secure.EnvdAccessToken
	if tok == "" {
		t.Fatal("secure sandbox has no access token")
	}
	files := map[string]any{"purpose": "files"}
	edge := map[string]string{"X-API-Key": edgeKey}
	now := e.clock.Now().Unix()
	future, past := strconv.FormatInt(now+60, 10), strconv.FormatInt(now-1, 10)
	q := func(path, op, user, exp, sig string) string {
		v := url.Values{"signature": {sig}, "path": {path}, "username": {user}, "operation": {op}}
		if exp != "" {
			v.Set("signature_expiration", exp)
		}
		return "/space/v1/sandboxes/" + secure.SandboxID + "/capabilities?" + v.Encode()
	}
	sig := func(path, op, user, exp string) string { return expectedFileSignature(path, op, user, tok, exp) }
	cases := []struct {
		name    string
		path    string
		headers map[string]string
		body    any
		code    int
	}{
		{"read", q("/home/user/f", "read", "", "", sig("/home/user/f", "read", "", "")), edge, files, 200},
		{"write with user and expiry", q("f", "write", "root", future, sig("f", "write", "root", future)), edge, files, 200},
		{"read signature used for write", q("/home/user/f", "write", "", "", sig("/home/user/f", "read", "", "")), edge, files, 401},
		{"other path", q("/home/user/g", "read", "", "", sig("/home/user/f", "read", "", "")), edge, files, 401},
		{"other user", q("/home/user/f", "read", "root", "", sig("/home/user/f", "read", "", "")), edge, files, 401},
		{"expired", q("/home/user/f", "read", "", past, sig("/home/user/f", "read", "", past)), edge, files, 401},
		{"expiry moved", q("/home/user/f", "read", "", future, sig("/home/user/f", "read", "", past)), edge, files, 401},
		{"bad expiry", q("/home/user/f", "read", "", "soon", sig("/home/user/f", "read", "", "soon")), edge, files, 401},
		{"other token", q("/home/user/f", "read", "", "", expectedFileSignature("/home/user/f", "read", "", "nope", "")), edge, files, 401},
		{"unknown operation", q("/home/user/f", "list", "", "", sig("/home/user/f", "list", "", "")), edge, files, 401},
		{"not for process", q("/home/user/f", "read", "", "", sig("/home/user/f", "read", "", "")), edge, map[string]any{"purpose": "process"}, 401},
		{"only through the edge", q("/home/user/f", "read", "", "", sig("/home/user/f", "read", "", "")), nil, files, 401},
		{"no signature, no token", "/space/v1/sandboxes/" + secure.SandboxID + "/capabilities", edge, files, 401},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := e.do("POST", c.path, c.headers, c.body)
			if c.code != 200 {
				expectError(t, r, c.code)
				return
			}
			if r.Code != 200 {
				t.Fatalf("status %d: %s", r.Code, r.Body)
			}
			var cr spacev1.CapabilityResponse
			r.decode(t, &cr)
			if cr.Token == "" {
				t.Fatal("no capability")
			}
			if c.name == "write with user and expiry" {
				if want := time.Unix(now+61, 0); cr.AuthorizedUntil.After(want) {
					t.Fatalf("authorized until %v, want at most the signature's expiry %v", cr.AuthorizedUntil, want)
				}
			}
		})
	}
}
