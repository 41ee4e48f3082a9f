package controlplane

import (
	"strings"
	"testing"
)

// TestDashboardMounted: the control plane serves the dashboard's pages
// without a key, with its CSP, and its API still wants one.
func TestDashboardMounted(t *testing.T) {
	e := newEnv(t, openStore(t), nil)
	r := e.do("GET", "/dashboard/", nil, nil)
	if r.Code != 200 || !strings.Contains(string(r.Body), `src="app.js"`) || !strings.Contains(r.Header.Get("Content-Security-Policy"), "script-src 'self'") {
		t.Fatalf("GET /dashboard/: %d %q %.200s", r.Code, r.Header.Get("Content-Security-Policy"), r.Body)
	}
	if r := e.do("GET", "/dashboard", nil, nil); r.Code/100 != 3 || r.Header.Get("Location") != "/dashboard/" {
		t.Errorf("GET /dashboard: %d Location %q", r.Code, r.Header.Get("Location"))
	}
	if r := e.do("GET", "/dashboard/app.js", nil, nil); r.Code != 200 || !strings.HasPrefix(r.Header.Get("Content-Type"), "text/javascript") {
		t.Errorf("GET /dashboard/app.js: %d %q", r.Code, r.Header.Get("Content-Type"))
	}
	if r := e.do("POST", "/dashboard/", nil, nil); r.Code != 405 {
		t.Errorf("POST /dashboard/: %d", r.Code)
	}
	if r := e.do("GET", "/v2/sandboxes", nil, nil); r.Code != 401 {
		t.Errorf("GET /v2/sandboxes without a key: %d", r.Code)
	}
}
