package baseimage

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"crypto/sha512"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/spacesbx/space/internal/codeinterp"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/layerstore"
)

// interpInfo is CacheDir/<id>/image.json of a code interpreter image.
type interpInfo struct {
	ID           string    `json:"id"`
	Builder      string    `json:"builder"`
	Base         string    `json:"base"`
	Packages     []string  `json:"packages"`
	Deno         string    `json:"deno"`
	DenoSum      string    `json:"deno_integrity"`
	Built        time.Time `json:"built"`
	BuildSeconds float64   `json:"build_seconds"`
	Bytes        int64     `json:"bytes"`
}

// interpScript runs in a mount namespace of its own (its mounts go away
// with it, even when it is killed): the overlay of the base (lower) and
// the new layer (upper), the kernel file systems and the host's resolver
// over it (mounts, so none of it lands in the layer), then apt-get in a
// chroot, the staged files copied in, matplotlib's font cache built for
// user (its first import would otherwise take seconds in every sandbox)
// and apt's leftovers removed. Arguments: base, upper, work, merged,
// stage, packages...
const interpScript = `set -eu
umask 022
base=$1 upper=$2 work=$3 m=$4 stage=$5; shift 5
mount -t overlay overlay -o "lowerdir=$base,upperdir=$upper,workdir=$work,redirect_dir=off,metacopy=off,index=off,xino=off" "$m"
mount -t proc proc "$m/proc"
mount -t tmpfs -o mode=755 tmpfs "$m/dev"
for d in null zero full random urandom tty; do touch "$m/dev/$d"; mount --bind "/dev/$d" "$m/dev/$d"; done
mount -t tmpfs -o mode=1777 tmpfs "$m/tmp"
mount -t tmpfs -o mode=755 tmpfs "$m/run"
mount --bind /etc/resolv.conf "$m/etc/resolv.conf"
export DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
chroot "$m" apt-get update -qq
chroot "$m" apt-get install -y -qq --no-install-recommends -o APT::Install-Recommends=false "$@"
chroot "$m" apt-get clean
install -D -m 0755 "$stage/deno" "$m/usr/local/bin/deno"
mkdir -p "$m/usr/local/share/jupyter/kernels/deno"
install -m 0644 "$stage/kernel.json" "$m/usr/local/share/jupyter/kernels/deno/kernel.json"
mkdir -p "$m$(dirname "$INSTALL_DIR")"
cp -a "$stage/server" "$m$INSTALL_DIR"
chown -R 0:0 "$m$INSTALL_DIR"
chroot --userspec=1000:1000 "$m" env HOME=/home/user MPLBACKEND=Agg python3 -c 'import matplotlib.pyplot'
find "$m/var/lib/apt/lists" -type f ! -name lock -delete
rm -f "$m"/var/cache/apt/*.bin "$m"/var/log/apt/* "$m/var/cache/ldconfig/aux-cache"
dpkg-query --admindir="$m/var/lib/dpkg" -W -f='${Package}\t${Version}\t${Architecture}\n' > "$stage/manifest.txt"
`

// buildInterp makes the code interpreter image id in a temporary
// directory of the cache and renames it into place; it returns the
// layer's size in bytes.
func buildInterp(ctx context.Context, cfg InterpConfig, base Base, id string, log *slog.Logger) (size int64, err error) {
	t0 := time.Now()
	tmp, err := newBuildDir(cfg.Base.CacheDir, id)
	if err != nil {
		return 0, err
	}
	defer dropFailed(&err, tmp, log)
	dirs := map[string]string{}
	for _, d := range []string{"upper", "work", "merged", "stage", "store"} {
		dirs[d] = filepath.Join(tmp, d)
		if err := os.Mkdir(dirs[d], 0o755); err != nil {
			return 0, fmt.Errorf("baseimage: %w", err)
		}
	}
	stage := dirs["stage"]
	if err := fetchDeno(ctx, denoURL(cfg.NPMRegistry), DenoIntegrity, filepath.Join(stage, "deno")); err != nil {
		return 0, err
	}
	if err := os.WriteFile(filepath.Join(stage, "kernel.json"), []byte(denoKernelSpec), 0o644); err != nil {
		return 0, fmt.Errorf("baseimage: %w", err)
	}
	if err := os.Mkdir(filepath.Join(stage, "server"), 0o755); err != nil {
		return 0, fmt.Errorf("baseimage: %w", err)
	}
	if err := cfg.ServerFiles(filepath.Join(stage, "server")); err != nil {
		return 0, fmt.Errorf("baseimage: the code interpreter server's files: %w", err)
	}
	args := append([]string{"-c", interpScript, "interp", base.Dir, dirs["upper"], dirs["work"], dirs["merged"], stage}, cfg.Packages...)
	if err := runLogged(ctx, log, "interp-build", exec.CommandContext(ctx, "/bin/sh", args...), "INSTALL_DIR="+codeinterp.InstallDir); err != nil {
		return 0, fmt.Errorf("baseimage: code interpreter layer: %w", err)
	}
	// The upper directory holds overlay's own markers: copied into layer
	// form (whiteouts kept, opaque directories marked in both namespaces,
	// the rest dropped) by the layer store, then moved to the image's
	// place.
	st, err := layerstore.New(layerstore.Config{Root: dirs["store"]})
	if err != nil {
		return 0, fmt.Errorf("baseimage: %w", err)
	}
	layer, err := st.AddFromUpper(ctx, id, dirs["upper"])
	if err != nil {
		return 0, fmt.Errorf("baseimage: code interpreter layer: %w", err)
	}
	root := filepath.Join(tmp, rootfsName)
	if err := os.Rename(layer, root); err != nil {
		return 0, fmt.Errorf("baseimage: %w", err)
	}
	manifest, err := os.ReadFile(filepath.Join(stage, "manifest.txt"))
	if err != nil {
		return 0, fmt.Errorf("baseimage: manifest: %w", err)
	}
	if err := os.WriteFile(filepath.Join(tmp, manifestName), manifest, 0o644); err != nil {
		return 0, fmt.Errorf("baseimage: %w", err)
	}
	for _, d := range []string{"upper", "work", "merged", "stage", "store"} {
		if err := removeTree(dirs[d]); err != nil {
			return 0, fmt.Errorf("baseimage: %w", err)
		}
	}
	if size, err = treeBytes(root); err != nil {
		return 0, fmt.Errorf("baseimage: size: %w", err)
	}
	inf := interpInfo{ID: id, Builder: InterpBuilderVersion, Base: base.ID, Packages: cfg.Packages, Deno: DenoPackage + "@" + DenoVersion,
		DenoSum: DenoIntegrity, Built: time.Now().UTC(), BuildSeconds: time.Since(t0).Seconds(), Bytes: size}
	if err := publish(cfg.Base.CacheDir, tmp, id, inf); err != nil {
		return 0, err
	}
	return size, nil
}

// maxDenoBytes bounds the download and the binary.
const maxDenoBytes = 512 << 20

// denoURL is the pinned Deno tarball's address on registry.
func denoURL(registry string) string {
	name := DenoPackage[strings.LastIndex(DenoPackage, "/")+1:]
	return fmt.Sprintf("%s/%s/-/%s-%s.tgz", registry, DenoPackage, name, DenoVersion)
}

// fetchDeno downloads Deno's npm tarball from url, checks it against
// integrity (npm's "sha512-<base64>", before anything in it is read) and
// writes its binary to dst.
func fetchDeno(ctx context.Context, url, integrity, dst string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("baseimage: deno: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("baseimage: deno: %w: %w", errdefs.ErrUnavailable, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("baseimage: deno: %w: GET %s: %s", errdefs.ErrUnavailable, url, resp.Status)
	}
	tgz, err := os.CreateTemp(filepath.Dir(dst), ".deno-*.tgz")
	if err != nil {
		return fmt.Errorf("baseimage: %w", err)
	}
	defer os.Remove(tgz.Name())
	defer tgz.Close()
	h := sha512.New()
	n, err := io.Copy(io.MultiWriter(tgz, h), io.LimitReader(resp.Body, maxDenoBytes+1))
	if err != nil {
		return fmt.Errorf("baseimage: deno: %w", err)
	}
	if n > maxDenoBytes {
		return fmt.Errorf("baseimage: deno: %w: %s is larger than %d bytes", errdefs.ErrInvalid, url, maxDenoBytes)
	}
	if got := "sha512-" + base64.StdEncoding.EncodeToString(h.Sum(nil)); got != integrity {
		return fmt.Errorf("baseimage: deno: %w: %s has integrity %s, want %s", errdefs.ErrInvalid, url, got, integrity)
	}
	if _, err := tgz.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("baseimage: %w", err)
	}
	return extractDeno(tgz, dst)
}

// extractDeno writes package/deno of the npm tarball r to dst (0755).
func extractDeno(r io.Reader, dst string) error {
	zr, err := gzip.NewReader(r)
	if err != nil {
		return fmt.Errorf("baseimage: deno: %w: %w", errdefs.ErrInvalid, err)
	}
	tr := tar.NewReader(zr)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return fmt.Errorf("baseimage: deno: %w: no package/deno in the tarball", errdefs.ErrInvalid)
		}
		if err != nil {
			return fmt.Errorf("baseimage: deno: %w: %w", errdefs.ErrInvalid, err)
		}
		if hdr.Name != "package/deno" || hdr.Typeflag != tar.TypeReg {
			continue
		}
		f, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o755)
		if err != nil {
			return fmt.Errorf("baseimage: %w", err)
		}
		if _, err := io.Copy(f, io.LimitReader(tr, maxDenoBytes)); err != nil {
			f.Close()
			return fmt.Errorf("baseimage: deno: %w: %w", errdefs.ErrInvalid, err)
		}
		return f.Close()
	}
}
