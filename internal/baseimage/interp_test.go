package baseimage

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha512"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/codeinterp"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/testenv"
)

func TestInterpConfigValidate(t *testing.T) {
	for name, c := range map[string]InterpConfig{
		"option as a package": {Packages: []string{"--allow-unauthenticated"}},
		"upper-case package":  {Packages: []string{"Python3"}},
		"registry scheme":     {NPMRegistry: "file:///etc"},
		"registry quote":      {NPMRegistry: "https://x/'y"},
		"relative base cache": {Base: Config{CacheDir: "cache"}},
	} {
		if err := c.Validate(); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: %v", name, err)
		}
		if _, err := c.InterpID(); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: InterpID: %v", name, err)
		}
	}
	if err := (InterpConfig{}).Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
}

// TestInterpID: the ID covers the base, the packages and the server's
// files (what Install writes), and nothing else changes it.
func TestInterpID(t *testing.T) {
	files := func(body string) func(string) error {
		return func(dir string) error { return os.WriteFile(filepath.Join(dir, "server.py"), []byte(body), 0o644) }
	}
	id := func(c InterpConfig) string {
		t.Helper()
		s, err := c.InterpID()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	base := InterpConfig{ServerFiles: files("a")}
	a := id(base)
	if !strings.HasPrefix(a, "sha256:") || len(a) != 71 {
		t.Fatalf("id %q", a)
	}
	if id(InterpConfig{ServerFiles: files("a"), Packages: slicesReversed(DefaultInterpPackages)}) != a {
		t.Error("package order changed the id")
	}
	if id(InterpConfig{ServerFiles: files("b")}) == a {
		t.Error("new server files kept the id")
	}
	if id(InterpConfig{ServerFiles: files("a"), Packages: append([]string{"python3-scipy"}, DefaultInterpPackages...)}) == a {
		t.Error("a new package kept the id")
	}
	if id(InterpConfig{ServerFiles: files("a"), Base: Config{Packages: []string{"bash"}}}) == a {
		t.Error("another base kept the id")
	}
	// The real server's files are hashed (codeinterp.Install).
	if id(InterpConfig{}) == a {
		t.Error("the default server files hash like a stand-in")
	}
	failing := InterpConfig{ServerFiles: func(string) error { return errors.New("no files") }}
	if _, err := failing.InterpID(); err == nil || !strings.Contains(err.Error(), "no files") {
		t.Fatalf("failing install: %v", err)
	}
}

func slicesReversed(s []string) []string {
	out := make([]string, 0, len(s))
	for i := len(s) - 1; i >= 0; i-- {
		out = append(out, s[i])
	}
	return out
}

func TestLookupInterpMissing(t *testing.T) {
	_, err := LookupInterp(InterpConfig{Base: Config{CacheDir: t.TempDir()}})
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("empty cache: %v", err)
	}
}

// denoTarball is an npm tarball holding files, and its npm integrity.
func denoTarball(t testing.TB, files map[string]string) ([]byte, string) {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	for name, body := range files {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o755, Size: int64(len(body)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(body))
	}
	tw.Close()
	zw.Close()
	sum := sha512.Sum512(buf.Bytes())
	return buf.Bytes(), "sha512-" + base64.StdEncoding.EncodeToString(sum[:])
}

// TestFetchDeno: the tarball is used only when its integrity is the
// pinned one; a registry error is ErrUnavailable; nothing is left behind
// on a refusal.
func TestFetchDeno(t *testing.T) {
	tgz, integrity := denoTarball(t, map[string]string{"package/package.json": "{}", "package/deno": "#!deno"})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/missing.tgz" {
			http.NotFound(w, r)
			return
		}
		w.Write(tgz)
	}))
	defer srv.Close()
	ctx := context.Background()
	dir := t.TempDir()
	dst := filepath.Join(dir, "deno")
	if err := fetchDeno(ctx, srv.URL+"/d.tgz", integrity, dst); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(dst); err != nil || string(b) != "#!deno" {
		t.Fatalf("binary %q %v", b, err)
	}
	if fi, _ := os.Stat(dst); fi.Mode().Perm()&0o111 == 0 {
		t.Fatalf("binary mode %v", fi.Mode())
	}
	other := filepath.Join(dir, "other")
	_, wrong := denoTarball(t, map[string]string{"package/deno": "tampered"})
	if err := fetchDeno(ctx, srv.URL+"/d.tgz", wrong, other); !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "integrity") {
		t.Fatalf("integrity mismatch: %v", err)
	}
	if err := fetchDeno(ctx, srv.URL+"/missing.tgz", integrity, other); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("404: %v", err)
	}
	if _, err := os.Stat(other); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a refused download left %s: %v", other, err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("temporary files left: %v", ents)
	}
	if !strings.HasSuffix(denoURL(DefaultNPMRegistry), "/@deno/linux-x64-glibc/-/linux-x64-glibc-"+DenoVersion+".tgz") {
		t.Fatalf("registry URL %s", denoURL(DefaultNPMRegistry))
	}
}

func TestExtractDenoRejects(t *testing.T) {
	noBinary, _ := denoTarball(t, map[string]string{"package/README.md": "x", "deno": "not in package/"})
	for name, in := range map[string][]byte{"not gzip": []byte("plain"), "no binary": noBinary} {
		err := extractDeno(bytes.NewReader(in), filepath.Join(t.TempDir(), "deno"))
		if !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func FuzzExtractDeno(f *testing.F) {
	good, _ := denoTarball(f, map[string]string{"package/deno": "bin"})
	f.Add(good)
	f.Add([]byte{0x1f, 0x8b})
	f.Fuzz(func(t *testing.T, b []byte) {
		// Bad input is ErrInvalid, whatever it holds.
		if err := extractDeno(bytes.NewReader(b), filepath.Join(t.TempDir(), "deno")); err != nil && !errors.Is(err, errdefs.ErrInvalid) {
			t.Fatalf("%v", err)
		}
	})
}

// TestBuiltInterpImage checks the code interpreter image make build built:
// a layer over the base holding the Python stack, Deno with its
// system-wide kernelspec and the server's files as codeinterp.Install
// writes them, in layer form.
func TestBuiltInterpImage(t *testing.T) {
	st, err := LookupInterp(InterpConfig{})
	if errors.Is(err, errdefs.ErrNotFound) {
		testenv.Skipf(t, "the code interpreter image is not built (make build): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	base, err := Lookup(Config{})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Layers) != 2 || st.Layers[0] != base.Dir {
		t.Fatalf("layers %v, want the base %s under one layer", st.Layers, base.Dir)
	}
	layer := st.Layers[1]
	if fi, err := os.Stat(filepath.Dir(layer)); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("image dir mode %v %v, want 0700", fi.Mode(), err)
	}
	m, err := os.ReadFile(filepath.Join(filepath.Dir(layer), manifestName))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range DefaultInterpPackages {
		if !bytes.Contains(m, []byte("\n"+p+"\t")) {
			t.Errorf("manifest lacks %s", p)
		}
	}
	for _, mod := range []string{"ipykernel", "jupyter_client", "matplotlib", "pandas", "numpy"} {
		if _, err := os.Stat(filepath.Join(layer, "usr/lib/python3/dist-packages", mod)); err != nil {
			t.Errorf("python module %s: %v", mod, err)
		}
	}
	out, err := exec.Command(filepath.Join(layer, "usr/local/bin/deno"), "--version").Output()
	if err != nil || !strings.Contains(string(out), "deno "+DenoVersion) {
		t.Fatalf("deno --version: %q %v", out, err)
	}
	var spec struct {
		Argv     []string `json:"argv"`
		Language string   `json:"language"`
	}
	b, err := os.ReadFile(filepath.Join(layer, "usr/local/share/jupyter/kernels/deno/kernel.json"))
	if err != nil || json.Unmarshal(b, &spec) != nil {
		t.Fatalf("kernelspec %q %v", b, err)
	}
	if spec.Language != "typescript" || len(spec.Argv) == 0 || spec.Argv[0] != "/usr/local/bin/deno" || !strings.Contains(strings.Join(spec.Argv, " "), "{connection_file}") {
		t.Fatalf("kernelspec %+v", spec)
	}
	want := t.TempDir()
	if err := codeinterp.Install(want); err != nil {
		t.Fatal(err)
	}
	err = filepath.WalkDir(want, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(want, p)
		got, err := os.ReadFile(filepath.Join(layer, codeinterp.InstallDir, rel))
		exp, _ := os.ReadFile(p)
		if err != nil || !bytes.Equal(got, exp) {
			t.Errorf("server file %s differs from codeinterp.Install's (%v)", rel, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var fst syscall.Stat_t
	if err := syscall.Stat(filepath.Join(layer, "home/user/.cache/matplotlib"), &fst); err != nil || fst.Uid != UserID {
		t.Errorf("matplotlib's cache for user: uid %d %v", fst.Uid, err)
	}
	// Layer form: none of overlay's markers but opaque survive the copy.
	err = filepath.WalkDir(layer, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		buf := make([]byte, 4096)
		n, err := unix.Llistxattr(p, buf)
		if err != nil {
			return nil
		}
		for _, name := range strings.Split(string(buf[:n]), "\x00") {
			if strings.HasPrefix(name, "trusted.overlay.") && name != "trusted.overlay.opaque" {
				t.Errorf("%s keeps %s", p, name)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if again, err := EnsureInterp(context.Background(), InterpConfig{}, nil); err != nil || again.ID != st.ID {
		t.Fatalf("EnsureInterp of a built image: %+v %v", again, err)
	}
}
