package baseimage

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/testenv"
)

func TestConfigValidate(t *testing.T) {
	if err := (Config{}).Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for name, c := range map[string]Config{
		"relative cache":   {CacheDir: "images"},
		"suite slash":      {Suite: "bookworm/../x"},
		"suite option":     {Suite: "-x"},
		"suite upper":      {Suite: "Bookworm"},
		"mirror scheme":    {Mirror: "ftp://deb.debian.org/debian"},
		"mirror space":     {Mirror: "http://deb.debian.org/debian main contrib"},
		"mirror quote":     {Mirror: `http://x/"`},
		"package option":   {Packages: []string{"--hook=x"}},
		"package comma":    {Packages: []string{"bash,evil"}},
		"package space":    {Packages: []string{"bash evil"}},
		"package upper":    {Packages: []string{"Bash"}},
		"package short":    {Packages: []string{"a"}},
		"package leading+": {Packages: []string{"+x"}},
		"relative builder": {Mmdebstrap: "mmdebstrap"},
	} {
		err := c.Validate()
		if !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
		if _, err := c.ID(); err == nil {
			t.Errorf("%s: ID computed", name)
		}
	}
}

func TestID(t *testing.T) {
	id := func(c Config) string {
		t.Helper()
		c.OSRelease = "/nonexistent" // DefaultSuite, whatever the host is
		s, err := c.ID()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	a := id(Config{Packages: []string{"git", "bash", "git"}})
	if b := id(Config{Packages: []string{"bash", "git"}}); a != b {
		t.Errorf("order or duplicates changed the ID: %s %s", a, b)
	}
	if !strings.HasPrefix(a, "sha256:") || len(a) != 7+64 {
		t.Errorf("ID %q", a)
	}
	for name, c := range map[string]Config{
		"packages": {Packages: []string{"bash"}},
		"suite":    {Packages: []string{"bash", "git"}, Suite: "trixie"},
		"mirror":   {Packages: []string{"bash", "git"}, Mirror: "http://mirror.example/debian"},
	} {
		if id(c) == a {
			t.Errorf("a different %s kept the ID", name)
		}
	}
	// The cache directory is where, not what.
	if id(Config{Packages: []string{"bash", "git"}, CacheDir: "/elsewhere"}) != a {
		t.Error("the cache directory changed the ID")
	}
	if id(Config{}) != id(Config{Packages: DefaultPackages}) {
		t.Error("defaults differ from DefaultPackages")
	}
}

func TestHostSuite(t *testing.T) {
	dir := t.TempDir()
	for name, tc := range map[string]struct{ content, want string }{
		"debian":   {"PRETTY_NAME=\"Debian GNU/Linux 13 (trixie)\"\nID=debian\nVERSION_CODENAME=trixie\n", "trixie"},
		"quoted":   {"ID=\"debian\"\nVERSION_CODENAME='bookworm'\n", "bookworm"},
		"ubuntu":   {"ID=ubuntu\nVERSION_CODENAME=noble\n", DefaultSuite},
		"hostile":  {"ID=debian\nVERSION_CODENAME=--hook=x\n", DefaultSuite},
		"no code":  {"ID=debian\n", DefaultSuite},
		"garbage":  {"\x00\xff==\n", DefaultSuite},
		"sid-like": {"ID=debian\nVERSION_CODENAME=sid\n", "sid"},
	} {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(tc.content), 0o644); err != nil {
			t.Fatal(err)
		}
		if got := hostSuite(p); got != tc.want {
			t.Errorf("%s: %q, want %q", name, got, tc.want)
		}
	}
	if got := hostSuite(filepath.Join(dir, "missing")); got != DefaultSuite {
		t.Errorf("missing file: %q", got)
	}
}

func FuzzHostSuite(f *testing.F) {
	f.Add("ID=debian\nVERSION_CODENAME=bookworm\n")
	f.Add("ID=\"debian\"\nVERSION_CODENAME=\"\"\n")
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, content string) {
		p := filepath.Join(dir, "os-release")
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if s := hostSuite(p); !validSuite(s) {
			t.Fatalf("invalid suite %q from %q", s, content)
		}
	})
}

func TestSources(t *testing.T) {
	got := sources("http://deb.debian.org/debian/", "bookworm")
	want := []string{
		"deb http://deb.debian.org/debian bookworm main",
		"deb http://deb.debian.org/debian bookworm-updates main",
		"deb http://deb.debian.org/debian-security bookworm-security main",
	}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("sources %q", got)
	}
	if got := sources("http://mirror.example/pub", "trixie"); len(got) != 2 {
		t.Errorf("a mirror not ending in /debian got a security archive: %q", got)
	}
}

func TestLookupMissing(t *testing.T) {
	_, err := Lookup(Config{CacheDir: t.TempDir()})
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("empty cache: %v", err)
	}
}

// TestFailedBuildLeavesNothing: a build that fails publishes nothing and
// removes its temporary tree; the next Ensure tries again.
func TestFailedBuildLeavesNothing(t *testing.T) {
	testenv.RequireRoot(t, "a build runs as root")
	dir := t.TempDir()
	fake := filepath.Join(dir, "mmdebstrap")
	// Leaves a partial tree behind, then fails, as an interrupted
	// download would.
	script := "#!/bin/sh\nfor a; do case \"$a\" in */rootfs) t=$a;; esac; done\nmkdir -p \"$t/usr/bin\" && echo partial > \"$t/usr/bin/x\"\necho 'E: cannot reach the mirror' >&2\nexit 1\n"
	if err := os.WriteFile(fake, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	cache := filepath.Join(dir, "cache")
	cfg := Config{CacheDir: cache, Mmdebstrap: fake, Packages: []string{"bash"}}
	for range 2 {
		_, err := Ensure(context.Background(), cfg, nil)
		if err == nil || !strings.Contains(err.Error(), "cannot reach the mirror") {
			t.Fatalf("Ensure: %v, want the builder's error", err)
		}
		ents, err := os.ReadDir(cache)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			if !strings.HasSuffix(e.Name(), ".lock") {
				t.Errorf("left in the cache: %s", e.Name())
			}
		}
	}
	fi, err := os.Stat(cache)
	if err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("cache dir mode: %v %v", fi.Mode(), err)
	}
	if _, err := Lookup(cfg); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Lookup after failed builds: %v", err)
	}
}

// TestEnsureContextWhileLocked: an Ensure waiting for another process's
// build gives up with its context.
func TestEnsureContextWhileLocked(t *testing.T) {
	cache := t.TempDir()
	cfg := Config{CacheDir: cache, Packages: []string{"bash"}}
	id, err := cfg.ID()
	if err != nil {
		t.Fatal(err)
	}
	unlock, err := lockFile(context.Background(), filepath.Join(cache, "."+dirName(id)+".lock"))
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Ensure(ctx, cfg, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("Ensure under another's lock: %v", err)
	}
}

// TestBuiltImage checks the image make base-image built (skips when it
// is not built: building is make's job, and the ns tests build it).
func TestBuiltImage(t *testing.T) {
	b, err := Lookup(Config{})
	if errors.Is(err, errdefs.ErrNotFound) {
		testenv.Skipf(t, "the Debian base image is not built (make base-image): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	again, err := Ensure(context.Background(), Config{}, nil)
	if err != nil || again.ID != b.ID || again.Dir != b.Dir {
		t.Fatalf("Ensure of a built image: %+v %v", again, err)
	}
	fi, err := os.Stat(filepath.Dir(b.Dir))
	if err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("image dir mode %v %v, want 0700", fi.Mode(), err)
	}
	m, err := b.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"python3", "python-is-python3", "python3-pip", "python3-venv", "nodejs", "npm", "git", "curl", "sudo", "build-essential", "procps", "iproute2"} {
		if !bytes.Contains(m, []byte("\n"+p+"\t")) && !bytes.HasPrefix(m, []byte(p+"\t")) {
			t.Errorf("manifest lacks %s", p)
		}
	}
	passwd, err := os.ReadFile(filepath.Join(b.Dir, "etc/passwd"))
	if err != nil || !strings.Contains(string(passwd), "\nuser:x:1000:1000::/home/user:/bin/bash\n") {
		t.Errorf("no user 1000 in /etc/passwd: %v", err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(b.Dir, "usr/bin/sudo"), &st); err != nil || st.Mode&syscall.S_ISUID == 0 || st.Uid != 0 {
		t.Errorf("sudo is not set-uid root: %+v %v", st, err)
	}
	if err := syscall.Stat(filepath.Join(b.Dir, "etc/sudoers.d/user"), &st); err != nil || st.Mode&0o777 != 0o440 {
		t.Errorf("sudoers.d/user: mode %o %v", st.Mode&0o777, err)
	}
	if err := syscall.Stat(filepath.Join(b.Dir, "home/user"), &st); err != nil || st.Uid != UserID || st.Gid != UserID {
		t.Errorf("/home/user: %d:%d %v", st.Uid, st.Gid, err)
	}
	if m, _ := filepath.Glob(filepath.Join(b.Dir, "usr/lib/python3*/EXTERNALLY-MANAGED")); len(m) != 0 {
		t.Errorf("pip refuses installs: %v", m)
	}
	if ents, err := os.ReadDir(filepath.Join(b.Dir, "dev")); err != nil || len(ents) != 0 {
		t.Errorf("/dev of the layer is not empty: %d entries, %v", len(ents), err)
	}
}

// fakeBuilder is an mmdebstrap stand-in that makes a tiny tree (a static
// busybox, an useradd of its own, device nodes as mmdebstrap's root mode
// makes) after a second, counting its runs in counter.
const fakeBuilder = `#!/bin/sh
set -e
for a; do case "$a" in */rootfs) t=$a;; esac; done
echo run >> %q
sleep 1
mkdir -p "$t/usr/bin" "$t/usr/sbin" "$t/etc" "$t/dev" "$t/var/lib/dpkg" "$t/home"
ln -s usr/bin "$t/bin"
cp %q "$t/usr/bin/busybox"
ln -s busybox "$t/usr/bin/sh"
printf 'root:x:0:0:root:/root:/bin/sh\n' > "$t/etc/passwd"
printf 'root:x:0:\n' > "$t/etc/group"
printf '#!/bin/sh\necho user:x:1000:1000::/home/user:/bin/bash >> /etc/passwd\n/bin/busybox mkdir -p /home/user\n/bin/busybox chown 1000:1000 /home/user\n' > "$t/usr/sbin/useradd"
chmod 755 "$t/usr/sbin/useradd"
touch "$t/var/lib/dpkg/status"
mknod "$t/dev/null" c 1 3
`

// TestConcurrentEnsureBuildsOnce: Ensures racing for one image (here
// goroutines; processes take the same flock) run the builder once, and
// every one gets the complete, customized tree.
func TestConcurrentEnsureBuildsOnce(t *testing.T) {
	testenv.RequireRoot(t, "a build runs as root")
	busybox := "/bin/busybox"
	if _, err := os.Stat(busybox); err != nil {
		testenv.Skipf(t, "no static busybox for the stand-in builder (make vm-deps installs busybox-static): %v", err)
	}
	dir := t.TempDir()
	counter := filepath.Join(dir, "runs")
	fake := filepath.Join(dir, "mmdebstrap")
	if err := os.WriteFile(fake, []byte(fmt.Sprintf(fakeBuilder, counter, busybox)), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := Config{CacheDir: filepath.Join(dir, "cache"), Mmdebstrap: fake, Packages: []string{"bash"}}
	var wg sync.WaitGroup
	got := make([]Base, 3)
	errs := make([]error, 3)
	for i := range got {
		wg.Go(func() { got[i], errs[i] = Ensure(context.Background(), cfg, nil) })
	}
	wg.Wait()
	for i := range got {
		if errs[i] != nil {
			t.Fatalf("Ensure %d: %v", i, errs[i])
		}
		if got[i].Dir != got[0].Dir || got[i].ID != got[0].ID {
			t.Fatalf("Ensures disagree: %+v %+v", got[i], got[0])
		}
	}
	if _, err := Ensure(context.Background(), cfg, nil); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(counter); err != nil || string(b) != "run\n" {
		t.Fatalf("the builder ran %q times (%v), want once", b, err)
	}
	b := got[0]
	if passwd, err := os.ReadFile(filepath.Join(b.Dir, "etc/passwd")); err != nil || !strings.Contains(string(passwd), "user:x:1000:") {
		t.Errorf("no user account: %q %v", passwd, err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(b.Dir, "etc/sudoers.d/user"), &st); err != nil || st.Mode&0o777 != 0o440 {
		t.Errorf("sudoers.d/user: mode %o %v", st.Mode&0o777, err)
	}
	if ents, err := os.ReadDir(filepath.Join(b.Dir, "dev")); err != nil || len(ents) != 0 {
		t.Errorf("device nodes kept in the layer: %d %v", len(ents), err)
	}
	for _, f := range []string{".space/spaced-guest", "etc/hosts", "etc/resolv.conf"} {
		if _, err := os.Stat(filepath.Join(b.Dir, f)); err != nil {
			t.Errorf("customization: %v", err)
		}
	}
	if fi, err := os.Stat(filepath.Dir(b.Dir)); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("image dir mode: %v", err)
	}
	ents, _ := os.ReadDir(cfg.CacheDir)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".build-") {
			t.Errorf("a build directory left: %s", e.Name())
		}
	}
}
