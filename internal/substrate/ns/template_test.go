//go:build linux

package ns

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/spacesbx/space/internal/testenv"
)

func TestTemplateBase(t *testing.T) {
	testenv.RequireRoot(t, "chown")
	s := &Substrate{cfg: Config{StateDir: t.TempDir()}.withDefaults(), tmplReady: map[string]bool{}}
	dir, err := s.ensureTemplate(TemplateBase)
	if err != nil {
		t.Fatal(err)
	}
	for _, secret := range []string{"etc/shadow", "etc/gshadow", "etc/ssh", "etc/sudoers.d", "etc/machine-id", "etc/ssl/private"} {
		if _, err := os.Lstat(filepath.Join(dir, secret)); !os.IsNotExist(err) {
			t.Errorf("template has %s", secret)
		}
	}
	// The template's own sudoers, never the host's.
	if b, _ := os.ReadFile(filepath.Join(dir, "etc/sudoers")); string(b) != baseSudoers {
		t.Errorf("sudoers %q", b)
	}
	if fi, err := os.Stat(filepath.Join(dir, "etc/sudoers")); err != nil || fi.Mode().Perm() != 0o440 {
		t.Errorf("sudoers mode: %v %v", fi, err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "etc/passwd")); string(b) != basePasswd {
		t.Errorf("passwd %q", b)
	}
	for p, want := range map[string]os.FileMode{"root": 0o700 | os.ModeDir, "tmp": 0o777 | os.ModeDir | os.ModeSticky, "var/tmp": 0o777 | os.ModeDir | os.ModeSticky, "home/user": 0o755 | os.ModeDir} {
		fi, err := os.Stat(filepath.Join(dir, p))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode()&(os.ModeDir|os.ModeSticky|os.ModePerm) != want&(os.ModeDir|os.ModeSticky|os.ModePerm) {
			t.Errorf("%s mode %v, want %v", p, fi.Mode(), want)
		}
	}
	if fi, _ := os.Stat(filepath.Join(dir, "home/user")); fi.Sys().(*syscall.Stat_t).Uid != 1000 {
		t.Error("home/user not owned by 1000")
	}
	if l, _ := os.Readlink(filepath.Join(dir, "bin")); l != "usr/bin" {
		t.Errorf("bin -> %q", l)
	}
	// Idempotent, and rebuilt when the stamp changes.
	if _, err := s.ensureTemplate(TemplateBase); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, templateStamp), []byte("base-v0"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "stale"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	s2 := &Substrate{cfg: s.cfg, tmplReady: map[string]bool{}}
	if _, err := s2.ensureTemplate(TemplateBase); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, templateStamp)); string(b) != baseVersion {
		t.Errorf("stamp %q after rebuild", b)
	}
	if _, err := os.Lstat(filepath.Join(dir, "stale")); !os.IsNotExist(err) {
		t.Error("old template not replaced")
	}
	// The outdated template is kept aside whole (an adopted sandbox may
	// still have it as its lower layer); nothing else is left.
	ents, _ := os.ReadDir(filepath.Dir(dir))
	kept := 0
	for _, e := range ents {
		switch {
		case e.Name() == TemplateBase || e.Name() == ".lock":
		case strings.HasPrefix(e.Name(), TemplateBase+".old-"):
			kept++
			if _, err := os.Lstat(filepath.Join(filepath.Dir(dir), e.Name(), "stale")); err != nil {
				t.Errorf("outdated template not kept whole: %v", err)
			}
		default:
			t.Errorf("leftover %s in templates dir", e.Name())
		}
	}
	if kept != 1 {
		t.Errorf("%d outdated templates kept, want 1", kept)
	}
}
