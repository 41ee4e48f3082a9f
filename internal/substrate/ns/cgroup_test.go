//go:build linux

package ns

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/testenv"
)

func TestUnescapeMount(t *testing.T) {
	if got := unescapeMount(`/a\040b\011c`); got != "/a b\tc" {
		t.Fatalf("got %q", got)
	}
}

// TestCgroupV2FreezeKill exercises the v2 freeze, kill and removal paths on
// a cgroup2 hierarchy: the host's own when it is pure v2, otherwise the
// hybrid one at /sys/fs/cgroup/unified (which needs no controllers for
// cgroup.freeze and cgroup.kill). Limits are covered by the sandbox tests
// on pure v2 hosts only.
func TestCgroupV2FreezeKill(t *testing.T) {
	testenv.RequireRoot(t, "cgroups")
	root := cgroupRoot
	if _, err := os.Stat(filepath.Join(root, "cgroup.controllers")); err != nil {
		root = filepath.Join(cgroupRoot, "unified")
	}
	if _, err := os.Stat(filepath.Join(root, "cgroup.controllers")); err != nil {
		testenv.Skipf(t, "no cgroup2 hierarchy mounted")
	}
	parent := filepath.Join(root, "space")
	createdParent := false
	if _, err := os.Stat(parent); os.IsNotExist(err) {
		if err := os.Mkdir(parent, 0o755); err != nil {
			testenv.Skipf(t, "cannot create a cgroup2 group: %v", err)
		}
		createdParent = true
	}
	defer func() {
		if createdParent {
			_ = os.Remove(parent)
		}
	}()
	dir := filepath.Join(parent, "cgtest-"+randID(4))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "cgroup.kill")); err != nil {
		_ = os.Remove(dir)
		testenv.Skipf(t, "kernel without cgroup.kill")
	}
	cg := &cgroup{v2: true, dirs: []string{dir}, initDirs: []string{dir}, freezerDirs: []string{dir}}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitCh := make(chan error, 1)
	go func() { waitCh <- cmd.Wait() }()
	if err := cg.add(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := cg.freeze(ctx, true); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "cgroup.events")); !strings.Contains(string(b), "frozen 1") {
		t.Fatalf("cgroup.events after freeze: %q", b)
	}
	if err := cg.freeze(ctx, false); err != nil {
		t.Fatal(err)
	}
	if err := cg.freeze(ctx, true); err != nil {
		t.Fatal(err)
	}
	// remove kills the frozen task and removes the group.
	if err := cg.remove(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-waitCh:
	case <-time.After(5 * time.Second):
		t.Fatal("task survived remove")
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("group still exists: %v", err)
	}
}
