package edge

import (
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
