package up

// microVM sandboxes (template base-vm) through the whole request path:
// edge -> node-api -> sbx-manager -> spaced-host (vmchan over QEMU's
// virtio-serial chardev) -> spaced-guest as the VM's pid 1. Under TCG
// (no /dev/kvm here) a boot takes a few seconds, so the count is small.

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// vmPlatform starts a platform with two workers and skips (saying why)
// when it runs without the microvm substrate.
func vmPlatform(t *testing.T) *lcPlat {
	t.Helper()
	if _, err := os.Stat("/usr/bin/qemu-system-x86_64"); err != nil {
		testenv.Skipf(t, "microvm: qemu-system-x86_64 not installed (make vm-deps installs it)")
	}
	lp := startPlatform(t, 2)
	if lp.host.VM() == nil {
		testenv.Skipf(t, "microvm: no substrate (no guest kernel in .cache/vm/kernel: run make vm-deps)")
	}
	if why := lp.host.VM().Unavailable(); why != "" {
		// TCG works wherever QEMU does: a probe that boots nothing is a
		// failure, not a reason to skip.
		t.Fatalf("microvm: %s", why)
	}
	t.Logf("microvm accelerator: %s (probe: %v)", lp.VMAccel(), lp.host.VM().Probes())
	// Operators see each worker's accelerator.
	var ws []spacev1.Worker
	if r := lp.api(t, http.MethodGet, "/space/v1/workers", nil); r.status != http.StatusOK || json.Unmarshal(r.body, &ws) != nil {
		t.Fatalf("workers: %d %s", r.status, r.body)
	}
	for _, w := range ws {
		if w.Accelerators[identity.SubstrateMicroVM] != lp.VMAccel() || !w.Serves(identity.SubstrateMicroVM) {
			t.Fatalf("worker %s reports accelerators %v, substrates %v; want microvm on %s", w.ID, w.Accelerators, w.Substrates, lp.VMAccel())
		}
	}
	return lp
}

func newVM(t *testing.T, lp *lcPlat) *sdk.Sandbox {
	t.Helper()
	sbx, err := lp.client(t).CreateSandbox(ctxFor(t, 2*time.Minute), sdk.CreateOptions{Template: "base-vm", Secure: true, Timeout: 30 * time.Minute})
	if err != nil {
		t.Fatalf("create base-vm sandbox: %v", err)
	}
	return sbx
}

func runOut(t *testing.T, sbx *sdk.Sandbox, cmd string) string {
	t.Helper()
	var out, errb bytes.Buffer
	code, err := sbx.Run(ctxFor(t, time.Minute), cmd, sdk.RunOptions{Stdout: &out, Stderr: &errb})
	if err != nil || code != 0 {
		t.Fatalf("run %q: code %d err %v stderr %q", cmd, code, err, errb.String())
	}
	return out.String()
}

// TestMicroVM: create, exec, files and PTY in a VM; then a process started
// before a cross-worker move is still running after it, with its state;
// capabilities for the old execution are refused at both workers.
func TestMicroVM(t *testing.T) {
	lp := vmPlatform(t)
	sbx := newVM(t, lp)
	rec := lp.record(t, sbx.ID)
	if rec.Route.Substrate != identity.SubstrateMicroVM {
		t.Fatalf("base-vm runs on %q", rec.Route.Substrate)
	}

	// exec: a guest kernel of its own, not the host's.
	hostUname, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	if got := strings.TrimSpace(runOut(t, sbx, "uname -r")); got == "" || got == strings.TrimSpace(string(hostUname)) {
		t.Fatalf("guest kernel %q (host %q): not a VM", got, hostUname)
	}
	if got := runOut(t, sbx, "id -un"); got != "user\n" {
		t.Fatalf("default user %q", got)
	}

	// files
	ctx := ctxFor(t, time.Minute)
	if _, err := sbx.WriteFile(ctx, "/home/user/vm.txt", []byte("in the vm")); err != nil {
		t.Fatalf("write: %v", err)
	}
	if b, err := sbx.ReadFile(ctx, "/home/user/vm.txt"); err != nil || string(b) != "in the vm" {
		t.Fatalf("read: %q %v", b, err)
	}
	if got := runOut(t, sbx, "cat /home/user/vm.txt"); got != "in the vm" {
		t.Fatalf("file seen by a command: %q", got)
	}

	// PTY
	p, err := sbx.PTY(ctx, 24, 80)
	if err != nil {
		t.Fatalf("pty: %v", err)
	}
	if _, err := p.Write([]byte("stty size; printf 'vm-%s\\n' pty; exit\n")); err != nil {
		t.Fatalf("pty write: %v", err)
	}
	out, err := io.ReadAll(p)
	p.Close()
	if err != nil || !bytes.Contains(out, []byte("vm-pty")) || !bytes.Contains(out, []byte("24 80")) {
		t.Fatalf("pty output %q: %v", out, err)
	}

	// The guest clock stops while the VM is paused; after the resume the
	// agent steps it back to the RTC (the host's time).
	if r := lp.api(t, http.MethodPost, "/sandboxes/"+sbx.ID+"/pause", nil); r.status != http.StatusNoContent {
		t.Fatalf("pause: %d %s", r.status, r.body)
	}
	time.Sleep(5 * time.Second)
	if r := lp.api(t, http.MethodPost, "/v2/sandboxes/"+sbx.ID+"/connect", map[string]int{"timeout": 1800}); r.status != http.StatusOK && r.status != http.StatusCreated {
		t.Fatalf("resume: %d %s", r.status, r.body)
	}
	time.Sleep(2 * time.Second) // one clock sync tick
	guestNow, _ := strconv.ParseInt(strings.TrimSpace(runOut(t, sbx, "date +%s")), 10, 64)
	if d := time.Now().Unix() - guestNow; d > 3 || d < -3 {
		t.Fatalf("guest clock off by %ds after a 5s pause", d)
	}

	// A process with state in memory, started before the move.
	pid := strings.TrimSpace(runOut(t, sbx, `sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done' >/dev/null 2>&1 & echo $!`))
	if _, err := strconv.Atoi(pid); err != nil {
		t.Fatalf("background pid %q", pid)
	}
	time.Sleep(500 * time.Millisecond)
	before, _ := strconv.Atoi(strings.TrimSpace(runOut(t, sbx, "cat /tmp/counter")))
	if before < 1 {
		t.Fatalf("counter before the move: %d", before)
	}
	oldCap := lp.capability(t, sbx.ID, "files")
	from := rec.Route
	target := "w2"
	if from.WorkerID == "w2" {
		target = "w1"
	}

	mr := lp.migrate(t, sbx.ID, target)
	if mr.Route.WorkerID != target || mr.Route.Generation != from.Generation+1 || mr.ProcessesRestarted || !mr.FilesKept {
		t.Fatalf("migrate answer %+v", mr)
	}
	// Same process, its counter continued from where it was (not from 0),
	// files kept.
	if got := strings.TrimSpace(runOut(t, sbx, "kill -0 "+pid+" && echo alive")); got != "alive" {
		t.Fatalf("process %s after the move: %q", pid, got)
	}
	after, _ := strconv.Atoi(strings.TrimSpace(runOut(t, sbx, "cat /tmp/counter")))
	if after < before {
		t.Fatalf("counter went from %d to %d across the move: the state was lost", before, after)
	}
	if b, err := sbx.ReadFile(ctx, "/home/user/vm.txt"); err != nil || string(b) != "in the vm" {
		t.Fatalf("file after the move: %q %v", b, err)
	}
	// The guest reports the new identity.
	newCap := lp.capability(t, sbx.ID, "files")
	r := nodeGet(t, newCap.NodeURL, newCap.Token, "/files?path=/home/user/vm.txt", nil)
	if r.status != http.StatusOK || r.header.Get(spacev1.HeaderExecution) != mr.Route.ExecutionLabel() {
		t.Fatalf("new execution answers %d %q (want %s)", r.status, r.header.Get(spacev1.HeaderExecution), mr.Route.ExecutionLabel())
	}

	// The old execution's capability (unexpired) is refused at both
	// workers, before anything is forwarded.
	for _, url := range []string{oldCap.NodeURL, newCap.NodeURL} {
		r := nodeGet(t, url, oldCap.Token, "/files?path=/home/user/vm.txt", nil)
		e := wantJSONError(t, "old capability at "+url, r, http.StatusMisdirectedRequest)
		if r.header.Get(spacev1.HeaderRouteOutcome) != spacev1.OutcomeRefreshRoute || e.Reason == "" {
			t.Fatalf("old capability at %s: %v %+v", url, r.header, e)
		}
	}

	// Fork: each fork is a clone of the source's own snapshot, so it
	// keeps the running process (same pid, counter going on) and the
	// files, but takes its own identity: hostname and random numbers
	// differ from the other fork's.
	fr := lp.api(t, http.MethodPost, "/sandboxes/"+sbx.ID+"/fork", map[string]int{"count": 2, "timeout": 600})
	var forks []e2bapi.SandboxForkResult
	if fr.status != http.StatusCreated || json.Unmarshal(fr.body, &forks) != nil || len(forks) != 2 {
		t.Fatalf("fork: %d %s", fr.status, fr.body)
	}
	var rnd []string
	for _, f := range forks {
		if f.Sandbox == nil {
			t.Fatalf("fork failed: %+v", f.Error)
		}
		fs := lp.client(t).Attach(f.Sandbox.SandboxID, f.Sandbox.EnvdAccessToken)
		out := strings.Fields(runOut(t, fs, "kill -0 "+pid+" && echo alive; cat /tmp/counter /home/user/vm.txt; echo; hostname; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"))
		if len(out) != 7 || out[0] != "alive" || out[2] != "in" || out[6] == "" {
			t.Fatalf("fork %s: %q", f.Sandbox.SandboxID, out)
		}
		if n, _ := strconv.Atoi(out[1]); n < after {
			t.Fatalf("fork %s: counter %d, source had %d", f.Sandbox.SandboxID, n, after)
		}
		if out[5] != f.Sandbox.SandboxID {
			t.Errorf("fork %s has hostname %q", f.Sandbox.SandboxID, out[5])
		}
		rnd = append(rnd, out[6])
	}
	if rnd[0] == rnd[1] {
		t.Errorf("two forks drew the same random bytes %s", rnd[0])
	}
	if got := strings.TrimSpace(runOut(t, sbx, "kill -0 "+pid+" && echo alive")); got != "alive" {
		t.Fatalf("source after the fork: %q", got)
	}
}

// TestMicroVMChannelRebound: spaced-host refuses a VM channel whose socket
// path was re-bound by another process: the listener behind the path is
// not QEMU's (the running bridge keeps its verified connection).
func TestMicroVMChannelRebound(t *testing.T) {
	lp := vmPlatform(t)
	sbx := newVM(t, lp)
	rec := lp.record(t, sbx.ID)
	m := lp.worker(t, rec.Route.WorkerID).Manager()
	_, qemuPID, ok := m.BridgePID(sbx.ID)
	layer, ok2 := m.WritableLayer(sbx.ID)
	if !ok || !ok2 {
		t.Fatal("no activation for the VM")
	}
	dir := filepath.Dir(layer)
	sock := filepath.Join(dir, "guest.sock")
	if _, err := os.Stat(sock); err != nil {
		t.Fatalf("QEMU's chardev socket: %v", err)
	}
	// Another process's listener at the path (this test's).
	if err := os.Rename(sock, sock+".qemu"); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := os.Stat(sock + ".qemu"); err == nil {
			l.Close()
			os.Remove(sock)
			os.Rename(sock+".qemu", sock)
		}
	})
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go io.Copy(io.Discard, c)
		}
	}()
	want, _ := json.Marshal(rec.Route)
	cmd := exec.Command(filepath.Join(plat.cfg.BinDir, "spaced-host"),
		"--guest-socket", sock, "--guest-pid", strconv.Itoa(qemuPID), "--listen", filepath.Join(t.TempDir(), "h.sock"),
		"--expected", string(want), "--channel", "vmchan", "--activation-file", filepath.Join(dir, "activation.json"),
		"--boot-timeout", "5s")
	out, err := cmd.CombinedOutput()
	if err == nil || bytes.Contains(out, []byte("spaced-host ready")) {
		t.Fatalf("spaced-host accepted a re-bound channel socket: %v\n%s", err, out)
	}
	if !bytes.Contains(out, []byte("check failed")) {
		t.Fatalf("spaced-host failed without a transport check failure: %v\n%s", err, out)
	}
	t.Logf("new spaced-host rejected: %s", lastLine(out))
	// The running bridge re-checks the path per manager connection: while
	// the path names another socket it refuses new connections too.
	m.CloseIdleBridgeConns(sbx.ID)
	var errb bytes.Buffer
	if code, err := sbx.Run(ctxFor(t, time.Minute), "echo refused", sdk.RunOptions{Stderr: &errb}); err == nil || !strings.Contains(err.Error(), "path-inode check failed") {
		t.Fatalf("running bridge served with the path re-bound: code %d err %v", code, err)
	}
	// Path restored: served again.
	l.Close()
	os.Remove(sock)
	if err := os.Rename(sock+".qemu", sock); err != nil {
		t.Fatal(err)
	}
	if got := runOut(t, sbx, "echo still"); got != "still\n" {
		t.Fatalf("after the path was restored: %q", got)
	}
}

func lastLine(b []byte) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return lines[len(lines)-1]
}
