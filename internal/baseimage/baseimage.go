// Package baseimage builds the Debian root file system of the `base`
// template: an mmdebstrap of the host's Debian suite from a Debian mirror
// with what E2B's base image users rely on (bash, python3 with pip and
// venv, nodejs and npm, git, curl, sudo, build tools, ...) and E2B's `user`
// account (uid/gid 1000, passwordless sudo).
//
// The tree is one layer in the form of the layers contract
// (/work/contracts/i15/layers.md, substrate.Image): files carry the
// image's own owners and modes (sudo is set-uid root), so it is built as
// root and kept under root-only (0700) directories.
//
// An image is named by its content ID, a hash of every input of the build
// (the builder's version, suite, mirror, package list). It is built once
// per ID into CacheDir/<id>/ (machine-wide, shared by every worker and
// tool on the host) under an flock, in a temporary directory renamed into
// place when complete, so a crash never leaves a half image under the
// final name. The versions the mirror served are not part of the ID
// (computing it would need the network at every worker start); they are
// recorded next to the tree (manifest.txt, `dpkg -l`-style), and a new
// BuilderVersion or package list builds a fresh image.
package baseimage

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// BuilderVersion is part of every image's content ID: bump it whenever
// the build (its mmdebstrap options or the customization after it)
// changes, so caches built the old way are not reused.
const BuilderVersion = "space-debian-base-v3"

// Defaults of Config.
const (
	DefaultCacheDir = "/var/cache/space/images"
	DefaultMirror   = "http://deb.debian.org/debian"
	// DefaultSuite is used when the host is not Debian (its os-release
	// names no Debian codename).
	DefaultSuite     = "bookworm"
	defaultOSRelease = "/etc/os-release"
)

// DefaultPackages is what E2B's base image users rely on, beyond
// Debian's essential set and apt.
var DefaultPackages = []string{
	"bash", "coreutils", "python3", "python3-pip", "python3-venv", "python-is-python3", "nodejs", "npm",
	"git", "curl", "wget", "ca-certificates", "sudo", "build-essential", "procps",
	"iproute2", "less", "vim-tiny", "nano", "unzip", "openssh-client", "passwd",
	"xz-utils", "gnupg", "tzdata",
}

// The entries of an image directory CacheDir/<id>/.
const (
	rootfsName   = "rootfs"
	manifestName = "manifest.txt"
	infoName     = "image.json"
)

// The E2B account every base image has.
const (
	UserName = "user"
	UserID   = 1000
)

// Config says which image to build and where to keep it.
type Config struct {
	// CacheDir holds one directory per image (0700, created). Default
	// DefaultCacheDir. Absolute.
	CacheDir string
	// Mirror is the Debian archive (default DefaultMirror); the suite's
	// -updates and, for a mirror ending in /debian, the same host's
	// debian-security archive are used as well.
	Mirror string
	// Suite is the Debian release (default: the host's VERSION_CODENAME
	// when the host is Debian, else DefaultSuite).
	Suite string
	// Packages are installed on top of Debian's essential set and apt
	// (default DefaultPackages). Order and duplicates do not matter.
	Packages []string
	// Mmdebstrap is the builder's executable (default: mmdebstrap in PATH).
	Mmdebstrap string
	// OSRelease is the file the default suite is read from (default
	// /etc/os-release); tests point it elsewhere.
	OSRelease string
}

// withDefaults fills c's zero fields.
func (c Config) withDefaults() Config {
	if c.CacheDir == "" {
		c.CacheDir = DefaultCacheDir
	}
	if c.Mirror == "" {
		c.Mirror = DefaultMirror
	}
	if c.OSRelease == "" {
		c.OSRelease = defaultOSRelease
	}
	if c.Suite == "" {
		c.Suite = hostSuite(c.OSRelease)
	}
	if len(c.Packages) == 0 {
		c.Packages = DefaultPackages
	}
	c.Packages = slices.Clone(c.Packages)
	slices.Sort(c.Packages)
	c.Packages = slices.Compact(c.Packages)
	return c
}

// Validate reports whether c (its zero fields taking their defaults) is
// usable. Package names, the suite and the mirror reach mmdebstrap's
// command line: they are checked against Debian's own syntax, so none can
// pass as an option.
func (c Config) Validate() error {
	c = c.withDefaults()
	if !filepath.IsAbs(c.CacheDir) {
		return fmt.Errorf("baseimage: %w: CacheDir must be absolute, got %q", errdefs.ErrInvalid, c.CacheDir)
	}
	if !validSuite(c.Suite) {
		return fmt.Errorf("baseimage: %w: suite %q", errdefs.ErrInvalid, c.Suite)
	}
	if !validMirror(c.Mirror) {
		return fmt.Errorf("baseimage: %w: mirror %q must be an http(s) URL without spaces", errdefs.ErrInvalid, c.Mirror)
	}
	for _, p := range c.Packages {
		if !validPackage(p) {
			return fmt.Errorf("baseimage: %w: package name %q", errdefs.ErrInvalid, p)
		}
	}
	if c.Mmdebstrap != "" && !filepath.IsAbs(c.Mmdebstrap) {
		return fmt.Errorf("baseimage: %w: Mmdebstrap must be absolute, got %q", errdefs.ErrInvalid, c.Mmdebstrap)
	}
	return nil
}

// Base is a built image.
type Base struct {
	// ID is the content ID, "sha256:<hex>".
	ID string
	// Dir is the root file system (one layer); its parent is 0700.
	Dir string
	// Env is the image's process environment defaults (KEY=VALUE).
	Env []string
}

// imageEnv is every base image's Env.
var imageEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"LANG=C.UTF-8",
}

// ID returns the content ID of the image cfg describes: a hash of every
// input of its build.
func (c Config) ID() (string, error) {
	if err := c.Validate(); err != nil {
		return "", err
	}
	c = c.withDefaults()
	b, _ := json.Marshal(struct {
		Builder, Suite string
		Sources        []string
		Packages       []string
	}{BuilderVersion, c.Suite, sources(c.Mirror, c.Suite), c.Packages})
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:]), nil
}

// dirName is the directory of image id under the cache ("sha256-<hex>").
func dirName(id string) string { return strings.ReplaceAll(id, ":", "-") }

// Lookup returns the image cfg describes if it was built, without
// building it: errdefs.ErrNotFound otherwise.
func Lookup(cfg Config) (Base, error) {
	id, err := cfg.ID()
	if err != nil {
		return Base{}, err
	}
	cfg = cfg.withDefaults()
	return lookup(cfg, id)
}

func lookup(cfg Config, id string) (Base, error) {
	dir := filepath.Join(cfg.CacheDir, dirName(id))
	// The info file is written last, before the rename: its presence
	// under the final name means the image is complete.
	if _, err := os.Stat(filepath.Join(dir, infoName)); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return Base{}, fmt.Errorf("baseimage: image %s: %w (build it with make base-image)", id, errdefs.ErrNotFound)
		}
		return Base{}, fmt.Errorf("baseimage: %w", err)
	}
	return Base{ID: id, Dir: filepath.Join(dir, rootfsName), Env: slices.Clone(imageEnv)}, nil
}

// Ensure returns the image cfg describes, building it first if it is not
// in the cache (minutes: mmdebstrap downloads and installs every
// package). Concurrent Ensures of one image, in this process or others,
// build it once. A build needs root and mmdebstrap; without either it
// fails with errdefs.ErrUnavailable.
func Ensure(ctx context.Context, cfg Config, log *slog.Logger) (Base, error) {
	if log == nil {
		log = slog.Default()
	}
	id, err := cfg.ID()
	if err != nil {
		return Base{}, err
	}
	cfg = cfg.withDefaults()
	if b, err := lookup(cfg, id); err == nil {
		return b, nil
	}
	if err := ensureCacheDir(cfg.CacheDir); err != nil {
		return Base{}, err
	}
	unlock, err := lockFile(ctx, filepath.Join(cfg.CacheDir, "."+dirName(id)+".lock"))
	if err != nil {
		return Base{}, err
	}
	defer unlock()
	if b, err := lookup(cfg, id); err == nil { // built while we waited
		return b, nil
	}
	if why := Unbuildable(cfg); why != "" {
		return Base{}, fmt.Errorf("baseimage: cannot build %s: %w: %s", id, errdefs.ErrUnavailable, why)
	}
	t0 := time.Now()
	log.Info("baseimage: building the Debian base image (once per content ID; minutes)", "id", id, "suite", cfg.Suite, "mirror", cfg.Mirror)
	size, err := build(ctx, cfg, id, log)
	if err != nil {
		return Base{}, err
	}
	log.Info("baseimage: built", "id", id, "took", time.Since(t0).Round(time.Second), "bytes", size)
	return lookup(cfg, id)
}

// Unbuildable says why this host cannot build an image ("" when it can).
func Unbuildable(cfg Config) string {
	if os.Geteuid() != 0 {
		return "building the image needs root (mmdebstrap --mode=root)"
	}
	if _, err := mmdebstrapPath(cfg); err != nil {
		return "mmdebstrap is not installed (make base-image installs it)"
	}
	return ""
}

func mmdebstrapPath(cfg Config) (string, error) {
	if cfg.Mmdebstrap != "" {
		return cfg.Mmdebstrap, nil
	}
	return exec.LookPath("mmdebstrap")
}

// ensureCacheDir makes the cache directory root-only: images hold
// set-uid files owned by their own ids.
func ensureCacheDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("baseimage: cache: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("baseimage: cache: %w", err)
	}
	return nil
}

// lockFile takes an exclusive flock on path, waiting until ctx ends.
func lockFile(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("baseimage: lock: %w", err)
	}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { _ = f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("baseimage: lock: %w", err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("baseimage: waiting for another build: %w", ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// hostSuite reads the Debian codename from an os-release file.
func hostSuite(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return DefaultSuite
	}
	defer f.Close()
	vals := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(strings.TrimSpace(sc.Text()), "=")
		if ok {
			vals[k] = strings.Trim(v, `"'`)
		}
	}
	if vals["ID"] == "debian" && validSuite(vals["VERSION_CODENAME"]) {
		return vals["VERSION_CODENAME"]
	}
	return DefaultSuite
}

// sources are the apt source lines of a build.
func sources(mirror, suite string) []string {
	mirror = strings.TrimRight(mirror, "/")
	s := []string{
		fmt.Sprintf("deb %s %s main", mirror, suite),
		fmt.Sprintf("deb %s %s-updates main", mirror, suite),
	}
	if base, ok := strings.CutSuffix(mirror, "/debian"); ok {
		s = append(s, fmt.Sprintf("deb %s/debian-security %s-security main", base, suite))
	}
	return s
}

func validSuite(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return s[0] != '-'
}

// validPackage is Debian policy's package name syntax (5.6.1).
func validPackage(s string) bool {
	if len(s) < 2 || len(s) > 128 {
		return false
	}
	for i, c := range s {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case i > 0 && (c == '+' || c == '-' || c == '.'):
		default:
			return false
		}
	}
	return true
}

func validMirror(s string) bool {
	if !strings.HasPrefix(s, "http://") && !strings.HasPrefix(s, "https://") {
		return false
	}
	return !strings.ContainsAny(s, " \t\n\r\"'\\") && len(s) < 512
}

// readManifest is the manifest of the image in dir: "name version arch"
// lines.
func readManifest(dir string) ([]byte, error) {
	return os.ReadFile(filepath.Join(filepath.Dir(dir), manifestName))
}

// Manifest returns the packages installed in b (name, version and
// architecture per line, as dpkg-query reported them at build time).
func (b Base) Manifest() ([]byte, error) {
	m, err := readManifest(b.Dir)
	if err != nil {
		return nil, fmt.Errorf("baseimage: manifest of %s: %w", b.ID, err)
	}
	return bytes.Clone(m), nil
}
