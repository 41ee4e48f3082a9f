package dashboard

import (
	"crypto/sha256"
	"encoding/hex"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// sourcesHash is build.mjs's sourcesHash over web/dashboard: keep the two
// in step.
func sourcesHash(t *testing.T, dir string) string {
	t.Helper()
	files := []string{"package.json", "package-lock.json", "build.mjs"}
	err := filepath.WalkDir(filepath.Join(dir, "src"), func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		files = append(files, filepath.ToSlash(rel))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(files)
	h := sha256.New()
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(f)))
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(b)
		h.Write([]byte(f + "\x00" + hex.EncodeToString(sum[:]) + "\n"))
	}
	return hex.EncodeToString(h.Sum(nil))
}

// TestBundleCurrent fails when web/dashboard changed after the committed
// bundle was built: run `make dashboard` and commit internal/dashboard/assets.
func TestBundleCurrent(t *testing.T) {
	want := sourcesHash(t, filepath.Join("..", "..", "web", "dashboard"))
	got, err := fs.ReadFile(assets, "assets/sources.sha256")
	if err != nil {
		t.Fatalf("bundle has no sources.sha256: run `make dashboard`: %v", err)
	}
	if strings.TrimSpace(string(got)) != want {
		t.Fatalf("internal/dashboard/assets is stale (built from sources %s, sources now %s): run `make dashboard` and commit the bundle",
			strings.TrimSpace(string(got)), want)
	}
	for _, f := range []string{"index.html", "app.js", "app.css"} {
		if st, err := fs.Stat(assets, "assets/"+f); err != nil || st.Size() == 0 {
			t.Errorf("bundle lacks %s: %v", f, err)
		}
	}
}

// TestNoInlineCode: the page works under its CSP only if it has no inline
// script or style, and it loads nothing from another origin.
func TestNoInlineCode(t *testing.T) {
	b, err := fs.ReadFile(assets, "assets/index.html")
	if err != nil {
		t.Fatal(err)
	}
	html := string(b)
	for _, re := range []string{`<script(?:[^>](?:[^s]|s[^r]|sr[^c]))*?>\s*\S`, `<style`, `\sstyle=`, `\son[a-z]+=`, `(?:src|href)="(?:https?:)?//`} {
		if m := regexp.MustCompile(`(?i)` + re).FindString(html); m != "" {
			t.Errorf("index.html has %q (forbidden by the CSP or third-party)", m)
		}
	}
	// The bundle names no other origin (XML namespace names are not fetched).
	for _, f := range []string{"assets/app.js", "assets/app.css"} {
		b, err := fs.ReadFile(assets, f)
		if err != nil {
			t.Fatal(err)
		}
		for _, u := range regexp.MustCompile(`(?i)(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}[^\s"'\x60)]*`).FindAllString(string(b), -1) {
			if !strings.HasPrefix(u, "http://www.w3.org/") {
				t.Errorf("%s names %s: the dashboard loads nothing third-party", f, u)
			}
		}
	}
	if !strings.Contains(html, `<script type="module" src="app.js"></script>`) {
		t.Errorf("index.html does not load app.js as a module:\n%s", html)
	}
}

func get(t *testing.T, h http.Handler, method, path string, hdr ...string) *httptest.ResponseRecorder {
	t.Helper()
	r := httptest.NewRequest(method, path, nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Set(hdr[i], hdr[i+1])
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

func TestHandler(t *testing.T) {
	h := Handler()
	for _, tc := range []struct {
		method, path string
		code         int
		ctype        string
		body         string
	}{
		{"GET", "/dashboard/", 200, "text/html; charset=utf-8", `<div id="app">`},
		{"HEAD", "/dashboard/", 200, "text/html; charset=utf-8", ""},
		{"GET", "/dashboard/index.html", 200, "text/html; charset=utf-8", `<div id="app">`},
		{"GET", "/dashboard/app.js", 200, "text/javascript; charset=utf-8", ""},
		{"GET", "/dashboard/app.css", 200, "text/css; charset=utf-8", ""},
		{"GET", "/dashboard", 301, "", ""},
		{"GET", "/dashboard/nope.js", 404, "", ""},
		{"GET", "/dashboard/sources.sha256", 404, "", ""},
		{"GET", "/dashboard/../go.mod", 404, "", ""},
		{"GET", "/dashboard//app.js", 404, "", ""},
		{"GET", "/dashboardx/app.js", 404, "", ""},
		{"POST", "/dashboard/", 405, "", ""},
		{"DELETE", "/dashboard/app.js", 405, "", ""},
	} {
		w := get(t, h, tc.method, tc.path)
		if w.Code != tc.code {
			t.Errorf("%s %s: %d, want %d", tc.method, tc.path, w.Code, tc.code)
			continue
		}
		if got := w.Header().Get("Content-Security-Policy"); got != ContentSecurityPolicy {
			t.Errorf("%s %s: CSP %q", tc.method, tc.path, got)
		}
		if w.Header().Get("X-Frame-Options") != "DENY" || w.Header().Get("X-Content-Type-Options") != "nosniff" {
			t.Errorf("%s %s: headers %v", tc.method, tc.path, w.Header())
		}
		if tc.ctype != "" && w.Header().Get("Content-Type") != tc.ctype {
			t.Errorf("%s %s: Content-Type %q, want %q", tc.method, tc.path, w.Header().Get("Content-Type"), tc.ctype)
		}
		if tc.body != "" && !strings.Contains(w.Body.String(), tc.body) {
			t.Errorf("%s %s: body lacks %q", tc.method, tc.path, tc.body)
		}
		if tc.code == 301 && w.Header().Get("Location") != Prefix {
			t.Errorf("%s %s: Location %q", tc.method, tc.path, w.Header().Get("Location"))
		}
	}
	if !strings.Contains(ContentSecurityPolicy, "script-src 'self'") || strings.Contains(ContentSecurityPolicy, "unsafe") {
		t.Errorf("CSP allows inline code: %s", ContentSecurityPolicy)
	}
}

// TestRevalidate: a reload with the current ETag is 304, so the browser
// checks on every load yet downloads the bundle only after an upgrade.
func TestRevalidate(t *testing.T) {
	h := Handler()
	for _, p := range []string{"/dashboard/", "/dashboard/app.js"} {
		w := get(t, h, "GET", p)
		etag := w.Header().Get("ETag")
		if etag == "" || w.Header().Get("Cache-Control") != "no-cache" {
			t.Fatalf("%s: ETag %q Cache-Control %q", p, etag, w.Header().Get("Cache-Control"))
		}
		if w := get(t, h, "GET", p, "If-None-Match", etag); w.Code != http.StatusNotModified {
			t.Errorf("%s with its ETag: %d, want 304", p, w.Code)
		}
		if w := get(t, h, "GET", p, "If-None-Match", `"old"`); w.Code != http.StatusOK {
			t.Errorf("%s with an old ETag: %d, want 200", p, w.Code)
		}
	}
}

// FuzzHandler: whatever the path, the handler answers a status (never a
// panic or a 5xx), with its CSP, and serves only the bundle's files.
func FuzzHandler(f *testing.F) {
	for _, s := range []string{"/dashboard/", "/dashboard/app.js", "/dashboard/../assets/app.js", "/dashboard/%2e%2e/x", "/dashboard//", "/dashboard/assets/index.html", "/dashboard/sources.sha256", "/x"} {
		f.Add(s)
	}
	h := Handler()
	served := map[string]bool{"/dashboard/": true, "/dashboard/index.html": true, "/dashboard/app.js": true, "/dashboard/app.css": true}
	f.Fuzz(func(t *testing.T, p string) {
		r, err := http.NewRequest("GET", "http://h"+p, nil)
		if err != nil || r.URL.Path == "" {
			return
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code >= 500 {
			t.Fatalf("%q: %d", p, w.Code)
		}
		if w.Header().Get("Content-Security-Policy") != ContentSecurityPolicy {
			t.Fatalf("%q: no CSP", p)
		}
		if w.Code == http.StatusOK && !served[r.URL.Path] {
			t.Fatalf("%q (path %q): 200, want only the bundle's files", p, r.URL.Path)
		}
	})
}

// TestSourcesHashSeesChanges: the stale check notices an edited, an added
// and a removed source file (a copy of web/dashboard is changed).
func TestSourcesHashSeesChanges(t *testing.T) {
	src := filepath.Join("..", "..", "web", "dashboard")
	dir := t.TempDir()
	// The sources only: node_modules (in a built tree) is not one.
	if err := os.CopyFS(filepath.Join(dir, "src"), os.DirFS(filepath.Join(src, "src"))); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"package.json", "package-lock.json", "build.mjs"} {
		b, err := os.ReadFile(filepath.Join(src, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	base := sourcesHash(t, dir)
	if base != sourcesHash(t, src) {
		t.Fatal("a copy hashes differently")
	}
	for name, change := range map[string]func(string) error{
		"edited": func(d string) error {
			return os.WriteFile(filepath.Join(d, "src", "main.jsx"), []byte("// changed\n"), 0o644)
		},
		"added": func(d string) error {
			return os.WriteFile(filepath.Join(d, "src", "new.js"), nil, 0o644)
		},
		"removed": func(d string) error { return os.Remove(filepath.Join(d, "src", "style.css")) },
		"lock":    func(d string) error { return os.WriteFile(filepath.Join(d, "package-lock.json"), []byte("{}"), 0o644) },
	} {
		d := filepath.Join(t.TempDir(), name)
		if err := os.CopyFS(d, os.DirFS(dir)); err != nil {
			t.Fatal(err)
		}
		if err := change(d); err != nil {
			t.Fatal(err)
		}
		if sourcesHash(t, d) == base {
			t.Errorf("%s source file: hash unchanged", name)
		}
	}
}
