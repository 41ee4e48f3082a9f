package sbxmanager

import (
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
)

func TestInstallReplacementRejectsOldAndEndsStreams(t *testing.T) {
	f := newFixture(t)
	f.install(t, route("sbxa", 1))
	old := f.token(t, route("sbxa", 1), capability.PurposeProcess)
	req, _ := http.NewRequest("POST", f.srv.URL+"/process.Process/Start", nil)
	req.Header.Set(spacev1.HeaderCapability, old)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("stream open: %v", err)
	}
	streamEnded := make(chan error, 1)
	go func() { _, err := io.ReadAll(resp.Body); resp.Body.Close(); streamEnded <- err }()

	f.install(t, route("sbxa", 2)) // the replacement execution
	select {
	case <-streamEnded:
	case <-time.After(5 * time.Second):
		t.Fatal("stream of the replaced execution still open")
	}
	// The old capability, still unexpired, is rejected at once.
	if resp, _ := f.get(t, "/files", f.token(t, route("sbxa", 1), capability.PurposeFiles)); resp.StatusCode != 421 {
		t.Fatalf("old execution: %d", resp.StatusCode)
	}
	if resp, body := f.get(t, "/files", f.token(t, route("sbxa", 2), capability.PurposeFiles)); resp.StatusCode != 200 || body != "file of sbxa gen 2" {
		t.Fatalf("new execution: %d %s", resp.StatusCode, body)
	}
	// An install older than what is installed is a conflict.
	if _, err := f.m.Install(context.Background(), spacev1.InstallRequest{Route: route("sbxa", 1)}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("older install: %v", err)
	}
}

// While a replacement is being installed on the same worker, the old
// execution's capabilities get RefreshRoute (the edge repairs them once the
// new route is published), never "installed but not active".
func TestInstallReplacementWindowIsRefreshRoute(t *testing.T) {
	f := newFixture(t)
	f.install(t, route("sbxa", 1))
	sub := f.m.subs["ns"].(*fakeSubstrate)
	gate := make(chan struct{})
	sub.mu.Lock()
	sub.startGate = gate
	sub.mu.Unlock()
	done := make(chan error, 1)
	go func() {
		_, err := f.m.Install(context.Background(), spacev1.InstallRequest{Route: route("sbxa", 2), Template: "base"})
		done <- err
	}()
	old := f.token(t, route("sbxa", 1), capability.PurposeFiles)
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, body := f.get(t, "/files", old)
		if resp.StatusCode == http.StatusMisdirectedRequest {
			if resp.Header.Get(spacev1.HeaderRouteOutcome) != spacev1.OutcomeRefreshRoute {
				t.Fatalf("421 without refresh-route: %v", resp.Header)
			}
			break
		}
		if resp.StatusCode != http.StatusOK || time.Now().After(deadline) {
			t.Fatalf("old capability during the replacement: %d %s", resp.StatusCode, body)
		}
		time.Sleep(2 * time.Millisecond)
	}
	close(gate)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if resp, body := f.get(t, "/files", f.token(t, route("sbxa", 2), capability.PurposeFiles)); resp.StatusCode != 200 || body != "file of sbxa gen 2" {
		t.Fatalf("new execution: %d %s", resp.StatusCode, body)
	}
}

func TestInstallValidation(t *testing.T) {
	f := newFixture(t)
	other := route("sbxa", 1)
	other.WorkerID = "w2"
	for name, r := range map[string]identity.Route{"other worker": other, "invalid": {SandboxID: "Bad"}} {
		if _, err := f.m.Install(context.Background(), spacev1.InstallRequest{Route: r}); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestTeardown(t *testing.T) {
	f := newFixture(t)
	f.install(t, route("sbxa", 2))
	if err := f.m.Teardown(context.Background(), route("sbxa", 1)); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("stale teardown: %v", err)
	}
	if err := f.m.Teardown(context.Background(), route("sbxa", 2)); err != nil {
		t.Fatal(err)
	}
	if resp, _ := f.get(t, "/files", f.token(t, route("sbxa", 2), capability.PurposeFiles)); resp.StatusCode != 421 {
		t.Fatalf("after teardown: %d", resp.StatusCode)
	}
	if err := f.m.Teardown(context.Background(), route("sbxa", 2)); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("second teardown: %v", err)
	}
}

// children lists the pids of this process's children.
func children(t *testing.T) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	tasks, _ := filepath.Glob("/proc/self/task/*/children")
	for _, f := range tasks {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // a thread that exited meanwhile
		}
		for _, pid := range strings.Fields(string(b)) {
			out[pid] = true
		}
	}
	return out
}

// spaced-host is launched before the sandbox starts; when the start fails
// it is killed and reaped, and nothing is installed.
func TestBridgeLaunchedAheadIsReapedWhenStartFails(t *testing.T) {
	f := newFixture(t)
	sub := f.m.subs["ns"].(*fakeSubstrate)
	sub.mu.Lock()
	sub.startErr = errors.New("no room")
	sub.mu.Unlock()
	before := children(t)
	if _, err := f.m.Install(context.Background(), spacev1.InstallRequest{Route: route("sbxa", 1), Template: "base"}); err == nil || !strings.Contains(err.Error(), "no room") {
		t.Fatalf("install with a failing start: %v", err)
	}
	for pid := range children(t) {
		if !before[pid] {
			exe, _ := os.Readlink("/proc/" + pid + "/exe")
			t.Errorf("child %s (%s) left behind by a failed install", pid, exe)
		}
	}
	if _, ok := f.m.Installed("sbxa"); ok || f.m.Active() != 0 {
		t.Fatal("a failed install left a record or an activation")
	}
	// The next start works and is bridged as usual.
	sub.mu.Lock()
	sub.startErr = nil
	sub.mu.Unlock()
	f.install(t, route("sbxa", 1))
	if resp, body := f.get(t, "/files", f.token(t, route("sbxa", 1), capability.PurposeFiles)); resp.StatusCode != 200 || body != "file of sbxa gen 1" {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
}
