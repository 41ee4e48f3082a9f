//go:build linux

package ns

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/baseimage"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

var (
	baseOnce sync.Once
	baseImg  baseimage.Base
	baseWhy  string
)

// needBaseImage returns the Debian base image, building it (minutes,
// once per machine) when it is missing and this host can; it skips the
// test, saying why, when it cannot.
func needBaseImage(t *testing.T) *substrate.Image {
	t.Helper()
	needRoot(t)
	baseOnce.Do(func() {
		b, err := baseimage.Lookup(baseimage.Config{})
		if errors.Is(err, errdefs.ErrNotFound) {
			if why := baseimage.Unbuildable(baseimage.Config{}); why != "" {
				baseWhy = "the Debian base image is not built and cannot be: " + why
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
			defer cancel()
			b, err = baseimage.Ensure(ctx, baseimage.Config{}, nil)
		}
		if err != nil {
			baseWhy = "the Debian base image is unavailable: " + err.Error()
			return
		}
		baseImg = b
	})
	if baseWhy != "" {
		testenv.Skipf(t, "%s", baseWhy)
	}
	return &substrate.Image{ID: baseImg.ID, Layers: []string{baseImg.Dir}, Env: baseImg.Env}
}

// startImage starts a sandbox of img on s (stopped and checked when the
// test ends).
func startImage(t *testing.T, s *Substrate, img *substrate.Image) (*instance, substrate.Spec) {
	t.Helper()
	spec := newSpec(t, substrate.Limits{})
	spec.Image = img
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	in, err := s.Start(ctx, spec)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	inst := in.(*instance)
	t.Cleanup(func() { stopAndCheck(t, inst) })
	return inst, spec
}

// TestDebianBase: a sandbox of the Debian base image has E2B's userland
// and account, no host /usr, sudo for user (root of the sandbox's
// namespace only), and keeps its files across a restart.
func TestDebianBase(t *testing.T) {
	img := needBaseImage(t)
	s := needRoot(t)
	if !s.userns {
		testenv.Skipf(t, "sudo in the base image needs user namespaces, unavailable here: %s", userNamespacesUnsupported())
	}
	inst, spec := startImage(t, s, img)
	out := mustOK(t, inst, 1000, "python3 --version && node --version && npm --version && git --version && curl --version | head -1 && gcc --version | head -1 && cat /etc/debian_version")
	for _, w := range []string{"Python 3.", "v", "git version", "curl ", "gcc "} {
		if !strings.Contains(out, w) {
			t.Errorf("versions lack %q:\n%s", w, out)
		}
	}
	if out := mustOK(t, inst, 1000, "id"); !strings.HasPrefix(out, "uid=1000(user) gid=1000(user)") {
		t.Errorf("id as user: %q", out)
	}
	if out := mustOK(t, inst, 1000, "sudo -n id -u"); strings.TrimSpace(out) != "0" {
		t.Errorf("sudo id -u as user: %q", out)
	}
	mustOK(t, inst, 1000, "sudo -n sh -c 'echo r > /root/by-sudo' && sudo -n test -s /root/by-sudo")
	// Root through sudo is still the sandbox's root.
	mustFail(t, inst, 1000, "sudo -n mount -t tmpfs x /mnt")
	// Nothing of the host: no /usr mount, and the root is not nosuid (sudo
	// works through it) but is nodev.
	mi := mustOK(t, inst, 0, "cat /proc/self/mountinfo")
	for _, line := range strings.Split(mi, "\n") {
		f := strings.Fields(line)
		if len(f) < 6 {
			continue
		}
		switch f[4] {
		case "/usr":
			t.Errorf("a /usr mount in a sandbox of an image: %s", line)
		case "/":
			if strings.Contains(f[5], "nosuid") || !strings.Contains(f[5], "nodev") {
				t.Errorf("root mount options %s: want suid, nodev", f[5])
			}
		}
	}
	// The hostname resolves (sudo looks it up) and the agent's mount
	// point is the image's own.
	mustOK(t, inst, 1000, "getent hosts $(hostname) && test -f /.space/spaced-guest")
	// pip installs as user (into ~/.local), as in E2B's images.
	mustOK(t, inst, 1000, `mkdir -p /tmp/hello && cd /tmp/hello && echo 'def hi(): return "hi"' > hello.py &&
printf 'from setuptools import setup\nsetup(name="hello", version="1", py_modules=["hello"])\n' > setup.py &&
pip install -q --no-index --no-build-isolation . && cd / && python -c 'import hello; print(hello.hi())' | grep -qx hi`)
	// Files persist across a restart on the same directory.
	mustOK(t, inst, 1000, "echo kept > /home/user/kept && pip3 --version >/dev/null && python3 -m venv /tmp/venv")
	next := restartOnSameDir(t, s, inst, spec)
	if out := mustOK(t, next, 1000, "cat /home/user/kept && /tmp/venv/bin/python -c 'print(1)'"); out != "kept\n1\n" {
		t.Errorf("after a restart: %q", out)
	}
}

// TestImageWithoutUserNamespaces: without a user namespace set-uid root
// would be host root, so the image's root stays nosuid and sudo refuses.
func TestImageWithoutUserNamespaces(t *testing.T) {
	img := needBaseImage(t)
	s, err := New(Config{StateDir: testState, NoUserNamespaces: true, NoWarmInit: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	inst, _ := startImage(t, s, img)
	if out := mustOK(t, inst, 0, `awk '$5=="/"{print $6}' /proc/self/mountinfo`); !strings.Contains(out, "nosuid") {
		t.Errorf("root mount options %q: want nosuid without a user namespace", out)
	}
	if out := mustFail(t, inst, 1000, "sudo -n id -u 2>&1"); strings.TrimSpace(out) == "0" {
		t.Errorf("sudo made user root without a user namespace: %q", out)
	}
	mustOK(t, inst, 1000, "python3 -c 'import sys' && id -u | grep -qx 1000")
}

// TestTemplateImages: Config.Images gives a template its image; base-host
// is the host template whatever Images says.
func TestTemplateImages(t *testing.T) {
	img := needBaseImage(t)
	s, err := New(Config{StateDir: testState, NoWarmInit: true, Images: map[string]substrate.Image{TemplateBase: *img}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	for tmpl, want := range map[string]string{TemplateBase: "Debian", TemplateBaseHost: "SPACE sandbox"} {
		spec := newSpec(t, substrate.Limits{})
		spec.Template = tmpl
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		in, err := s.Start(ctx, spec)
		cancel()
		if err != nil {
			t.Fatalf("%s: %v", tmpl, err)
		}
		inst := in.(*instance)
		t.Cleanup(func() { stopAndCheck(t, inst) })
		if out := mustOK(t, inst, 0, "cat /etc/os-release"); !strings.Contains(out, want) {
			t.Errorf("template %s: os-release lacks %q:\n%s", tmpl, want, out)
		}
	}
}

// writeLayer makes a layer directory (layer form: root-owned, under a
// 0700 parent) with files (path -> content; "" content with a trailing
// "!" in the path makes a whiteout, a trailing "/" an opaque directory).
func writeLayer(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "layer")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for p, content := range files {
		switch {
		case strings.HasSuffix(p, "!"):
			p = filepath.Join(dir, strings.TrimSuffix(p, "!"))
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := unix.Mknod(p, unix.S_IFCHR|0o600, 0); err != nil {
				t.Fatal(err)
			}
		case strings.HasSuffix(p, "/"):
			p = filepath.Join(dir, p)
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			for _, x := range []string{"trusted.overlay.opaque", "user.overlay.opaque"} {
				if err := unix.Setxattr(p, x, []byte("y"), 0); err != nil {
					t.Fatal(err)
				}
			}
		default:
			p = filepath.Join(dir, p)
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	return dir
}

// TestImageLayerStack: a stack of the base and two layers reads as
// overlay's union, top first: a file of the top layer shadows the one
// below, a whiteout hides a file of any layer below, an opaque directory
// hides the contents below it; with and without user namespaces.
func TestImageLayerStack(t *testing.T) {
	base := needBaseImage(t)
	mid := writeLayer(t, map[string]string{
		"opt/app/x": "mid\n", "opt/app/gone": "g\n", "opt/app/keep": "k\n", "opt/data/old": "o\n",
	})
	top := writeLayer(t, map[string]string{
		"opt/app/x": "top\n", "opt/app/gone!": "", "etc/motd!": "", "opt/data/": "", "opt/data/new": "n\n",
	})
	img := &substrate.Image{ID: "sha256:test", Layers: []string{base.Layers[0], mid, top}, Env: []string{"FROM_IMAGE=1"}}
	for _, noUserNS := range []bool{false, true} {
		t.Run(map[bool]string{false: "userns", true: "nouserns"}[noUserNS], func(t *testing.T) {
			s, err := New(Config{StateDir: testState, NoUserNamespaces: noUserNS, NoWarmInit: true})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			if !noUserNS && !s.userns {
				testenv.Skipf(t, "user namespaces unavailable here: %s", userNamespacesUnsupported())
			}
			inst, _ := startImage(t, s, img)
			out := mustOK(t, inst, 1000, "cat /opt/app/x /opt/app/keep; ls /opt/data; test -e /opt/app/gone || echo gone; test -e /etc/motd || echo nomotd; test -e /etc/debian_version && echo base")
			if want := "top\nk\nnew\ngone\nnomotd\nbase\n"; out != want {
				t.Errorf("union: %q, want %q", out, want)
			}
			// The sandbox writes into its own layer only.
			mustOK(t, inst, 0, "echo w > /opt/app/x && rm /opt/app/keep")
			if b, err := os.ReadFile(filepath.Join(top, "opt/app/x")); err != nil || string(b) != "top\n" {
				t.Errorf("a lower layer changed: %q %v", b, err)
			}
			if _, err := os.Stat(filepath.Join(mid, "opt/app/keep")); err != nil {
				t.Errorf("a lower layer lost a file: %v", err)
			}
		})
	}
}

// TestImageRejected: a broken image is refused before anything starts.
func TestImageRejected(t *testing.T) {
	s := needRoot(t)
	file := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	// A layer under a directory others may write (they could swap it).
	open := filepath.Join(t.TempDir(), "open")
	if err := os.MkdirAll(filepath.Join(open, "layer"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	foreign := filepath.Join(t.TempDir(), "foreign")
	if err := os.MkdirAll(filepath.Join(foreign, "layer"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(foreign, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	for name, img := range map[string]*substrate.Image{
		"no layers":   {},
		"relative":    {Layers: []string{"layer"}},
		"missing":     {Layers: []string{"/nonexistent/layer"}},
		"a file":      {Layers: []string{file}},
		"open parent": {Layers: []string{filepath.Join(open, "layer")}},
		"user parent": {Layers: []string{filepath.Join(foreign, "layer")}},
		"colon":       {Layers: []string{"/tmp/a:b"}},
		"unclean":     {Layers: []string{"/tmp/../etc"}},
		"env":         {Layers: []string{"/"}, Env: []string{"NOEQUALS"}},
		"working dir": {Layers: []string{"/"}, WorkingDir: "rel"},
	} {
		spec := newSpec(t, substrate.Limits{})
		spec.Image = img
		if _, err := s.Start(context.Background(), spec); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
}

// TestImageManyLayers: a stack whose host paths together are longer than
// overlay's options can carry (a page) still mounts, top first, with and
// without user namespaces.
func TestImageManyLayers(t *testing.T) {
	base := needBaseImage(t)
	img := &substrate.Image{ID: "sha256:many", Layers: []string{base.Layers[0]}}
	parent := t.TempDir()
	for i := range 60 {
		dir := filepath.Join(parent, fmt.Sprintf("a-layer-with-a-long-name-as-content-stores-give-them-%03d", i))
		if err := os.MkdirAll(filepath.Join(dir, "opt"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "opt/n"), []byte(fmt.Sprintf("%d\n", i)), 0o644); err != nil {
			t.Fatal(err)
		}
		img.Layers = append(img.Layers, dir)
	}
	if n := len(strings.Join(img.Layers, ":")); n < 4096 {
		t.Fatalf("the stack's paths are only %d bytes", n)
	}
	for _, noUserNS := range []bool{false, true} {
		t.Run(map[bool]string{false: "userns", true: "nouserns"}[noUserNS], func(t *testing.T) {
			s, err := New(Config{StateDir: testState, NoUserNamespaces: noUserNS, NoWarmInit: true})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			if !noUserNS && !s.userns {
				testenv.Skipf(t, "user namespaces unavailable here: %s", userNamespacesUnsupported())
			}
			inst, _ := startImage(t, s, img)
			if out := mustOK(t, inst, 1000, "cat /opt/n && test -e /etc/debian_version && echo base"); out != "59\nbase\n" {
				t.Errorf("top of a 61-layer stack: %q", out)
			}
		})
	}
}
