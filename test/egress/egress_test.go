package egress

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/sdk"
)

func httpURL(a netip.Addr, path string) string { return "http://" + a.String() + path }
func httpsURL(name, path string) string        { return "https://" + name + path }
func httpName(name, path string) string        { return "http://" + name + path }
func (w *world) host(i int) netip.Addr         { return w.inet.Host(i) }
func cidr(a netip.Addr) string                 { return netip.PrefixFrom(a, 32).String() }
func servedBy(body string, a netip.Addr) bool {
	return strings.Contains(body, "hello from "+a.String())
}

// A sandbox created without network options under --egress=deny has a
// link, a resolver that answers nothing, and no way out.
func TestDefaultDenyGetsNothingOut(t *testing.T) {
	w := getWorld(t)
	s := w.sandbox(t, sdk.CreateOptions{})
	s.mustNotReach(t, httpURL(w.host(0), "/"))
	s.mustNotReach(t, httpsURL(nameAllowed, "/"))
	if ok, out := s.resolves(t, nameAllowed); ok {
		t.Fatalf("%s resolved under a deny-all policy: %s", nameAllowed, out)
	}
	for _, r := range w.inet.Requests() {
		if r.Path == "/" && r.Host == w.host(0).String() {
			t.Fatalf("the simulated internet got a request from a deny-all sandbox: %+v", r)
		}
	}
}

// allowInternetAccess opens the internet (not the always-denied ranges).
func TestAllowInternetAccessOpens(t *testing.T) {
	w := getWorld(t)
	s := w.sandbox(t, sdk.CreateOptions{AllowInternetAccess: ptr(true)})
	if body := s.mustReach(t, httpURL(w.host(0), "/")); !servedBy(body, w.host(0)) {
		t.Fatalf("unexpected body %q", body)
	}
	if body := s.mustReach(t, httpsURL(nameAPI, "/")); !servedBy(body, w.host(1)) {
		t.Fatalf("unexpected body %q", body)
	}
	if ok, out := s.resolves(t, nameDenied); !ok {
		t.Fatalf("%s does not resolve under an open policy: %s", nameDenied, out)
	}
	// Plain TCP (echo on :7) goes straight through.
	r := s.sh(t, fmt.Sprintf(`exec 3<>/dev/tcp/%s/7 && echo ping-egress >&3 && timeout 5 head -c 12 <&3`, w.host(2)))
	if !strings.Contains(r.out, "ping-egress") {
		t.Fatalf("tcp echo through egress: exit %d %v: %q", r.code, r.err, r.out)
	}
}

// The always-denied destinations stay unreachable under the most open
// policy: metadata and link-local, loopback and the host's own services
// (the control plane, the edge, node-api), private ranges, the names that
// resolve to them (DNS rebinding), other sandboxes and the link's own
// gateway.
func TestAlwaysDeniedUnderEveryPolicy(t *testing.T) {
	w := getWorld(t)
	open := w.sandbox(t, sdk.CreateOptions{AllowInternetAccess: ptr(true),
		Network: &sdk.Network{AllowOut: []string{"0.0.0.0/0", "169.254.0.0/16", "127.0.0.0/8", "10.0.0.0/8"}}})
	other := w.sandbox(t, sdk.CreateOptions{AllowInternetAccess: ptr(true)})
	// other listens on :8080 on every address of its own.
	other.sh(t, `nohup python3 -m http.server 8080 >/dev/null 2>&1 &`)
	otherAddr := strings.TrimSpace(other.sh(t, `ip -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1`).out)
	gw := strings.TrimSpace(open.sh(t, `ip -4 route show default | awk '{print $3}'`).out)
	apiPort := strings.TrimPrefix(w.plat.APIAddr[strings.LastIndex(w.plat.APIAddr, ":"):], ":")
	edgePort := strings.TrimPrefix(w.plat.EdgeAddr[strings.LastIndex(w.plat.EdgeAddr, ":"):], ":")
	hostIPs := hostAddrs(t)
	targets := []string{
		"http://169.254.169.254/latest/meta-data/",
		"http://127.0.0.1:" + apiPort + "/health",
		"http://127.0.0.1:" + edgePort + "/",
		"http://10.20.30.40/",
		httpName(nameRebind, "/"),
		httpName(namePrivate, "/"),
	}
	if otherAddr != "" {
		targets = append(targets, "http://"+otherAddr+":8080/")
	}
	if gw != "" {
		targets = append(targets, "http://"+gw+":"+apiPort+"/health", "http://"+gw+":22/")
	}
	for _, ip := range hostIPs {
		targets = append(targets, "http://"+ip+":"+apiPort+"/health")
	}
	for _, u := range targets {
		t.Run(strings.NewReplacer("/", "_", ":", "_").Replace(u), func(t *testing.T) {
			open.mustNotReach(t, u)
		})
	}
	// The rebinding name does not even resolve to its reserved addresses.
	if ok, out := open.resolves(t, nameRebind); ok {
		t.Fatalf("%s resolved to reserved addresses: %s", nameRebind, out)
	}
	if otherAddr == "" || gw == "" {
		t.Fatalf("sandboxes have no link: other eth0 %q, default route %q", otherAddr, gw)
	}
}

// hostAddrs are the host's own IPv4 addresses (not loopback, not the
// simulated internet's side of its link).
func hostAddrs(t *testing.T) []string {
	t.Helper()
	ifaddrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	sim := netip.MustParsePrefix("198.18.0.0/15")
	var addrs []string
	for _, a := range ifaddrs {
		ipn, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		ip, ok := netip.AddrFromSlice(ipn.IP)
		if ip = ip.Unmap(); ok && ip.Is4() && !ip.IsLoopback() && !sim.Contains(ip) {
			addrs = append(addrs, ip.String())
		}
	}
	return addrs
}

// An allow-list: names and CIDRs listed are reachable, by SNI, by Host and
// by address; a wildcard matches subdomains at any depth but not its
// apex; names outside the list do not resolve; a forged SNI does not
// choose the address dialed.
func TestAllowListByNameAndCIDR(t *testing.T) {
	w := getWorld(t)
	s := w.sandbox(t, sdk.CreateOptions{AllowInternetAccess: ptr(false),
		Network: &sdk.Network{AllowOut: []string{"*.allowed.test", cidr(w.host(2))}}})

	t.Run("wildcard by SNI", func(t *testing.T) {
		if body := s.mustReach(t, httpsURL(nameAPI, "/")); !servedBy(body, w.host(1)) {
			t.Fatalf("body %q", body)
		}
		s.mustReach(t, httpsURL(nameDeep, "/"))
	})
	t.Run("wildcard by Host", func(t *testing.T) {
		s.mustReach(t, httpName(nameAPI, "/"))
	})
	t.Run("apex not matched by wildcard", func(t *testing.T) {
		s.mustNotReach(t, httpsURL(nameAllowed, "/"), "--resolve", nameAllowed+":443:"+w.host(0).String())
		s.mustNotReach(t, httpName(nameAllowed, "/"), "--resolve", nameAllowed+":80:"+w.host(0).String())
	})
	t.Run("CIDR", func(t *testing.T) {
		s.mustReach(t, httpURL(w.host(2), "/"))
	})
	t.Run("denied by address", func(t *testing.T) {
		s.mustNotReach(t, httpURL(w.host(0), "/"))
	})
	t.Run("denied at TLS SNI", func(t *testing.T) {
		// Host 0 by address is denied; a name outside the list in SNI
		// does not open it.
		s.mustNotReach(t, httpsURL(nameSecret, "/"), "--resolve", nameSecret+":443:"+w.host(0).String())
	})
	t.Run("denied at HTTP Host", func(t *testing.T) {
		s.mustNotReach(t, httpName(nameSecret, "/"), "--resolve", nameSecret+":80:"+w.host(0).String())
	})
	t.Run("forged address for an allowed name", func(t *testing.T) {
		// The sandbox claims api.allowed.test lives at host 0 (denied):
		// the proxy connects to its own resolution (host 1) instead.
		body := s.mustReach(t, httpsURL(nameAPI, "/"), "--resolve", nameAPI+":443:"+w.host(0).String())
		if !servedBy(body, w.host(1)) {
			t.Fatalf("an allowed SNI chose the sandbox's address: %q", body)
		}
	})
	t.Run("DNS allow-list", func(t *testing.T) {
		if ok, _ := s.resolves(t, nameAPI); !ok {
			t.Fatalf("%s does not resolve", nameAPI)
		}
		for _, n := range []string{nameDenied, nameAllowed, nameOther} {
			if ok, out := s.resolves(t, n); ok {
				t.Fatalf("%s resolved outside the allow-list: %s", n, out)
			}
		}
	})
	t.Run("DNS to another server", func(t *testing.T) {
		// A query sent straight to the simulated internet's DNS server
		// is answered by the platform's resolver under the sandbox's
		// policy: the name outside the list gets no address, and the
		// server never sees the query.
		before := countQueries(w, nameOther)
		r := s.sh(t, fmt.Sprintf(`python3 - <<'EOF'
import socket, struct
q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + b"".join(bytes([len(p)]) + p.encode() for p in %q.split(".")) + b"\x00" + struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
s.sendto(q, (%q, 53))
try:
    d = s.recv(4096); print("rcode", d[3] & 15, "answers", struct.unpack(">H", d[6:8])[0])
except socket.timeout:
    print("no answer")
EOF`, nameOther, w.inet.DNS().Addr().String()))
		if strings.Contains(r.out, "answers 1") || strings.Contains(r.out, "answers 2") {
			t.Fatalf("a direct DNS query for %s got an answer: %s", nameOther, r.out)
		}
		if after := countQueries(w, nameOther); after != before {
			t.Fatalf("the simulated internet's DNS server saw the sandbox's query (%d -> %d)", before, after)
		}
	})
}

func countQueries(w *world, name string) int {
	n := 0
	for _, q := range w.inet.Queries() {
		if q.Name == name {
			n++
		}
	}
	return n
}

// A name on the allow-list that resolves only to reserved addresses
// (DNS rebinding) is refused.
func TestRebindingRefused(t *testing.T) {
	w := getWorld(t)
	s := w.sandbox(t, sdk.CreateOptions{AllowInternetAccess: ptr(false),
		Network: &sdk.Network{AllowOut: []string{nameRebind, namePrivate}}})
	s.mustNotReach(t, httpName(nameRebind, "/"), "--resolve", nameRebind+":80:"+w.host(0).String())
	s.mustNotReach(t, httpName(namePrivate, "/"), "--resolve", namePrivate+":80:"+w.host(0).String())
	s.mustNotReach(t, httpName(nameRebind, "/"))
}

// updateNetwork takes effect on a running sandbox at once and cuts a live
// connection to a destination it now denies; one it still allows lives on.
func TestUpdateNetworkCutsDeniedConnections(t *testing.T) {
	w := getWorld(t)
	s := w.sandbox(t, sdk.CreateOptions{AllowInternetAccess: ptr(true)})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// Two held connections: to host 0 (to be denied) and host 1 (kept).
	s.sh(t, fmt.Sprintf(`nohup curl -sS -N http://%s/hold >/tmp/hold0 2>/tmp/hold0.err & echo $! >/tmp/hold0.pid
nohup curl -sS -N http://%s/hold >/tmp/hold1 2>/tmp/hold1.err & echo $! >/tmp/hold1.pid`, w.host(0), w.host(1)))
	waitGrowing(t, s, "/tmp/hold0")
	waitGrowing(t, s, "/tmp/hold1")
	t0 := time.Now()
	if err := w.client.UpdateNetwork(ctx, s.ID, sdk.NetworkUpdate{AllowInternetAccess: ptr(false), AllowOut: []string{cidr(w.host(1))}}); err != nil {
		t.Fatalf("updateNetwork: %v", err)
	}
	t.Logf("updateNetwork answered in %v", time.Since(t0))
	// The denied connection is cut: its curl exits.
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if !s.sh(t, `kill -0 $(cat /tmp/hold0.pid) 2>/dev/null`).ok() {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if s.sh(t, `kill -0 $(cat /tmp/hold0.pid) 2>/dev/null`).ok() {
		t.Fatal("the connection to a now-denied destination is still open 10 s after updateNetwork")
	}
	if !s.sh(t, `kill -0 $(cat /tmp/hold1.pid) 2>/dev/null`).ok() {
		t.Fatalf("the connection to a still-allowed destination was cut: %s", s.sh(t, "cat /tmp/hold1.err").out)
	}
	waitGrowing(t, s, "/tmp/hold1")
	s.mustNotReach(t, httpURL(w.host(0), "/"))
	s.mustReach(t, httpURL(w.host(1), "/"))
	// GET reflects the new configuration.
	info, err := w.client.GetSandbox(ctx, s.ID)
	if err != nil {
		t.Fatal(err)
	}
	if info.Network == nil || len(info.Network.AllowOut) != 1 || info.AllowInternetAccess == nil || *info.AllowInternetAccess {
		t.Fatalf("GET after updateNetwork: allowInternetAccess %v network %+v", info.AllowInternetAccess, info.Network)
	}
	// And opening it again works without a restart.
	if err := w.client.UpdateNetwork(ctx, s.ID, sdk.NetworkUpdate{AllowInternetAccess: ptr(true)}); err != nil {
		t.Fatal(err)
	}
	s.mustReach(t, httpURL(w.host(0), "/"))
}

// waitGrowing waits until file grows inside s (a held connection streams).
func waitGrowing(t *testing.T, s *sandbox, file string) {
	t.Helper()
	size := func() string { return strings.TrimSpace(s.sh(t, "stat -c %s "+file+" 2>/dev/null || echo 0").out) }
	first := size()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		time.Sleep(300 * time.Millisecond)
		if cur := size(); cur != first && cur != "0" {
			return
		}
	}
	t.Fatalf("%s does not grow: %s", file, s.sh(t, "cat "+file+".err").out)
}

// A secret injected by a header transform reaches the server, while the
// sandbox's environment, files and memory only ever hold the placeholder.
func TestSecretInjectedNeverInSandbox(t *testing.T) {
	w := getWorld(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	value := "s3cr3t-" + fmt.Sprint(time.Now().UnixNano())
	name := fmt.Sprintf("apikey-%d", time.Now().UnixNano()%1e6)
	if _, err := w.client.CreateSecret(ctx, name, value, nil); err != nil {
		t.Fatalf("create secret: %v", err)
	}
	t.Cleanup(func() { w.client.DeleteSecret(context.Background(), name) })
	ph := sdk.SecretPlaceholder(name)
	s := w.sandbox(t, sdk.CreateOptions{
		AllowInternetAccess: ptr(false),
		EnvVars:             map[string]string{"API_KEY": ph},
		Network: &sdk.Network{AllowOut: []string{nameSecret},
			Rules: map[string][]e2bapi.NetworkRule{nameSecret: {{Transform: &e2bapi.NetworkTransform{
				Headers: map[string]string{"Authorization": "Bearer " + ph, "X-Space-Test": "transformed"}}}}}},
	})
	w.inet.ResetRequests()
	// The sandbox trusts its egress CA through the system store (no
	// --cacert): the proxy intercepts to set the header.
	r := s.sh(t, `curl -sS --max-time 5 -H "Authorization: Bearer $API_KEY" https://`+nameSecret+`/ && echo && curl -sS --max-time 5 https://`+nameSecret+`/second`)
	if !r.ok() {
		t.Fatalf("https through interception: exit %d %v:\n%s", r.code, r.err, r.out)
	}
	var seen int
	for _, req := range w.inet.Requests() {
		if req.Host != nameSecret {
			continue
		}
		seen++
		if got := req.Header.Get("Authorization"); got != "Bearer "+value {
			t.Fatalf("server saw Authorization %q, want the secret's value", got)
		}
		if req.Header.Get("X-Space-Test") != "transformed" {
			t.Fatalf("transform header missing: %v", req.Header)
		}
	}
	if seen != 2 {
		t.Fatalf("server saw %d requests for %s, want 2", seen, nameSecret)
	}
	// The environment holds the placeholder.
	if env := s.sh(t, `printf %s "$API_KEY"`).out; env != ph {
		t.Fatalf("sandbox env API_KEY = %q, want the placeholder", env)
	}
	// No file the sandbox can see holds the value.
	// The command names the value in two halves: the whole value would
	// otherwise sit in the agent's memory as this command's text.
	half := len(value) / 2
	if g := s.sh(t, `grep -rIl --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr -e "$(printf %s%s '`+value[:half]+`' '`+value[half:]+`')" / 2>/dev/null | head -5`); strings.TrimSpace(g.out) != "" {
		t.Fatalf("files in the sandbox hold the secret: %s", g.out)
	}
	// No process memory of the sandbox holds it (read from the host).
	if pids := scanSandboxMemory(t, s.ID, value); len(pids) > 0 {
		t.Fatalf("sandbox processes %v hold the secret in memory", pids)
	}
	// Without a rule, a sandbox cannot get the value substituted into a
	// header it sends to another allowed host.
}

// scanSandboxMemory returns the pids of processes in sandbox id's cgroups
// whose readable memory contains needle.
func scanSandboxMemory(t *testing.T, id, needle string) []int {
	t.Helper()
	procs, _ := filepath.Glob("/proc/[0-9]*")
	var hits []int
	scanned := 0
	for _, p := range procs {
		cg, err := os.ReadFile(filepath.Join(p, "cgroup"))
		if err != nil || !strings.Contains(string(cg), id) {
			continue
		}
		var pid int
		fmt.Sscan(filepath.Base(p), &pid)
		scanned++
		if memContains(pid, needle) {
			cmd, _ := os.ReadFile(filepath.Join(p, "cmdline"))
			t.Logf("pid %d (%q, cgroups %q) holds the value", pid, strings.ReplaceAll(string(cmd), "\x00", " "), strings.TrimSpace(string(cg)))
			hits = append(hits, pid)
		}
	}
	if scanned == 0 {
		t.Fatalf("no process of sandbox %s found by cgroup", id)
	}
	return hits
}

// Pause and resume keep the policy: denied stays denied, allowed works.
func TestPolicyKeptAcrossPauseAndResume(t *testing.T) {
	w := getWorld(t)
	s := w.sandbox(t, sdk.CreateOptions{AllowInternetAccess: ptr(false), Network: &sdk.Network{AllowOut: []string{cidr(w.host(1))}}})
	s.mustReach(t, httpURL(w.host(1), "/"))
	if code := w.post(t, "/sandboxes/"+s.ID+"/pause"); code != http.StatusNoContent {
		t.Fatalf("pause: %d", code)
	}
	if code := w.post(t, "/sandboxes/"+s.ID+"/resume"); code != http.StatusCreated {
		t.Fatalf("resume: %d", code)
	}
	s.mustReach(t, httpURL(w.host(1), "/"))
	s.mustNotReach(t, httpURL(w.host(0), "/"))
	// A move to the other worker: a new execution, a new link, the same policy.
	before := w.workerOf(t, s.ID)
	if code := w.post(t, "/space/v1/sandboxes/"+s.ID+"/migrate"); code/100 != 2 {
		t.Fatalf("migrate: %d", code)
	}
	if after := w.workerOf(t, s.ID); after == before {
		t.Fatalf("the move left the sandbox on %s", after)
	}
	s.mustReach(t, httpURL(w.host(1), "/"))
	s.mustNotReach(t, httpURL(w.host(0), "/"))
}

// Denials are audited with sandbox and destination.
func TestDenialsAudited(t *testing.T) {
	w := getWorld(t)
	s := w.sandbox(t, sdk.CreateOptions{})
	s.mustNotReach(t, httpURL(w.host(2), "/audited"))
	deadline := time.Now().Add(5 * time.Second)
	for {
		logs, _ := filepath.Glob(filepath.Join(w.plat.DataDir, "*", "*", "audit.log"))
		more, _ := filepath.Glob(filepath.Join(w.plat.DataDir, "*", "audit.log"))
		for _, f := range append(logs, more...) {
			b, _ := os.ReadFile(f)
			for _, line := range strings.Split(string(b), "\n") {
				if strings.Contains(line, "egress denied") && strings.Contains(line, s.ID) && strings.Contains(line, w.host(2).String()+":80") {
					return
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no audit line for the denied connection of %s to %s:80", s.ID, w.host(2))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// post sends an API call with an empty JSON body and returns the status.
func (w *world) post(t *testing.T, path string) int {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, w.plat.APIURL+path, strings.NewReader("{}"))
	req.Header.Set("X-API-Key", w.plat.APIKey)
	req.Header.Set("Content-Type", "application/json")
	c := &http.Client{Timeout: 2 * time.Minute}
	res, err := c.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer res.Body.Close()
	return res.StatusCode
}

// memContains reports whether needle is in pid's readable memory.
func memContains(pid int, needle string) bool {
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return false
	}
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		return false
	}
	defer mem.Close()
	n := []byte(needle)
	for _, line := range strings.Split(string(maps), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || !strings.HasPrefix(f[1], "r") {
			continue
		}
		var lo, hi uint64
		if _, err := fmt.Sscanf(f[0], "%x-%x", &lo, &hi); err != nil || hi <= lo || hi-lo > 1<<30 {
			continue
		}
		buf := make([]byte, hi-lo)
		k, _ := mem.ReadAt(buf, int64(lo))
		if bytes.Contains(buf[:k], n) {
			return true
		}
	}
	return false
}

// workerOf is the worker of sandbox id's current execution.
func (w *world) workerOf(t *testing.T, id string) string {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, w.plat.APIURL+"/space/v1/sandboxes/"+id+"/executions", nil)
	req.Header.Set("X-API-Key", w.plat.APIKey)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var ex []spacev1.Execution
	if err := json.NewDecoder(res.Body).Decode(&ex); err != nil || len(ex) == 0 {
		t.Fatalf("executions of %s: %v (%d)", id, err, len(ex))
	}
	for i := len(ex) - 1; i >= 0; i-- {
		if ex[i].State == "running" {
			return ex[i].Route.WorkerID
		}
	}
	t.Fatalf("no running execution of %s: %+v", id, ex)
	return ""
}
