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

// A nested cgroup parent on v2: memory, pids and cpu are enabled for the
// children of the root and of every group down to the parent (a fake
// hierarchy: this checks the walk, the kernel the rest).
func TestEnableV2ControllersNested(t *testing.T) {
	root := t.TempDir()
	write := func(rel, s string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Join(root, filepath.Dir(rel)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, rel), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("cgroup.controllers", "cpuset cpu io memory pids\n")
	write("cgroup.subtree_control", "cpu memory pids\n")
	write("space/cgroup.subtree_control", "memory\n")
	write("space/w1/cgroup.subtree_control", "")
	if err := enableV2Controllers(root, "space/w1"); err != nil {
		t.Fatal(err)
	}
	for rel, want := range map[string]string{
		"cgroup.subtree_control":          "cpu memory pids\n", // complete: not written
		"space/cgroup.subtree_control":    "+pids +cpu",
		"space/w1/cgroup.subtree_control": "+memory +pids +cpu",
	} {
		if b, _ := os.ReadFile(filepath.Join(root, rel)); string(b) != want {
			t.Errorf("%s = %q, want %q", rel, b, want)
		}
	}
	write("cgroup.controllers", "cpu memory\n")
	if err := enableV2Controllers(root, "space/w1"); err == nil || !strings.Contains(err.Error(), "pids") {
		t.Fatalf("a missing controller: %v", err)
	}
}
