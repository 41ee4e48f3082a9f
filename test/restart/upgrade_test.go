package restart

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// An operator upgrades SPACE: `space up` stops (SIGINT, as systemd or
// Ctrl-C would) leaving the sandboxes running, and a newer build starts on
// the same data. The sandboxes are re-adopted as they were: same
// execution, files, and a background process with the same pid; and the
// new build creates sandboxes as before.
func TestUpgradeRestartKeepsSandboxes(t *testing.T) {
	testenv.RequirePlatform(t)
	bin, cleanup, err := testenv.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	defer cleanup()
	dir := t.TempDir()
	p1, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir, BinDir: bin, KeepSandboxes: true})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c1 := client(t, p1)
	s := create(ctx, t, c1, "upgrade")
	var out bytes.Buffer
	if code, err := s.Run(ctx, "sleep 600 >/dev/null 2>&1 & echo $!", sdk.RunOptions{Stdout: &out}); err != nil || code != 0 {
		t.Fatalf("background process: %d %v", code, err)
	}
	bgPID := strings.TrimSpace(out.String())
	before := currentRoute(ctx, t, p1, s.ID)

	stopped := time.Now()
	if err := p1.Stop(); err != nil {
		t.Fatal(err)
	}
	shutdown := time.Since(stopped)

	// A newer build: other files (other inodes) with other content.
	newBin := t.TempDir()
	if err := copyBinaries(bin, newBin); err != nil {
		t.Fatal(err)
	}
	p2, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir, BinDir: newBin, LogLevel: "info"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("space up log after the upgrade:\n%s", p2.Log())
		}
		if err := p2.Stop(); err != nil {
			t.Error(err)
		}
	})
	c2 := client(t, p2)
	s2 := c2.Attach(s.ID, s.AccessToken)
	if got, err := s2.ReadFile(ctx, "/home/user/upgrade.txt"); err != nil || string(got) != "kept upgrade" {
		t.Fatalf("file after the upgrade: %q, %v", got, err)
	}
	out.Reset()
	if code, err := s2.Run(ctx, "cat /proc/"+bgPID+"/cmdline | tr '\\0' ' '", sdk.RunOptions{Stdout: &out}); err != nil || code != 0 || !strings.HasPrefix(out.String(), "sleep 600") {
		t.Fatalf("background process %s after the upgrade: exit %d, %v, %q", bgPID, code, err, out.String())
	}
	if after := currentRoute(ctx, t, p2, s.ID); after.Route != before.Route {
		t.Fatalf("after the upgrade the sandbox runs %+v, want the same execution %+v", after.Route, before.Route)
	}
	if n := auditCount(t, p2, `"decision":"adopted"`); n != 1 {
		t.Errorf("audited %d adopted executions, want 1", n)
	}
	fresh := create(ctx, t, c2, "fresh")
	assertRuns(ctx, t, fresh)
	t.Logf("space up stopped in %.2fs leaving its sandbox running; the upgraded build re-adopted it (same execution, background pid %s kept)",
		shutdown.Seconds(), bgPID)
}

// copyBinaries copies every file of src to dst with 16 random bytes
// appended: an ELF ignores trailing bytes, so each runs as before but is
// another file with another SHA-256, as a rebuilt binary is.
func copyBinaries(src, dst string) error {
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range ents {
		in, err := os.Open(filepath.Join(src, e.Name()))
		if err != nil {
			return err
		}
		out, err := os.OpenFile(filepath.Join(dst, e.Name()), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
		if err != nil {
			in.Close()
			return err
		}
		_, err = io.Copy(out, in)
		in.Close()
		if err == nil {
			_, err = io.CopyN(out, rand.Reader, 16)
		}
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("copy %s: %w", e.Name(), err)
		}
	}
	return nil
}

// Two platforms on one host (other data dirs, both with a worker w1): the
// start of one ends nothing of the other's (each worker sweeps only its
// own cgroup parent of sandboxes it has no record of).
func TestTwoPlatformsOnOneHostKeepTheirSandboxes(t *testing.T) {
	testenv.RequirePlatform(t)
	p1 := testenv.StartPlatform(t, testenv.PlatformOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s := create(ctx, t, client(t, p1), "first")
	before := currentRoute(ctx, t, p1, s.ID)
	p2 := testenv.StartPlatform(t, testenv.PlatformOptions{})
	assertRuns(ctx, t, create(ctx, t, client(t, p2), "second"))
	assertRuns(ctx, t, s)
	// Served by the same execution: not ended and recovered meanwhile.
	if after := currentRoute(ctx, t, p1, s.ID); after.Route != before.Route {
		t.Fatalf("the first platform's sandbox runs %+v after the second started, want still %+v", after.Route, before.Route)
	}
}
