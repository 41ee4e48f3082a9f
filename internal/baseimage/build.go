package baseimage

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// info is CacheDir/<id>/image.json: what went into the image.
type info struct {
	ID           string    `json:"id"`
	Builder      string    `json:"builder"`
	Suite        string    `json:"suite"`
	Sources      []string  `json:"sources"`
	Packages     []string  `json:"packages"`
	Built        time.Time `json:"built"`
	BuildSeconds float64   `json:"build_seconds"`
	Bytes        int64     `json:"bytes"`
}

// Files the customization writes into the tree (the rest comes from the
// packages). sudo as E2B's images have it: user may run anything as root
// without a password; in a sandbox with a user namespace that root is the
// sandbox's own.
var customFiles = []struct {
	path    string
	mode    os.FileMode
	content string
}{
	{"etc/sudoers.d/user", 0o440, UserName + " ALL=(ALL:ALL) NOPASSWD: ALL\n"},
	{"etc/hostname", 0o644, "sandbox\n"},
	{"etc/hosts", 0o644, "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"},
	// The agent writes the resolver when the sandbox has a network.
	{"etc/resolv.conf", 0o644, "# no network\n"},
	// The mount point of the agent binary (a file: binding it copies
	// nothing up into the sandbox's writable layer).
	{".space/spaced-guest", 0o755, ""},
}

// build makes the image id in a temporary directory of the cache and
// renames it into place; it returns the tree's size in bytes.
func build(ctx context.Context, cfg Config, id string, log *slog.Logger) (size int64, err error) {
	t0 := time.Now()
	tmp, err := newBuildDir(cfg.CacheDir, id)
	if err != nil {
		return 0, err
	}
	defer dropFailed(&err, tmp, log)
	root := filepath.Join(tmp, rootfsName)
	if err := os.Mkdir(root, 0o755); err != nil {
		return 0, fmt.Errorf("baseimage: %w", err)
	}
	if err := mmdebstrap(ctx, cfg, root, log); err != nil {
		return 0, err
	}
	if err := customize(ctx, root); err != nil {
		return 0, fmt.Errorf("baseimage: customize: %w", err)
	}
	manifest, err := exec.CommandContext(ctx, "dpkg-query", "--admindir="+filepath.Join(root, "var/lib/dpkg"),
		"-W", "-f=${Package}\t${Version}\t${Architecture}\n").Output()
	if err != nil {
		return 0, fmt.Errorf("baseimage: manifest: %w", err)
	}
	if err := os.WriteFile(filepath.Join(tmp, manifestName), manifest, 0o644); err != nil {
		return 0, fmt.Errorf("baseimage: %w", err)
	}
	if size, err = treeBytes(root); err != nil {
		return 0, fmt.Errorf("baseimage: size: %w", err)
	}
	inf := info{ID: id, Builder: BuilderVersion, Suite: cfg.Suite, Sources: sources(cfg.Mirror, cfg.Suite), Packages: cfg.Packages,
		Built: time.Now().UTC(), BuildSeconds: time.Since(t0).Seconds(), Bytes: size}
	if err := publish(cfg.CacheDir, tmp, id, inf); err != nil {
		return 0, err
	}
	return size, nil
}

// newBuildDir makes a private (0700) directory in the cache to build
// image id in; it is renamed into place by publish, so a crash never
// leaves a half image under the final name.
func newBuildDir(cacheDir, id string) (string, error) {
	tmp, err := os.MkdirTemp(cacheDir, ".build-"+dirName(id)+"-")
	if err != nil {
		return "", fmt.Errorf("baseimage: %w", err)
	}
	if err := os.Chmod(tmp, 0o700); err != nil {
		_ = removeTree(tmp)
		return "", fmt.Errorf("baseimage: %w", err)
	}
	return tmp, nil
}

// dropFailed removes the build directory tmp when the build failed (*err
// is set); deferred by the builds.
func dropFailed(err *error, tmp string, log *slog.Logger) {
	if *err == nil {
		return
	}
	if rerr := removeTree(tmp); rerr != nil {
		log.Warn("baseimage: removing a failed build", "dir", tmp, "err", rerr)
	}
}

// publish writes the image's info next to its tree, renames the build
// directory tmp to image id's place and syncs the cache directory.
func publish(cacheDir, tmp, id string, inf any) error {
	b, _ := json.MarshalIndent(inf, "", "  ")
	if err := writeSynced(filepath.Join(tmp, infoName), b); err != nil {
		return fmt.Errorf("baseimage: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(cacheDir, dirName(id))); err != nil {
		return fmt.Errorf("baseimage: publish: %w", err)
	}
	if d, err := os.Open(cacheDir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}

// mmdebstrap runs the builder into root. Root mode because this runs as
// root anyway and it writes the image's own owners (sudo set-uid root,
// files of uid 0) as they are, which is the layer form; unshare mode would
// need subordinate id ranges and leave the tree owned by mapped host ids.
// It runs in a mount namespace of its own: the /proc and /dev it mounts
// inside the tree go away with it, even when it is killed, so removing a
// failed tree never reaches the host's.
func mmdebstrap(ctx context.Context, cfg Config, root string, log *slog.Logger) error {
	bin, err := mmdebstrapPath(cfg)
	if err != nil {
		return fmt.Errorf("baseimage: %w: mmdebstrap: %w", errdefs.ErrUnavailable, err)
	}
	args := []string{
		"--mode=root", "--variant=apt", "--format=directory",
		"--include=" + strings.Join(cfg.Packages, ","),
		`--aptopt=APT::Install-Recommends "false"`,
		// Documentation is most of a tree's files and nobody reads it in
		// a sandbox; copyright notices stay.
		"--dpkgopt=path-exclude=/usr/share/man/*",
		"--dpkgopt=path-exclude=/usr/share/info/*",
		"--dpkgopt=path-exclude=/usr/share/doc/*",
		"--dpkgopt=path-include=/usr/share/doc/*/copyright",
		cfg.Suite, root,
	}
	args = append(args, sources(cfg.Mirror, cfg.Suite)...)
	// mmdebstrap cleans up on SIGTERM; its children go with the group.
	if err := runLogged(ctx, log, "mmdebstrap", exec.CommandContext(ctx, bin, args...), "DEBIAN_FRONTEND=noninteractive"); err != nil {
		return fmt.Errorf("baseimage: mmdebstrap %s from %s: %w", cfg.Suite, cfg.Mirror, err)
	}
	return nil
}

// customize adds E2B's account and the files above to the tree.
func customize(ctx context.Context, root string) error {
	out, err := exec.CommandContext(ctx, "chroot", root, "useradd", "--create-home", "--uid", fmt.Sprint(UserID),
		"--user-group", "--shell", "/bin/bash", UserName).CombinedOutput()
	if err != nil {
		return fmt.Errorf("useradd: %w: %s", err, strings.TrimSpace(string(out)))
	}
	for _, f := range customFiles {
		p := filepath.Join(root, f.path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		// Replace, never write through: the tree's own file may be a
		// symlink (resolv.conf often is).
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		if err := os.WriteFile(p, []byte(f.content), f.mode); err != nil {
			return err
		}
		if err := os.Chmod(p, f.mode); err != nil { // umask-proof
			return err
		}
	}
	// The substrates give every sandbox its own /dev: the nodes
	// mmdebstrap made have no place in a layer (whose only character
	// devices are whiteouts).
	ents, err := os.ReadDir(filepath.Join(root, "dev"))
	if err != nil {
		return err
	}
	for _, e := range ents {
		if err := os.RemoveAll(filepath.Join(root, "dev", e.Name())); err != nil {
			return err
		}
	}
	// pip installs as in E2B's images (and Docker's python ones): without
	// PEP 668's marker, `pip install` as user goes to ~/.local instead of
	// refusing.
	markers, _ := filepath.Glob(filepath.Join(root, "usr/lib/python3*/EXTERNALLY-MANAGED"))
	for _, p := range markers {
		if err := os.Remove(p); err != nil {
			return err
		}
	}
	// What apt and ldconfig leave behind is rebuilt on demand.
	for _, g := range []string{"var/cache/apt/*.bin", "var/cache/apt/archives/*.deb", "var/cache/ldconfig/aux-cache", "var/log/apt/*"} {
		m, _ := filepath.Glob(filepath.Join(root, g))
		for _, p := range m {
			_ = os.Remove(p)
		}
	}
	return nil
}

// treeBytes is the disk usage of the tree at root (hard links once).
func treeBytes(root string) (int64, error) {
	seen := map[[2]uint64]bool{}
	var n int64
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		key := [2]uint64{st.Dev, st.Ino}
		if st.Nlink > 1 && !d.IsDir() {
			if seen[key] {
				return nil
			}
			seen[key] = true
		}
		n += st.Blocks * 512
		return nil
	})
	return n, err
}

func writeSynced(path string, b []byte) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// removeTree removes a failed build after detaching anything still
// mounted below it (deepest first), so the removal never descends into
// another file system (a host /dev bound into the tree).
func removeTree(dir string) error {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	var under []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := unescapeMount(f[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			under = append(under, mp)
		}
	}
	sort.Slice(under, func(i, j int) bool { return len(under[i]) > len(under[j]) })
	for _, mp := range under {
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("unmount %s: %w", mp, err)
		}
	}
	return os.RemoveAll(dir)
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v byte
			ok := true
			for _, c := range s[i+1 : i+4] {
				if c < '0' || c > '7' {
					ok = false
					break
				}
				v = v*8 + byte(c-'0')
			}
			if ok {
				b.WriteByte(v)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// lineTail keeps the last max lines written to it.
type lineTail struct {
	mu    sync.Mutex
	max   int
	lines []string
}

func (t *lineTail) add(s string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.lines = append(t.lines, s)
	if len(t.lines) > t.max {
		t.lines = t.lines[len(t.lines)-t.max:]
	}
}

func (t *lineTail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.Join(t.lines, "\n")
}

// runLogged runs cmd in a mount namespace and process group of its own
// (SIGTERM to the group on cancel: the builders clean up on it), with a
// plain environment plus env, its output logged at debug level and its
// last lines in the error.
func runLogged(ctx context.Context, log *slog.Logger, name string, cmd *exec.Cmd, env ...string) error {
	cmd.Env = append([]string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C.UTF-8"}, env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS, Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) }
	cmd.WaitDelay = 30 * time.Second
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	tail := &lineTail{max: 40}
	var wg sync.WaitGroup
	wg.Go(func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			tail.add(sc.Text())
			log.Debug(name, "line", sc.Text())
		}
		_, _ = io.Copy(io.Discard, pr)
	})
	err := cmd.Run()
	pw.Close()
	wg.Wait()
	if err != nil {
		return fmt.Errorf("%w\n%s", err, tail.String())
	}
	return nil
}
