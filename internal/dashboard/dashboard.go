// Package dashboard serves SPACE's web dashboard: a static single-page app
// (web/dashboard, built by `make dashboard`) embedded in the binary. The
// pages are public; every API call the page makes carries the API key or
// access token the user typed, kept in the tab's sessionStorage (never a
// cookie, so the API cannot be driven cross-site through the page).
//
// The built bundle is committed so that a fresh clone builds without npm;
// sources.sha256 in it is the hash of the sources it was built from, and
// this package's test fails when the sources have changed since.
package dashboard

import (
	"embed"
	"io/fs"
	"net/http"
	"path"
	"strings"
)

//go:embed assets
var assets embed.FS

// ContentSecurityPolicy is sent with every response: scripts and styles
// only from the page's own origin (no inline script), API calls to the
// same origin only, nothing third-party, no framing.
const ContentSecurityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; " +
	"connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"

// Prefix is where the dashboard is mounted.
const Prefix = "/dashboard/"

// Handler serves the dashboard under Prefix (GET and HEAD; "/dashboard"
// redirects to Prefix). Unknown paths are 404.
func Handler() http.Handler {
	sub, err := fs.Sub(assets, "assets")
	if err != nil {
		panic("dashboard: embedded assets missing: " + err.Error()) // a build defect, not a runtime condition
	}
	etag := `"` + strings.TrimSpace(readString(sub, "sources.sha256")) + `"`
	files := http.FileServerFS(sub)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", ContentSecurityPolicy)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cross-Origin-Opener-Policy", "same-origin")
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			h.Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		if r.URL.Path == strings.TrimSuffix(Prefix, "/") {
			http.Redirect(w, r, Prefix, http.StatusMovedPermanently)
			return
		}
		name, ok := strings.CutPrefix(r.URL.Path, Prefix)
		if !ok || name == "sources.sha256" {
			http.NotFound(w, r)
			return
		}
		if name == "" {
			name = "index.html"
		}
		if name != path.Clean(name) || !fs.ValidPath(name) {
			http.NotFound(w, r)
			return
		}
		if st, err := fs.Stat(sub, name); err != nil || st.IsDir() {
			http.NotFound(w, r)
			return
		}
		// Revalidated on every load (the bundle's names carry no hash):
		// the ETag is the sources' hash, so an upgrade is seen at once.
		h.Set("Cache-Control", "no-cache")
		h.Set("ETag", etag)
		r2 := r.Clone(r.Context())
		r2.URL.Path = "/" + name
		if name == "index.html" {
			// FileServer redirects /index.html to ./; serve the file itself.
			serveIndex(w, r2, sub)
			return
		}
		files.ServeHTTP(w, r2)
	})
}

func serveIndex(w http.ResponseWriter, r *http.Request, sub fs.FS) {
	b, err := fs.ReadFile(sub, "index.html")
	if err != nil {
		http.Error(w, "dashboard not built", http.StatusInternalServerError)
		return
	}
	if match := r.Header.Get("If-None-Match"); match != "" && match == w.Header().Get("ETag") {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		_, _ = w.Write(b)
	}
}

func readString(fsys fs.FS, name string) string {
	b, err := fs.ReadFile(fsys, name)
	if err != nil {
		return ""
	}
	return string(b)
}
