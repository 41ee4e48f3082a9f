package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/hostsim"
	"github.com/spacesbx/space/internal/node"
	"github.com/spacesbx/space/internal/testenv"
)

// Fixed ports on every host (each host has its own addresses).
const (
	etcdClientPort = 2379
	etcdPeerPort   = 2380
	apiPort        = 3000
	edgePort       = 3001
	nodePort       = 7000

	apiKey  = testenv.TestAPIKey
	edgeKey = "cluster-test-edge-key-5ace5ace5ace5ace"
)

// hostEnv is the environment of every process on a host: no variable of
// the test's own (SPACE_* would reach the binaries).
var hostEnv = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8"}

// cluster is the running SPACE: hosts, processes, and the URLs the client
// uses (from its own host).
type cluster struct {
	t       testing.TB
	net     *hostsim.Net
	bin     string
	dir     string
	snapDir string
	client  *hostsim.Host
	http    *http.Client

	etcd    []*hostsim.Host // e1..e3
	apis    []*hostsim.Host // api1, api2
	edges   []*hostsim.Host // edge1, edge2
	workers []*hostsim.Host // w1..w3

	// edgeFailover: space-edge takes several control planes
	// (--control-plane a,b, slice C); without it edge i names api i only.
	edgeFailover bool
}

func (c *cluster) etcdEndpoints() string {
	var eps []string
	for _, h := range c.etcd {
		eps = append(eps, fmt.Sprintf("http://%s", netip.AddrPortFrom(h.Addr(), etcdClientPort)))
	}
	return strings.Join(eps, ",")
}

func (c *cluster) apiURL(i int) string {
	return "http://" + netip.AddrPortFrom(c.apis[i].Addr(), apiPort).String()
}

func (c *cluster) edgeURL(i int) string {
	return "http://" + netip.AddrPortFrom(c.edges[i].Addr(), edgePort).String()
}

// startCluster starts etcd, the control planes, the edges and the workers
// on hosts of net, and waits until every worker is ready.
func startCluster(t *testing.T, n *hostsim.Net, bin, dir string) *cluster {
	t.Helper()
	c := &cluster{t: t, net: n, bin: bin, dir: dir, snapDir: filepath.Join(dir, "snapshots")}
	if err := os.MkdirAll(c.snapDir, 0o700); err != nil {
		t.Fatal(err)
	}
	mk := func(name string) *hostsim.Host {
		h, err := n.Host(name)
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	c.client = mk("client")
	tr := &http.Transport{DialContext: c.client.DialContext, MaxIdleConnsPerHost: 16, IdleConnTimeout: 30 * time.Second,
		ResponseHeaderTimeout: 60 * time.Second}
	t.Cleanup(tr.CloseIdleConnections)
	c.http = &http.Client{Transport: tr}
	for i := 1; i <= 3; i++ {
		c.etcd = append(c.etcd, mk(fmt.Sprintf("e%d", i)))
	}
	for i := 1; i <= 2; i++ {
		c.apis = append(c.apis, mk(fmt.Sprintf("api%d", i)))
		c.edges = append(c.edges, mk(fmt.Sprintf("edge%d", i)))
	}
	for i := 1; i <= 3; i++ {
		c.workers = append(c.workers, mk(fmt.Sprintf("w%d", i)))
	}
	c.edgeFailover = edgeTakesSeveral(bin)

	var cluster []string
	for i, h := range c.etcd {
		cluster = append(cluster, fmt.Sprintf("e%d=http://%s", i+1, netip.AddrPortFrom(h.Addr(), etcdPeerPort)))
	}
	for i, h := range c.etcd {
		c.startEtcd(h, fmt.Sprintf("e%d", i+1), filepath.Join(dir, h.Name()), strings.Join(cluster, ","))
	}
	for _, h := range c.etcd {
		c.waitHTTP(fmt.Sprintf("http://%s/health", netip.AddrPortFrom(h.Addr(), etcdClientPort)), 60*time.Second)
	}
	for i, h := range c.apis {
		c.start(h, "space-api", filepath.Join(bin, "space-api"), "--addr", netip.AddrPortFrom(h.Addr(), apiPort).String(),
			"--data-dir", filepath.Join(dir, h.Name()), "--etcd-endpoints", c.etcdEndpoints(), "--api-key", apiKey,
			"--sandbox-url", c.edgeURL(i), "--metrics-addr", "off", "--log-level", "info")
		c.waitHTTP(c.apiURL(i)+"/health", 60*time.Second)
	}
	for i, h := range c.edges {
		cp := c.apiURL(i)
		if c.edgeFailover {
			cp = c.apiURL(i) + "," + c.apiURL(1-i)
		}
		c.start(h, "space-edge", filepath.Join(bin, "space-edge"), "--addr", netip.AddrPortFrom(h.Addr(), edgePort).String(),
			"--control-plane", cp, "--metrics-addr", "off", "--log-level", "info")
		c.waitHTTP(c.edgeURL(i)+"/healthz", 30*time.Second)
	}
	for _, h := range c.workers {
		data := filepath.Join(dir, h.Name())
		c.start(h, "space-node", filepath.Join(bin, "space-node"), "--id", h.Name(), "--addr", netip.AddrPortFrom(h.Addr(), nodePort).String(),
			"--data-dir", data, "--etcd-endpoints", c.etcdEndpoints(), "--snapshot-dir", c.snapDir,
			"--capacity", "24", "--egress", "off", "--keep-sandboxes=false", "--metrics-addr", "off", "--log-level", "info")
		// On a pure cgroup v2 host the worker moves its sandboxes into
		// cgroups of its own, out of the host's: they are the host's too
		// (a host kill ends them). On a hybrid host they stay in it.
		h.OwnCgroup(node.NSCgroupParent(data, h.Name()))
	}
	c.waitWorkers(0, 120*time.Second, "w1", "w2", "w3")
	return c
}

// edgeTakesSeveral reports whether this space-edge accepts several
// control planes (its --control-plane usage says comma-separated).
func edgeTakesSeveral(bin string) bool {
	out, _ := exec.Command(filepath.Join(bin, "space-edge"), "-h").CombinedOutput()
	lines := strings.Split(string(out), "\n")
	for i, line := range lines {
		if strings.Contains(line, "-control-plane") && i+1 < len(lines) {
			usage := strings.ToLower(lines[i+1])
			for _, w := range []string{"comma", "urls", "url(s)", "several", "list of", "fail over", "failover"} {
				if strings.Contains(usage, w) {
					return true
				}
			}
			return false
		}
	}
	return false
}

func (c *cluster) startEtcd(h *hostsim.Host, name, data, initial string) {
	c.t.Helper()
	a := h.Addr().String()
	c.start(h, "etcd", "/usr/bin/etcd", "--name", name, "--data-dir", data,
		"--listen-client-urls", fmt.Sprintf("http://%s:%d", a, etcdClientPort),
		"--advertise-client-urls", fmt.Sprintf("http://%s:%d", a, etcdClientPort),
		"--listen-peer-urls", fmt.Sprintf("http://%s:%d", a, etcdPeerPort),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://%s:%d", a, etcdPeerPort),
		"--initial-cluster", initial, "--initial-cluster-state", "new", "--initial-cluster-token", "space-cluster-test",
		"--log-level", "error", "--logger", "zap")
}

// start runs a process on h; space-api and space-edge get the edge key
// (from the environment only, as in production).
func (c *cluster) start(h *hostsim.Host, name, path string, args ...string) {
	c.t.Helper()
	env := hostEnv
	if name == "space-api" || name == "space-edge" {
		env = append([]string{"SPACE_EDGE_KEY=" + edgeKey}, hostEnv...)
	}
	if _, err := h.Start(name, hostsim.Command{Path: path, Args: args, Env: env}); err != nil {
		c.t.Fatal(err)
	}
}

// get does a GET from the client host; API calls carry the API key.
func (c *cluster) get(ctx context.Context, url string, out any) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	req.Header.Set(spacev1.HeaderAPIKey, apiKey)
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return resp.StatusCode, err
	}
	if resp.StatusCode/100 != 2 {
		return resp.StatusCode, fmt.Errorf("GET %s: %d %s", url, resp.StatusCode, strings.TrimSpace(string(b)))
	}
	if out != nil {
		return resp.StatusCode, json.Unmarshal(b, out)
	}
	return resp.StatusCode, nil
}

func (c *cluster) waitHTTP(url string, d time.Duration) {
	c.t.Helper()
	deadline := time.Now().Add(d)
	var err error
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		_, err = c.get(ctx, url, nil)
		cancel()
		if err == nil {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	c.t.Fatalf("%s not up after %v: %v\n%s", url, d, err, c.logs())
}

// readyWorkers lists the workers control plane i reports ready.
func (c *cluster) readyWorkers(ctx context.Context, i int) (map[string]bool, error) {
	var ws []spacev1.Worker
	if _, err := c.get(ctx, c.apiURL(i)+"/space/v1/workers", &ws); err != nil {
		return nil, err
	}
	out := map[string]bool{}
	for _, w := range ws {
		if w.State == "ready" {
			out[w.ID] = true
		}
	}
	return out, nil
}

// waitWorkers waits until control plane i lists ids as ready; it returns
// how long that took.
func (c *cluster) waitWorkers(i int, d time.Duration, ids ...string) time.Duration {
	c.t.Helper()
	t0 := time.Now()
	for time.Since(t0) < d {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		ready, err := c.readyWorkers(ctx, i)
		cancel()
		all := err == nil
		for _, id := range ids {
			all = all && ready[id]
		}
		if all {
			return time.Since(t0)
		}
		time.Sleep(250 * time.Millisecond)
	}
	c.t.Fatalf("workers %v not ready after %v\n%s", ids, d, c.logs())
	return 0
}

// logs is the tail of every process's log (for failures).
func (c *cluster) logs() string {
	var b strings.Builder
	for _, name := range c.net.Hosts() {
		h, _ := c.net.Host(name)
		files, _ := filepath.Glob(filepath.Join(h.LogDir(), "*.log"))
		for _, f := range files {
			data, _ := os.ReadFile(f)
			if len(data) > 3000 {
				data = data[len(data)-3000:]
			}
			fmt.Fprintf(&b, "==== %s %s\n%s\n", name, filepath.Base(f), data)
		}
	}
	return b.String()
}

// stop ends every process: SIGTERM first (workers stop their sandboxes:
// --keep-sandboxes=false; a kill -9 ends them with the host's cgroup),
// then the hosts go with the net.
func (c *cluster) stop() {
	for _, group := range [][]*hostsim.Host{c.edges, c.apis, c.workers, c.etcd} {
		for _, h := range group {
			if killed, err := h.Stop(30 * time.Second); err != nil || len(killed) > 0 {
				c.t.Logf("stopping %s: killed %v: %v", h.Name(), killed, err)
			}
		}
	}
}

// setup is what every test here starts with: root (the only reason it
// skips), the binaries (SPACE_BIN_DIR, or built now), etcd, a hostsim
// net.
func setup(t *testing.T) (bin, dir string, n *hostsim.Net) {
	t.Helper()
	testenv.RequireRoot(t, "network-namespace hosts, cgroups, sandboxes")
	for _, p := range []string{"/usr/bin/etcd", "/usr/bin/etcdctl"} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("needs Debian's etcd: run make etcd-deps (make test and make cluster-test do): %v", err)
		}
	}
	bin, cleanup, err := testenv.BinDir()
	if err != nil {
		t.Fatalf("binaries: %v", err)
	}
	t.Cleanup(cleanup)
	dir, err = os.MkdirTemp("", "cl-") // short: worker sockets live under it
	if err != nil {
		t.Fatal(err)
	}
	n, err = hostsim.New(hostsim.Config{Dir: filepath.Join(dir, "hosts")})
	if err != nil {
		os.RemoveAll(dir)
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Errorf("hostsim close: %v", err)
		}
		if !t.Failed() {
			os.RemoveAll(dir)
		} else {
			t.Logf("kept %s", dir)
		}
	})
	return bin, dir, n
}
