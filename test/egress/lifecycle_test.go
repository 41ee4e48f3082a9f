package egress

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// A worker restart (kill -9 of space up, started again on its data dir)
// keeps each sandbox's link and its policy: the policy is in force again
// before the re-adopted sandbox is served, and while no worker runs,
// nothing the policy denies got out.
func TestPolicyKeptAcrossWorkerCrash(t *testing.T) {
	w := getWorld(t)
	dir := t.TempDir()
	args := []string{"--egress=deny", "--egress-dns=" + w.inet.DNS().String(), "--egress-upstream-ca=" + w.caFile}
	p1, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir, KeepSandboxes: true, LogLevel: "info", Args: args})
	if err != nil {
		t.Fatal(err)
	}
	c1, err := sdk.New(sdk.Config{APIURL: p1.APIURL, SandboxURL: p1.SandboxURL, APIKey: p1.APIKey})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s, err := c1.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 10 * time.Minute, AllowInternetAccess: ptr(false),
		Network: &sdk.Network{AllowOut: []string{cidr(w.host(1))}}})
	if err != nil {
		p1.Kill()
		t.Fatal(err)
	}
	sb := &sandbox{s, w}
	sb.mustReach(t, httpURL(w.host(1), "/"))
	// A loop that keeps trying the denied host and the allowed one
	// through the crash, recording what answered.
	sb.sh(t, fmt.Sprintf(`nohup bash -c 'while :; do curl -s --max-time 1 http://%s/ >>/tmp/denied.log; echo >>/tmp/denied.log; curl -s --max-time 1 http://%s/ >>/tmp/allowed.log && echo >>/tmp/allowed.log; sleep 0.2; done' >/dev/null 2>&1 &`, w.host(0), w.host(1)))
	time.Sleep(time.Second)
	if err := p1.Kill(); err != nil {
		t.Logf("kill: %v", err)
	}
	time.Sleep(2 * time.Second) // the sandbox runs on with no worker
	p2, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir, LogLevel: "info", Args: args})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if t.Failed() {
			t.Logf("space up log:\n%s", tail(p2.Log(), 32<<10))
		}
		if err := p2.Stop(); err != nil {
			t.Error(err)
		}
	}()
	c2, err := sdk.New(sdk.Config{APIURL: p2.APIURL, SandboxURL: p2.SandboxURL, APIKey: p2.APIKey})
	if err != nil {
		t.Fatal(err)
	}
	s2, err := c2.OpenSandbox(ctx, s.ID)
	if err != nil {
		t.Fatal(err)
	}
	sb2 := &sandbox{s2, w}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if r := sb2.curl(t, httpURL(w.host(1), "/")); r.ok() {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("the allowed host is not reachable after the restart: %s", r.out)
		}
		time.Sleep(300 * time.Millisecond)
	}
	sb2.mustNotReach(t, httpURL(w.host(0), "/"))
	time.Sleep(time.Second)
	if out := sb2.sh(t, "cat /tmp/denied.log").out; strings.Contains(out, "hello") {
		t.Fatalf("the denied host answered the sandbox around the crash:\n%s", out)
	}
	if out := sb2.sh(t, "cat /tmp/allowed.log").out; !strings.Contains(out, "hello from "+w.host(1).String()) {
		t.Fatalf("the loop never reached the allowed host: %q", out)
	}
	if err := sb2.Kill(ctx); err != nil && !errors.Is(err, sdk.ErrNotFound) {
		t.Error(err)
	}
}

// A microVM sandbox (base-vm) gets the same egress: its NIC is a tap in
// the worker's egress namespace, configured by the guest from its
// activation; the policy decides as for ns sandboxes, and a move keeps it.
func TestMicroVMEgress(t *testing.T) {
	w := getWorld(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	s, err := w.client.CreateSandbox(ctx, sdk.CreateOptions{Template: "base-vm", Timeout: 10 * time.Minute,
		AllowInternetAccess: ptr(false), Network: &sdk.Network{AllowOut: []string{cidr(w.host(1)), "api.allowed.test"}}})
	if err != nil {
		if strings.Contains(err.Error(), "microvm") {
			testenv.Skipf(t, "no microvm substrate on this platform: %v", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Kill(context.Background()) })
	vm := &sandbox{s, w}
	// base-vm runs the Debian base (busybox when it is not built): curl
	// when there is one, else a request by hand through busybox nc
	// (busybox's static wget crashes in the libc resolver).
	hasCurl := vm.sh(t, "command -v curl").out != ""
	get := func(host string, addr netip.Addr) string {
		if hasCurl {
			return vm.sh(t, fmt.Sprintf(`curl -s -i -m 5 -H 'Host: %s' http://%s/`, host, addr)).out
		}
		return vm.sh(t, fmt.Sprintf(`printf 'GET / HTTP/1.0\r\nHost: %s\r\n\r\n' | nc -w 5 %s 80`, host, addr)).out
	}
	lookup := func(name string) string {
		if hasCurl {
			return vm.sh(t, "getent hosts "+name).out
		}
		return vm.sh(t, "nslookup "+name).out
	}
	h0, h1 := w.host(0), w.host(1)
	if out := get(h1.String(), h1); !servedBy(out, h1) {
		t.Fatalf("allowed host from the VM: %q\n%s", out, vm.sh(t, "ip addr; ip route; cat /etc/resolv.conf").out)
	}
	if out := get(h0.String(), h0); servedBy(out, h0) {
		t.Fatalf("denied host answered the VM: %q", out)
	}
	if out := lookup("api.allowed.test"); !strings.Contains(out, h1.String()) {
		t.Fatalf("the VM's resolver does not answer the allowed name: %q", out)
	}
	if out := lookup("denied.test"); strings.Contains(out, w.host(2).String()) {
		t.Fatalf("the VM's resolver answers a name outside the allow-list: %q", out)
	}
	if out := get("api.allowed.test", h1); !servedBy(out, h1) {
		t.Fatalf("allowed name from the VM: %q", out)
	}
	if out := get("metadata", netip.MustParseAddr("169.254.169.254")); out != "" {
		t.Fatalf("metadata address answered the VM: %q", out)
	}
	if code := w.post(t, "/space/v1/sandboxes/"+s.ID+"/migrate"); code/100 != 2 {
		t.Fatalf("migrate: %d", code)
	}
	if out := get(h1.String(), h1); !servedBy(out, h1) {
		t.Fatalf("allowed host after the move: %q\n%s", out, vm.sh(t, "ip addr; ip route").out)
	}
	if out := get(h0.String(), h0); servedBy(out, h0) {
		t.Fatalf("denied host answered the VM after the move: %q", out)
	}
}
