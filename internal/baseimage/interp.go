package baseimage

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spacesbx/space/internal/codeinterp"
	"github.com/spacesbx/space/internal/errdefs"
)

// The code interpreter image: one layer over the base image (the
// code-interpreter-v1 template) holding the Python data stack from Debian,
// Deno (its Jupyter kernel: JavaScript and TypeScript) from npm, and the
// code interpreter server (internal/codeinterp). It is built like the
// base (once per content ID into the same cache, under an flock, in a
// temporary directory renamed into place): apt-get runs in a chroot over
// an overlay whose lower layer is the base's tree, and the overlay's upper
// directory, copied into layer form, is the new layer.

// InterpBuilderVersion is part of the code interpreter image's content
// ID: bump it whenever its build changes.
const InterpBuilderVersion = "space-code-interpreter-v1"

// DefaultInterpPackages are the Debian packages of the code interpreter
// image (beyond the base's).
var DefaultInterpPackages = []string{
	"python3-ipykernel", "python3-jupyter-client", "python3-matplotlib", "python3-pandas", "python3-numpy",
}

// Deno, pinned: the npm package serving its Linux x86-64 glibc binary, its
// version and the registry's integrity of that version's tarball (npm view
// @deno/linux-x64-glibc@<version> dist.integrity). A new version is a
// deliberate change of these three lines.
const (
	DenoPackage        = "@deno/linux-x64-glibc"
	DenoVersion        = "2.9.6"
	DenoIntegrity      = "sha512-3md4TKLCuzsLDmfOoC5KN7NAZaxSVkMgm64vg6foD00JBADCpYS2/5QqXfzgnP5ZQz3iLP9vBQJtEgc116OAoQ=="
	DefaultNPMRegistry = "https://registry.npmjs.org"
)

// denoKernelSpec is Deno's Jupyter kernelspec, installed system-wide
// (/usr/local/share/jupyter/kernels/deno) as `deno jupyter --install`
// writes it for one user.
const denoKernelSpec = `{
  "argv": ["/usr/local/bin/deno", "jupyter", "--kernel", "--conn", "{connection_file}"],
  "display_name": "Deno",
  "language": "typescript",
  "env": {"NO_COLOR": "1"}
}
`

// InterpConfig says which code interpreter image to build.
type InterpConfig struct {
	// Base is the image under it (its CacheDir is this image's cache too).
	Base Config
	// Packages are installed over the base (default DefaultInterpPackages).
	Packages []string
	// NPMRegistry serves Deno's package (default DefaultNPMRegistry).
	NPMRegistry string
	// ServerFiles writes the server's files into a directory (default
	// codeinterp.Install); its output is part of the content ID.
	ServerFiles func(dir string) error
}

func (c InterpConfig) withDefaults() InterpConfig {
	c.Base = c.Base.withDefaults()
	if len(c.Packages) == 0 {
		c.Packages = DefaultInterpPackages
	}
	c.Packages = slices.Clone(c.Packages)
	slices.Sort(c.Packages)
	c.Packages = slices.Compact(c.Packages)
	if c.NPMRegistry == "" {
		c.NPMRegistry = DefaultNPMRegistry
	}
	c.NPMRegistry = strings.TrimRight(c.NPMRegistry, "/")
	if c.ServerFiles == nil {
		c.ServerFiles = codeinterp.Install
	}
	return c
}

// Validate reports whether c (its zero fields taking their defaults) is
// usable; package names reach apt-get's command line.
func (c InterpConfig) Validate() error {
	if err := c.Base.Validate(); err != nil {
		return err
	}
	c = c.withDefaults()
	for _, p := range c.Packages {
		if !validPackage(p) {
			return fmt.Errorf("baseimage: %w: package name %q", errdefs.ErrInvalid, p)
		}
	}
	if !validMirror(c.NPMRegistry) {
		return fmt.Errorf("baseimage: %w: npm registry %q must be an http(s) URL without spaces", errdefs.ErrInvalid, c.NPMRegistry)
	}
	return nil
}

// Stack is a built image of several layers.
type Stack struct {
	// ID is the content ID of the whole stack, "sha256:<hex>".
	ID string
	// Layers are the trees in overlay lower-layer form, bottom first.
	Layers []string
	// Env is the image's process environment defaults (KEY=VALUE).
	Env []string
}

// InterpID returns the content ID of the code interpreter image c
// describes: the base's ID and every input of the layer, the server's
// files included (so a new server is a new image).
func (c InterpConfig) InterpID() (string, error) {
	if err := c.Validate(); err != nil {
		return "", err
	}
	c = c.withDefaults()
	baseID, err := c.Base.ID()
	if err != nil {
		return "", err
	}
	serverSum, err := serverFilesSum(c.ServerFiles)
	if err != nil {
		return "", err
	}
	b, _ := json.Marshal(struct {
		Builder, Base             string
		Packages                  []string
		Deno, DenoSum, KernelSpec string
		Server, ServerDir         string
	}{InterpBuilderVersion, baseID, c.Packages, DenoPackage + "@" + DenoVersion, DenoIntegrity, denoKernelSpec, serverSum, codeinterp.InstallDir})
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:]), nil
}

// serverFilesSum hashes what install writes: every path, mode and content.
func serverFilesSum(install func(string) error) (string, error) {
	dir, err := os.MkdirTemp("", "space-interp-server-")
	if err != nil {
		return "", fmt.Errorf("baseimage: %w", err)
	}
	defer os.RemoveAll(dir)
	if err := install(dir); err != nil {
		return "", fmt.Errorf("baseimage: the code interpreter server's files: %w", err)
	}
	h := sha256.New()
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		fmt.Fprintf(h, "%s\x00%o\x00", rel, fi.Mode())
		if d.Type().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			fmt.Fprintf(h, "%d\x00", len(b))
			h.Write(b)
		}
		return nil
	})
	if err != nil {
		return "", fmt.Errorf("baseimage: hashing the server's files: %w", err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// LookupInterp returns the code interpreter image if both it and its
// base were built, without building: errdefs.ErrNotFound otherwise.
func LookupInterp(cfg InterpConfig) (Stack, error) {
	id, err := cfg.InterpID()
	if err != nil {
		return Stack{}, err
	}
	cfg = cfg.withDefaults()
	base, err := Lookup(cfg.Base)
	if err != nil {
		return Stack{}, err
	}
	return lookupInterp(cfg, base, id)
}

func lookupInterp(cfg InterpConfig, base Base, id string) (Stack, error) {
	dir := filepath.Join(cfg.Base.CacheDir, dirName(id))
	if _, err := os.Stat(filepath.Join(dir, infoName)); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return Stack{}, fmt.Errorf("baseimage: code interpreter image %s: %w (make build builds it)", id, errdefs.ErrNotFound)
		}
		return Stack{}, fmt.Errorf("baseimage: %w", err)
	}
	return Stack{ID: id, Layers: []string{base.Dir, filepath.Join(dir, rootfsName)}, Env: slices.Clone(base.Env)}, nil
}

// EnsureInterp returns the code interpreter image, building its base and
// then it first when they are not in the cache (minutes). Concurrent
// calls build it once. A build needs root, the Debian mirror and the npm
// registry; a host that cannot build gets errdefs.ErrUnavailable.
func EnsureInterp(ctx context.Context, cfg InterpConfig, log *slog.Logger) (Stack, error) {
	if log == nil {
		log = slog.Default()
	}
	id, err := cfg.InterpID()
	if err != nil {
		return Stack{}, err
	}
	cfg = cfg.withDefaults()
	base, err := Ensure(ctx, cfg.Base, log)
	if err != nil {
		return Stack{}, err
	}
	if s, err := lookupInterp(cfg, base, id); err == nil {
		return s, nil
	}
	unlock, err := lockFile(ctx, filepath.Join(cfg.Base.CacheDir, "."+dirName(id)+".lock"))
	if err != nil {
		return Stack{}, err
	}
	defer unlock()
	if s, err := lookupInterp(cfg, base, id); err == nil { // built while we waited
		return s, nil
	}
	if os.Geteuid() != 0 {
		return Stack{}, fmt.Errorf("baseimage: cannot build %s: %w: building the image needs root (overlay mount, chroot)", id, errdefs.ErrUnavailable)
	}
	t0 := time.Now()
	log.Info("baseimage: building the code interpreter image (once per content ID; minutes)", "id", id, "base", base.ID)
	size, err := buildInterp(ctx, cfg, base, id, log)
	if err != nil {
		return Stack{}, err
	}
	log.Info("baseimage: built the code interpreter image", "id", id, "took", time.Since(t0).Round(time.Second), "bytes", size)
	return lookupInterp(cfg, base, id)
}
