package restart

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
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
