package up

// netgtw starts on an activation's first service-port request (not at
// every create): it must get the same trusted activation state and pass
// the same start-time checks as an eagerly started one, and a replaced
// execution must still end the streams it carries.

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/gateway"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/sbxmanager"
)

func spWorkerManager(t *testing.T, worker string) *sbxmanager.Manager {
	t.Helper()
	for i, w := range plat.Workers {
		if fmt.Sprintf("w%d", i+1) == worker {
			return w.Manager()
		}
	}
	t.Fatalf("no worker %s", worker)
	return nil
}

// netgtwArgs returns netgtw's command-line flags (--name value pairs).
func netgtwArgs(t *testing.T, pid int) map[string]string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		t.Fatalf("netgtw cmdline: %v", err)
	}
	f := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
	if filepath.Base(f[0]) != "netgtw" {
		t.Fatalf("pid %d is %q, not netgtw", pid, f[0])
	}
	out := map[string]string{}
	for i := 1; i+1 < len(f); i += 2 {
		out[strings.TrimPrefix(f[i], "--")] = f[i+1]
	}
	return out
}

// netgtwCount counts running netgtw processes listening on sock.
func netgtwCount(sock string) int {
	ents, _ := os.ReadDir("/proc")
	n := 0
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err == nil && strings.Contains(string(b), "\x00--listen\x00"+sock+"\x00") {
			n++
		}
	}
	return n
}

// spGetStatus is spGet without t.Fatal (for goroutines).
func spGetStatus(host string) (int, error) {
	req, _ := http.NewRequest("GET", plat.SandboxURL+"/", nil)
	req.Host = host
	res, err := testTransport.RoundTrip(req)
	if err != nil {
		return 0, err
	}
	res.Body.Close()
	return res.StatusCode, nil
}

func TestServicePortLazyGateway(t *testing.T) {
	ensureNetgtw(t)
	c := newSPClient(t)
	a := spCreate(t, c)
	host := func(port int) string { return fmt.Sprintf("%d-%s.localhost", port, a.ID) }
	r0 := spCapability(t, a.ID, 8000, "http").Route
	mgr := spWorkerManager(t, r0.WorkerID)
	sock0 := spGatewaySock(r0)

	// No netgtw at create, nor for guest API traffic.
	spStartServers(t, a)
	if pid, ok := mgr.GatewayPID(a.ID); ok {
		t.Fatalf("netgtw %d runs before any service-port request", pid)
	}
	if n := netgtwCount(sock0); n != 0 {
		t.Fatalf("%d netgtw processes for %s before any service-port request", n, a.ID)
	}

	// The first service-port requests, concurrent: exactly one netgtw.
	var wg sync.WaitGroup
	sts := make([]int, 6)
	errs := make([]error, len(sts))
	for i := range sts {
		wg.Go(func() { sts[i], errs[i] = spGetStatus(host(8000)) })
	}
	wg.Wait()
	for i := range sts {
		if errs[i] != nil || sts[i] != 200 {
			t.Fatalf("first service-port requests: %v %v", sts, errs)
		}
	}
	pid, ok := mgr.GatewayPID(a.ID)
	if !ok {
		t.Fatal("no netgtw after the first service-port request")
	}
	if n := netgtwCount(sock0); n != 1 {
		t.Fatalf("%d netgtw processes for one activation", n)
	}

	// Started with the trusted state recorded at activation: the route
	// the manager installed, the sandbox's init (start time and network
	// namespace of that very process) and this process as its only peer.
	args := netgtwArgs(t, pid)
	var got identity.Route
	if err := json.Unmarshal([]byte(args["route"]), &got); err != nil || got != r0 {
		t.Fatalf("netgtw --route %s (%v), want %v", args["route"], err, r0)
	}
	_, initPID, _ := mgr.BridgePID(a.ID)
	_, ino, start, err := gateway.NetnsIdentity(initPID)
	if err != nil {
		t.Fatal(err)
	}
	if args["init-pid"] != strconv.Itoa(initPID) || args["init-start"] != strconv.FormatUint(start, 10) ||
		args["netns-ino"] != strconv.FormatUint(ino, 10) || args["manager-pid"] != strconv.Itoa(os.Getpid()) {
		t.Fatalf("netgtw started with %v; the sandbox init is pid %d start %d netns %d, manager %d", args, initPID, start, ino, os.Getpid())
	}
	// And it makes the same checks: a port the capability does not name.
	cap8000 := spCapability(t, a.ID, 8000, "http")
	if st, o := spDirect(t, "", sock0, cap8000.Token, 8001, nil); st != 403 {
		t.Fatalf("lazily started netgtw, 8000 capability on 8001: %d %q", st, o)
	}

	// Streams through it, then a new execution (a move): they end.
	ws, wbr, st := spUpgrade(t, host(8002), "websocket")
	if st != 101 {
		t.Fatalf("websocket: %d", st)
	}
	defer ws.Close()
	tcp, tbr, st := spUpgrade(t, host(8001), "tcp")
	if st != 101 {
		t.Fatalf("tcp: %d", st)
	}
	defer tcp.Close()
	for _, s := range []struct {
		name string
		echo func(string) (string, error)
	}{{"websocket", func(m string) (string, error) { return spEcho(ws, wbr, m) }}, {"tcp", func(m string) (string, error) { return spEcho(tcp, tbr, m) }}} {
		if got, err := s.echo("before"); err != nil || got != "before\n" {
			t.Fatalf("%s echo: %q %v", s.name, got, err)
		}
	}
	mr := (&lcPlat{Platform: plat}).migrate(t, a.ID, "")
	if got, err := spEcho(ws, wbr, "after-move"); err == nil {
		t.Fatalf("websocket survived a new execution: %q", got)
	}
	if got, err := spEcho(tcp, tbr, "after-move"); err == nil {
		t.Fatalf("raw TCP survived a new execution: %q", got)
	}
	deadline := time.Now().Add(10 * time.Second)
	for syscall.Kill(pid, 0) == nil {
		if time.Now().After(deadline) {
			t.Fatalf("the old execution's netgtw %d still runs after the move", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}

	// The new execution starts a netgtw of its own on its first request.
	r1 := spCapability(t, a.ID, 8000, "http").Route
	if r1.Epoch() == r0.Epoch() {
		t.Fatalf("move %+v kept the execution %v", mr, r0)
	}
	mgr1 := spWorkerManager(t, r1.WorkerID)
	if p, ok := mgr1.GatewayPID(a.ID); ok {
		t.Fatalf("netgtw %d of the new execution runs before its first service-port request", p)
	}
	spStartServers(t, a) // ns moves restart processes
	if st, err := spGetStatus(host(8000)); err != nil || st != 200 {
		t.Fatalf("service port after the move: %d %v", st, err)
	}
	pid1, ok := mgr1.GatewayPID(a.ID)
	if !ok || pid1 == pid {
		t.Fatalf("new execution's netgtw: %d %v (old %d)", pid1, ok, pid)
	}
	if err := json.Unmarshal([]byte(netgtwArgs(t, pid1)["route"]), &got); err != nil || got != r1 {
		t.Fatalf("new netgtw --route %v (%v), want %v", got, err, r1)
	}
}

// TestServicePortLazyGatewayActivationBeforeStart: an activation change
// that arrives before netgtw has started follows netgtw's own rules on the
// state it will start with.
func TestServicePortLazyGatewayActivationBeforeStart(t *testing.T) {
	ensureNetgtw(t)
	c := newSPClient(t)
	a := spCreate(t, c)
	b := spCreate(t, c)
	ra := spCapability(t, a.ID, 8000, "http").Route
	rb := spCapability(t, b.ID, 8000, "http").Route
	mgrA, mgrB := spWorkerManager(t, ra.WorkerID), spWorkerManager(t, rb.WorkerID)

	// Another sandbox's route is refused and changes nothing.
	if ans, err := mgrA.SetGatewayActivation(a.ID, rb); err == nil {
		t.Fatalf("route of %s accepted for %s: %q", b.ID, a.ID, ans)
	}
	// Same epoch, new activation: netgtw starts with it, so the
	// capability of the previous activation is refused there (421).
	next := ra
	next.ActivationID = "reactivated-" + next.ActivationID
	if ans, err := mgrA.SetGatewayActivation(a.ID, next); err != nil || ans != "ok" {
		t.Fatalf("activation change before start: %q %v", ans, err)
	}
	spStartServers(t, a)
	if st, err := spGetStatus(fmt.Sprintf("8000-%s.localhost", a.ID)); err != nil || st != http.StatusMisdirectedRequest {
		t.Fatalf("previous activation's capability after the change: %d %v, want 421", st, err)
	}
	pid, ok := mgrA.GatewayPID(a.ID)
	if !ok {
		t.Fatal("no netgtw after the first service-port request")
	}
	var got identity.Route
	if err := json.Unmarshal([]byte(netgtwArgs(t, pid)["route"]), &got); err != nil || got != next {
		t.Fatalf("netgtw --route %v (%v), want the changed activation %v", got, err, next)
	}

	// Another execution before start: retired, never started, 421.
	newExec := rb
	newExec.Generation++
	newExec.ExecutionID = "next-" + newExec.ExecutionID
	if ans, err := mgrB.SetGatewayActivation(b.ID, newExec); err != nil || ans != "ok retired" {
		t.Fatalf("execution change before start: %q %v", ans, err)
	}
	spStartServers(t, b)
	if st, err := spGetStatus(fmt.Sprintf("8000-%s.localhost", b.ID)); err != nil || st != http.StatusMisdirectedRequest {
		t.Fatalf("retired gateway: %d %v, want 421", st, err)
	}
	if p, ok := mgrB.GatewayPID(b.ID); ok {
		t.Fatalf("a retired gateway started netgtw %d", p)
	}
	if n := netgtwCount(spGatewaySock(rb)); n != 0 {
		t.Fatalf("%d netgtw processes for a retired gateway", n)
	}
}
