//go:build linux

package oci

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"

	"github.com/spacesbx/space/internal/testenv"
)

const registryBin = "/usr/bin/docker-registry"

// testRegistry is Debian's docker-registry (the CNCF distribution
// registry) serving a temp dir on loopback.
type testRegistry struct {
	Host    string // 127.0.0.1:port
	Storage string // its filesystem driver's root
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startRegistry starts a registry; with user != "" it requires HTTP basic
// auth (htpasswd, bcrypt) for user/password.
func startRegistry(t testing.TB, user, password string) *testRegistry {
	t.Helper()
	if _, err := os.Stat(registryBin); err != nil {
		testenv.Skipf(t, "%s missing (make registry-deps installs Debian's docker-registry): %v", registryBin, err)
	}
	// The free port is free only until something else takes it: a
	// registry that exits at once gets another port.
	for attempt := 1; ; attempt++ {
		reg, out, err := tryStartRegistry(t, user, password)
		if err == nil {
			return reg
		}
		if attempt == 3 {
			t.Fatalf("docker-registry: %v\n%s", err, out)
		}
	}
}

func tryStartRegistry(t testing.TB, user, password string) (*testRegistry, string, error) {
	t.Helper()
	dir := t.TempDir()
	storage := filepath.Join(dir, "storage")
	host := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	cfg := fmt.Sprintf(`version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %s
http:
  addr: %s
`, storage, host)
	if user != "" {
		hash, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.MinCost)
		if err != nil {
			t.Fatal(err)
		}
		htp := filepath.Join(dir, "htpasswd")
		if err := os.WriteFile(htp, []byte(user+":"+string(hash)+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg += fmt.Sprintf("auth:\n  htpasswd:\n    realm: space-test\n    path: %s\n", htp)
	}
	cfgPath := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	var out syncBuffer
	cmd := exec.Command(registryBin, "serve", cfgPath)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	deadline := time.Now().Add(15 * time.Second)
	probe := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	for {
		resp, err := probe.Get("http://" + host + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusUnauthorized {
				break
			}
		}
		select {
		case err := <-exited:
			exited <- err
			return nil, out.String(), fmt.Errorf("exited: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("docker-registry not ready on %s: %v\n%s", host, err, out.String())
		}
		time.Sleep(30 * time.Millisecond)
	}
	return &testRegistry{Host: host, Storage: storage}, "", nil
}

// blobPath is where the filesystem driver keeps a blob.
func (r *testRegistry) blobPath(digest string) string {
	hex := strings.TrimPrefix(digest, "sha256:")
	return filepath.Join(r.Storage, "docker/registry/v2/blobs/sha256", hex[:2], hex, "data")
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
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
