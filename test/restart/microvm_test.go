package restart

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// A microVM outlives a crash of `space up` (SIGKILL) and is re-adopted:
// the same execution, its in-memory files and a background process with
// the same pid, served again through the same spaced-host and its one
// channel to QEMU.
func TestMicroVMIsReadoptedAfterACrash(t *testing.T) {
	testenv.RequirePlatform(t)
	dir := t.TempDir()
	p1, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir, KeepSandboxes: true})
	if err != nil {
		t.Fatal(err)
	}
	killed := false
	defer func() {
		if !killed {
			p1.Stop()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	if why := microVMUnavailable(ctx, t, p1); why != "" {
		testenv.Skipf(t, "microvm: %s", why)
	}
	c1 := client(t, p1)
	s, err := c1.CreateSandbox(ctx, sdk.CreateOptions{Template: "base-vm", Timeout: 10 * time.Minute})
	if err != nil {
		t.Fatalf("create base-vm: %v", err)
	}
	if _, err := s.WriteFile(ctx, "/home/user/vm.txt", []byte("kept in memory")); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if code, err := s.Run(ctx, "sleep 600 >/dev/null 2>&1 & echo $!", sdk.RunOptions{Stdout: &out}); err != nil || code != 0 {
		t.Fatalf("background process: %d %v", code, err)
	}
	bgPID := strings.TrimSpace(out.String())
	before := currentRoute(ctx, t, p1, s.ID)
	killed = true
	if err := p1.Kill(); err != nil {
		t.Fatal(err)
	}

	p2, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir, LogLevel: "info"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("space up log after the restart:\n%s", p2.Log())
		}
		if err := p2.Stop(); err != nil {
			t.Error(err)
		}
	})
	s2 := client(t, p2).Attach(s.ID, s.AccessToken)
	var got []byte
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if got, err = s2.ReadFile(ctx, "/home/user/vm.txt"); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil || string(got) != "kept in memory" {
		t.Fatalf("file in the VM's memory after the restart: %q, %v", got, err)
	}
	out.Reset()
	if code, err := s2.Run(ctx, "cat /proc/"+bgPID+"/cmdline | tr '\\0' ' '", sdk.RunOptions{Stdout: &out}); err != nil || code != 0 || !strings.HasPrefix(out.String(), "sleep 600") {
		t.Fatalf("background process %s after the restart: exit %d, %v, %q", bgPID, code, err, out.String())
	}
	if after := currentRoute(ctx, t, p2, s.ID); after.Route != before.Route {
		t.Fatalf("after the restart the VM runs %+v, want the same execution %+v", after.Route, before.Route)
	}
	if n := auditCount(t, p2, `"decision":"adopted"`); n != 1 {
		t.Errorf("audited %d adopted executions, want 1", n)
	}
}

// microVMUnavailable says why no worker of p runs microVMs, or "".
func microVMUnavailable(ctx context.Context, t *testing.T, p *testenv.Platform) string {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, p.APIURL+"/space/v1/workers", nil)
	req.Header.Set(spacev1.HeaderAPIKey, p.APIKey)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var ws []spacev1.Worker
	if err := json.NewDecoder(res.Body).Decode(&ws); err != nil {
		t.Fatal(err)
	}
	for _, w := range ws {
		if w.Serves(identity.SubstrateMicroVM) {
			return ""
		}
		if why := w.Unavailable[identity.SubstrateMicroVM]; why != "" {
			return why
		}
	}
	return "no worker runs the microvm substrate (no guest kernel: make vm-deps)"
}

// A base-vm sandbox (the Debian image: its files on its layer disk) whose
// QEMU is killed while it is served (an OOM kill, a crash) comes back by
// itself, through the edge, as a new execution booted on that disk: its
// files, id, metadata and timeout kept, its processes restarted.
func TestVMWhoseQEMUDiedIsRecovered(t *testing.T) {
	p := testenv.StartPlatform(t, testenv.PlatformOptions{LogLevel: "info"})
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	if why := microVMUnavailable(ctx, t, p); why != "" {
		testenv.Skipf(t, "microvm: %s", why)
	}
	c := client(t, p)
	s, info, before := createVM(ctx, t, c, p)
	qemu := qemuOf(t, p, before.Route)
	if err := syscall.Kill(qemu, syscall.SIGKILL); err != nil {
		t.Fatalf("kill qemu %d: %v", qemu, err)
	}
	killed := time.Now()
	after := waitRecovered(ctx, t, c, p, s, info, before, 4*time.Minute)
	t.Logf("base-vm sandbox served again %.2fs after its QEMU was killed, as generation %d on %s",
		time.Since(killed).Seconds(), after.Route.Generation, after.Route.WorkerID)
	for _, d := range []string{"lost", "layer-saved"} {
		if n := auditCount(t, p, `"decision":"`+d+`"`); n != 1 {
			t.Errorf("the worker audited %d %q decisions, want 1", n, d)
		}
	}
	if n := auditCount(t, p, `"decision":"unrecoverable"`); n != 0 {
		t.Errorf("audited %d unrecoverable executions", n)
	}
}

// A base-vm sandbox whose QEMU dies while its worker is down (space up
// killed, then QEMU) cannot be re-adopted; the restarted worker reclaims
// it and it comes back from its layer disk, as above. (The test's name is
// short: its temporary directory holds the VM's sockets.)
func TestVMLostWithWorkerIsRecovered(t *testing.T) {
	testenv.RequirePlatform(t)
	dir := t.TempDir()
	p1, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir, KeepSandboxes: true})
	if err != nil {
		t.Fatal(err)
	}
	killed := false
	defer func() {
		if !killed {
			p1.Stop()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	if why := microVMUnavailable(ctx, t, p1); why != "" {
		testenv.Skipf(t, "microvm: %s", why)
	}
	c1 := client(t, p1)
	s, info, before := createVM(ctx, t, c1, p1)
	qemu := qemuOf(t, p1, before.Route)
	killed = true
	if err := p1.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(qemu, syscall.SIGKILL); err != nil {
		t.Fatalf("kill qemu %d: %v", qemu, err)
	}

	p2, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir, LogLevel: "info"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("space up log after the restart:\n%s", p2.Log())
		}
		if err := p2.Stop(); err != nil {
			t.Error(err)
		}
	})
	restarted := time.Now()
	c2 := client(t, p2)
	after := waitRecovered(ctx, t, c2, p2, c2.Attach(s.ID, s.AccessToken), info, before, 4*time.Minute)
	t.Logf("base-vm sandbox served again %.2fs after the restart, as generation %d", time.Since(restarted).Seconds(), after.Route.Generation)
	for _, d := range []string{"not-adopted", "reclaimed", "layer-saved"} {
		if n := auditCount(t, p2, `"decision":"`+d+`"`); n != 1 {
			t.Errorf("the worker audited %d %q decisions, want 1", n, d)
		}
	}
	if n := auditCount(t, p2, `"decision":"unrecoverable"`); n != 0 {
		t.Errorf("audited %d unrecoverable executions", n)
	}
}

// createVM creates a base-vm sandbox holding /home/user/vm.txt and a
// background process, and returns it, its info and its execution.
func createVM(ctx context.Context, t *testing.T, c *sdk.Client, p *testenv.Platform) (*sdk.Sandbox, *sdk.SandboxInfo, spacev1.Execution) {
	t.Helper()
	s, err := c.CreateSandbox(ctx, sdk.CreateOptions{Template: "base-vm", Timeout: 10 * time.Minute, Metadata: map[string]string{"name": "vm"}})
	if err != nil {
		t.Fatalf("create base-vm: %v", err)
	}
	if _, err := s.WriteFile(ctx, "/home/user/vm.txt", []byte("kept on the layer disk")); err != nil {
		t.Fatal(err)
	}
	if code, err := s.Run(ctx, "sleep 99999 >/dev/null 2>&1 & sync", sdk.RunOptions{}); err != nil || code != 0 {
		t.Fatalf("background process: %d %v", code, err)
	}
	info, err := c.GetSandbox(ctx, s.ID)
	if err != nil {
		t.Fatal(err)
	}
	return s, info, currentRoute(ctx, t, p, s.ID)
}

// waitRecovered waits (up to d) until the control plane runs s as a new
// execution, then checks through the edge that it serves its file, runs
// commands without the old background process, and kept its metadata and
// timeout. No read is sent before: the control plane holds a capability
// request while the recovery runs, and one held past the edge's own 10 s
// bound (DefaultControlPlaneTimeout) is answered 200 with no body (the
// edge takes its own deadline for the client's end and writes nothing).
func waitRecovered(ctx context.Context, t *testing.T, c *sdk.Client, p *testenv.Platform, s *sdk.Sandbox, info *sdk.SandboxInfo,
	before spacev1.Execution, d time.Duration) spacev1.Execution {
	t.Helper()
	var after spacev1.Execution
	for deadline := time.Now().Add(d); after.Route.Generation == 0; {
		for _, e := range executions(ctx, t, p, s.ID) {
			if e.State == "running" && e.Route.Generation > before.Route.Generation {
				after = e
			}
		}
		if after.Route.Generation != 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no new execution %v after its QEMU died: %+v", d, executions(ctx, t, p, s.ID))
		}
		time.Sleep(100 * time.Millisecond)
	}
	got, err := s.ReadFile(ctx, "/home/user/vm.txt")
	if err != nil || string(got) != "kept on the layer disk" {
		t.Fatalf("after its QEMU died: %q, %v", got, err)
	}
	if after.Route.Generation <= before.Route.Generation || after.Route.ExecutionID == before.Route.ExecutionID {
		t.Errorf("runs %+v, want a new execution after %+v", after.Route, before.Route)
	}
	now, err := c.GetSandbox(ctx, s.ID)
	if err != nil {
		t.Fatal(err)
	}
	if now.Metadata["name"] != info.Metadata["name"] || !now.EndAt.Equal(info.EndAt) || now.TemplateID != info.TemplateID {
		t.Errorf("after the recovery: metadata %v end %v template %q, want %v %v %q", now.Metadata, now.EndAt, now.TemplateID,
			info.Metadata, info.EndAt, info.TemplateID)
	}
	assertRuns(ctx, t, s)
	var out bytes.Buffer
	// The pattern does not match its own command line.
	if code, err := s.Run(ctx, `for f in /proc/[0-9]*/cmdline; do tr '\0' ' ' <$f; echo; done | grep -c 'sleep 9999[9]'; true`, sdk.RunOptions{Stdout: &out}); err != nil || code != 0 || strings.TrimSpace(out.String()) != "0" {
		t.Errorf("old background process after the recovery: %d %v %q, want none (the VM booted)", code, err, out.String())
	}
	return after
}

// qemuOf returns the pid of the QEMU running r, from its adoption record
// in r's activation directory.
func qemuOf(t *testing.T, p *testenv.Platform, r identity.Route) int {
	t.Helper()
	recs, _ := filepath.Glob(filepath.Join(p.DataDir, "workers", "*", "act", "*", "vm.json"))
	for _, f := range recs {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		var st struct {
			PID   int            `json:"pid"`
			Route identity.Route `json:"route"`
		}
		if json.Unmarshal(b, &st) == nil && st.Route == r && st.PID > 0 {
			cmd, _ := os.ReadFile("/proc/" + strconv.Itoa(st.PID) + "/cmdline")
			if !bytes.HasPrefix(cmd, []byte("qemu-system")) {
				t.Fatalf("pid %d of %s runs %q, not QEMU", st.PID, f, cmd)
			}
			return st.PID
		}
	}
	t.Fatalf("no QEMU record for %s among %v", r, recs)
	return 0
}
