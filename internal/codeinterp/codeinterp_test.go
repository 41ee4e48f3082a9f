package codeinterp_test

import (
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/codeinterp"
)

func TestInstall(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "opt", "ci")
	if err := codeinterp.Install(dir); err != nil {
		t.Fatal(err)
	}
	var names []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		want := fs.FileMode(0o644)
		if d.IsDir() {
			want = 0o755 | fs.ModeDir
		}
		if info.Mode() != want {
			t.Errorf("%s: mode %v, want %v", p, info.Mode(), want)
		}
		rel, _ := filepath.Rel(dir, p)
		names = append(names, rel)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Join(names, " ")
	for _, want := range []string{codeinterp.Entry, "spaceci/__init__.py", "spaceci/kernel.py", "spaceci/charts.py", "spaceci/kernel_startup.py"} {
		if !strings.Contains(got, want) {
			t.Errorf("installed %s; %s missing", got, want)
		}
	}
	if strings.Contains(got, "__pycache__") || strings.Contains(got, "_test.go") {
		t.Errorf("installed more than the server: %s", got)
	}
	// Installing again over an existing tree (an image rebuild) works and
	// puts modes right.
	if err := os.Chmod(filepath.Join(dir, codeinterp.Entry), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := codeinterp.Install(dir); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(filepath.Join(dir, codeinterp.Entry)); fi.Mode() != 0o644 {
		t.Errorf("reinstall left mode %v", fi.Mode())
	}
	if h := codeinterp.ContentHash(); len(h) != 64 || h != codeinterp.ContentHash() {
		t.Errorf("content hash %q", h)
	}
}

func TestCommands(t *testing.T) {
	start := codeinterp.StartCommand()
	if !strings.Contains(start, filepath.Join(codeinterp.InstallDir, codeinterp.Entry)) || !strings.Contains(start, "--port 49999") {
		t.Errorf("start command %q", start)
	}
	ready := codeinterp.ReadyCommand()
	if !strings.Contains(ready, "http://127.0.0.1:49999/health") {
		t.Errorf("ready command %q", ready)
	}
	requirePython(t)
	// Nothing listens: the ready command fails (unless this host runs a
	// server on 49999, which a test cannot tell from ours).
	if l, err := net.Listen("tcp", "127.0.0.1:49999"); err == nil {
		l.Close()
		if err := exec.Command("sh", "-c", ready).Run(); err == nil {
			t.Errorf("ready command succeeded with nothing listening")
		}
	}
}
