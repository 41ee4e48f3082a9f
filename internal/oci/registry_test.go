//go:build linux

package oci

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/testenv"
)

// testRegistry is Debian's docker-registry on loopback (testenv.StartRegistry).
type testRegistry struct{ *testenv.Registry }

func startRegistry(t testing.TB, user, password string) *testRegistry {
	t.Helper()
	return &testRegistry{testenv.StartRegistry(t, user, password)}
}

// blobPath is where the filesystem driver keeps a blob.
func (r *testRegistry) blobPath(digest string) string {
	hex := strings.TrimPrefix(digest, "sha256:")
	return filepath.Join(r.Storage, "docker/registry/v2/blobs/sha256", hex[:2], hex, "data")
}

// proxy sits in front of a registry: it counts blob downloads per digest
// and, with a token user set, plays a registry's token flow (401 with a
// Bearer challenge, a /token realm checking basic credentials, then only
// requests bearing the token it issued go through).
type proxy struct {
	Host string

	mu    sync.Mutex
	blobs map[string]int

	tokenUser, tokenPass string
	token                string
}

func startProxy(t testing.TB, upstream string, tokenUser, tokenPass string) *proxy {
	t.Helper()
	p := &proxy{blobs: map[string]int{}, tokenUser: tokenUser, tokenPass: tokenPass, token: "tok-" + fmt.Sprint(time.Now().UnixNano())}
	u, _ := url.Parse("http://" + upstream)
	rp := httputil.NewSingleHostReverseProxy(u)
	tr := &http.Transport{}
	rp.Transport = tr
	t.Cleanup(tr.CloseIdleConnections)
	srv := httptest.NewUnstartedServer(nil)
	srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p.tokenUser != "" {
			if r.URL.Path == "/token" {
				user, pass, ok := r.BasicAuth()
				if !ok || user != p.tokenUser || pass != p.tokenPass {
					http.Error(w, `{"errors":[{"code":"UNAUTHORIZED","message":"bad credentials"}]}`, http.StatusUnauthorized)
					return
				}
				w.Header().Set("Content-Type", "application/json")
				_ = json.NewEncoder(w).Encode(map[string]any{"token": p.token, "expires_in": 300})
				return
			}
			if r.Header.Get("Authorization") != "Bearer "+p.token {
				w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm="http://%s/token",service="space-test"`, r.Host))
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusUnauthorized)
				_, _ = w.Write([]byte(`{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`))
				return
			}
			r.Header.Del("Authorization")
		}
		if i := strings.Index(r.URL.Path, "/blobs/"); i >= 0 && r.Method == http.MethodGet {
			p.mu.Lock()
			p.blobs[r.URL.Path[i+len("/blobs/"):]]++
			p.mu.Unlock()
		}
		rp.ServeHTTP(w, r)
	})
	srv.Start()
	t.Cleanup(srv.Close)
	p.Host = strings.TrimPrefix(srv.URL, "http://")
	return p
}

func (p *proxy) blobGets(digest string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.blobs[digest]
}

func (p *proxy) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.blobs = map[string]int{}
}
