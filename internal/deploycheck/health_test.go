package deploycheck

import (
	"context"
	"io"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// edgeKeyEnv is a test edge key (16..256 bytes).
const edgeKeyEnv = "SPACE_EDGE_KEY=test-edge-key-0123456789abcdef"

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// startServer runs binDir/bin with args until the test ends.
func startServer(t *testing.T, env []string, bin string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, filepath.Join(binDir, bin), args...)
	cmd.Env = append([]string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}, env...)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = io.Discard, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("%s output:\n%s", bin, out.String())
		}
	})
}

// get polls url until it answers 200 (or 30 s pass) and returns the body.
func get(t *testing.T, url string) string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(url)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return string(body)
			}
			err = &net.AddrError{Err: resp.Status, Addr: url}
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET %s: %v", url, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// The health paths the manifests probe are the ones the binaries serve:
// space-api's /health (with its store answering: an embedded etcd here)
// and space-edge's /healthz, each on its main listener, and /metrics on
// the metrics listener. (space-node's is spacev1.NodePathHealth, served by
// node-api; running a worker needs root.)
func TestHealthEndpoints(t *testing.T) {
	binFlags(t)
	health := kubeRules(t).Health
	api, apiMetrics := freePort(t), freePort(t)
	startServer(t, []string{edgeKeyEnv}, "space-api", "--addr="+api, "--metrics-addr="+apiMetrics, "--data-dir="+t.TempDir())
	edge, edgeMetrics := freePort(t), freePort(t)
	startServer(t, []string{edgeKeyEnv}, "space-edge", "--addr="+edge, "--metrics-addr="+edgeMetrics, "--control-plane=http://"+api)
	if b := get(t, "http://"+api+health["space-api"]); !strings.Contains(b, `"ok"`) {
		t.Errorf("space-api %s: %q", health["space-api"], b)
	}
	if b := get(t, "http://"+edge+health["space-edge"]); strings.TrimSpace(b) != "ok" {
		t.Errorf("space-edge %s: %q", health["space-edge"], b)
	}
	for _, m := range []string{apiMetrics, edgeMetrics} {
		if b := get(t, "http://"+m+"/metrics"); !strings.Contains(b, "go_goroutines") {
			t.Errorf("%s/metrics: no Go collector", m)
		}
	}
	// A path the probes must not use is not a health check there.
	resp, err := http.Get("http://" + edge + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode == http.StatusOK {
		t.Errorf("space-edge answers 200 on /health too: the checker's table would not catch a wrong probe")
	}
}
