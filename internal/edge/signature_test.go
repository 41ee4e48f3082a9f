package edge

import (
	"encoding/json"
	"net/http"
	"net/url"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
)

// TestSignedFilesURL: a signed uploadUrl/downloadUrl request carries no
// access token; the edge forwards its signature, path, username and the
// operation its method signs to the control plane, and caches the
// authorization per signed URL, never for another path or operation.
func TestSignedFilesURL(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	h.cp.tokens["sbx1"] = "tok"
	get := func(method, path string, q url.Values) int {
		t.Helper()
		res := h.envd(method, "sbx1", path+"?"+q.Encode(), "")
		readAll(t, res)
		return res.StatusCode
	}
	q := url.Values{"path": {"/home/user/f"}, "username": {"root"}, "signature": {"sig-tok"}, "signature_expiration": {"1700000000"}}
	if code := get("GET", "/files", q); code != 200 {
		t.Fatalf("signed GET: %d", code)
	}
	cps := h.cp.callsCopy()
	if len(cps) != 1 || cps[0].AccessToken != "" || cps[0].Req.Purpose != "files" {
		t.Fatalf("cp calls: %+v", cps)
	}
	want := url.Values{"signature": {"sig-tok"}, "signature_expiration": {"1700000000"}, "path": {"/home/user/f"},
		"username": {"root"}, "operation": {"read"}}
	if got := cps[0].Query; got.Encode() != want.Encode() {
		t.Fatalf("forwarded %v, want %v", got, want)
	}
	if calls := h.node.callsCopy(); len(calls) != 1 || calls[0].Header.Get(spacev1.HeaderAccessToken) != "" {
		t.Fatalf("node calls: %+v", calls)
	}
	// Same URL again: cached.
	if code := get("GET", "/files", q); code != 200 || len(h.cp.callsCopy()) != 1 {
		t.Fatalf("repeat: %d, cp calls %d", code, len(h.cp.callsCopy()))
	}
	// POST signs "write": a separate authorization.
	if code := get("POST", "/files", q); code != 200 {
		t.Fatalf("signed POST: %d", code)
	}
	cps = h.cp.callsCopy()
	if len(cps) != 2 || cps[1].Query.Get("operation") != "write" {
		t.Fatalf("cp calls: %+v", cps)
	}
	// Another path with the same signature is authorized anew (and refused).
	q2 := url.Values{"path": {"/home/user/g"}, "signature": {"bad"}}
	if code := get("GET", "/files", q2); code != 401 || len(h.cp.callsCopy()) != 3 {
		t.Fatalf("bad signature: %d, cp calls %d", code, len(h.cp.callsCopy()))
	}
	// Signatures stand in for the token on /files only, and never for
	// other methods.
	if code := get("POST", "/filesystem.Filesystem/Stat", q); code != 401 {
		t.Fatalf("signature on RPC: %d", code)
	}
	if code := get("DELETE", "/files", q); code != 401 {
		t.Fatalf("signature on DELETE: %d", code)
	}
	for _, c := range h.cp.callsCopy()[3:] {
		if c.Query.Has("signature") {
			t.Fatalf("signature forwarded for %+v", c)
		}
	}
}

// TestSignedURLNamingNoSandbox: a signed /files URL built on
// E2B_SANDBOX_URL carries neither the sandbox headers nor a sandbox host;
// the control plane names the sandbox from the signature (once per URL),
// then it is authorized like any signed URL. An unknown signature is 401
// with envd's words; an unsigned request still names no sandbox (400).
func TestSignedURLNamingNoSandbox(t *testing.T) {
	h := newHarness(t)
	h.sandbox("sbx1")
	h.sandbox("sbx2")
	h.cp.tokens["sbx1"], h.cp.tokens["sbx2"] = "tok1", "tok2"
	get := func(method string, q url.Values, hdr ...string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, h.srv.URL+"/files?"+q.Encode(), nil)
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		res, err := h.cl.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return res.StatusCode, readAll(t, res)
	}
	q := url.Values{"path": {"/home/user/f"}, "username": {"user"}, "signature": {"sig-tok2"}}
	for range 2 {
		if code, body := get("GET", q); code != 200 {
			t.Fatalf("signed GET naming no sandbox: %d %s", code, body)
		}
	}
	lookups := func() int {
		h.cp.mu.Lock()
		defer h.cp.mu.Unlock()
		return h.cp.lookups
	}
	if n := lookups(); n != 1 {
		t.Fatalf("lookups %d, want 1 (the answer is kept)", n)
	}
	cps := h.cp.callsCopy()
	if last := cps[len(cps)-1]; last.Sandbox != "sbx2" || last.Query.Get("signature") != "sig-tok2" {
		t.Fatalf("capability request: %+v", last)
	}
	if code, _ := get("POST", q); code != 200 {
		t.Fatalf("signed POST: %d", code)
	}
	bad := url.Values{"path": {"/home/user/f"}, "signature": {"sig-nope"}}
	code, body := get("GET", bad)
	var e spacev1.Error
	if code != 401 || json.Unmarshal([]byte(body), &e) != nil || e.Code != 401 || e.Message != "invalid signature" {
		t.Fatalf("unknown signature: %d %s", code, body)
	}
	// Not a signed URL: no lookup, no sandbox.
	if code, _ := get("DELETE", q); code != 400 {
		t.Fatalf("DELETE with a signature: %d", code)
	}
	if code, _ := get("GET", url.Values{"path": {"/x"}}); code != 400 {
		t.Fatalf("unsigned: %d", code)
	}
	// With an access token the caller meant the token, not the signature.
	if code, _ := get("GET", q, spacev1.HeaderAccessToken, "tok2"); code != 400 {
		t.Fatalf("token and no sandbox: %d", code)
	}
	// POST (another operation) and the unknown signature asked; nothing
	// after them did.
	if n := lookups(); n != 3 {
		t.Fatalf("lookups %d, want 3", n)
	}
}
