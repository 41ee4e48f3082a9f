//go:build linux

package oci

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/compression"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/layerstore"
	"github.com/spacesbx/space/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// tarOf builds an uncompressed layer tar.
func tarOf(t testing.TB, ents ...tar.Header) []byte {
	t.Helper()
	var buf bytes.Buffer
	w := tar.NewWriter(&buf)
	for _, h := range ents {
		var body []byte
		if h.Typeflag == tar.TypeReg {
			body = []byte(h.Linkname) // the body rides in Linkname here
			h.Linkname = ""
			h.Size = int64(len(body))
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		h.ModTime = time.Unix(1700000000, 0)
		if err := w.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write(body); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func file(name, body string, mode int64) tar.Header {
	return tar.Header{Name: name, Typeflag: tar.TypeReg, Linkname: body, Mode: mode}
}

func layerOf(t testing.TB, data []byte, opts ...tarball.LayerOption) v1.Layer {
	t.Helper()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func diffID(t testing.TB, l v1.Layer) string {
	t.Helper()
	h, err := l.DiffID()
	if err != nil {
		t.Fatal(err)
	}
	return h.String()
}

func digestOf(t testing.TB, d interface{ Digest() (v1.Hash, error) }) string {
	t.Helper()
	h, err := d.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return h.String()
}

func imageOf(t testing.TB, base v1.Image, arch string, cfg v1.Config, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(base, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Config = "linux", arch, cfg
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func ociBase() v1.Image {
	return mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
}

// pusher writes images to a test registry (directly, not through a proxy).
type pusher struct {
	tr   *http.Transport
	auth authn.Authenticator
}

func newPusher(t testing.TB, auth authn.Authenticator) *pusher {
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	if auth == nil {
		auth = authn.Anonymous
	}
	return &pusher{tr: tr, auth: auth}
}

func (p *pusher) image(t testing.TB, ref string, img v1.Image) {
	t.Helper()
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img, remote.WithTransport(p.tr), remote.WithAuth(p.auth)); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
}

func (p *pusher) index(t testing.TB, ref string, idx v1.ImageIndex) {
	t.Helper()
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(r, idx, remote.WithTransport(p.tr), remote.WithAuth(p.auth)); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
}

func newStore(t testing.TB) *layerstore.Store {
	t.Helper()
	st, err := layerstore.New(layerstore.Config{Root: filepath.Join(t.TempDir(), "store")})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// storeEmpty fails t when anything is published or left over in st.
func storeEmpty(t testing.TB, st *layerstore.Store) {
	t.Helper()
	for _, d := range []string{"layers", "tmp"} {
		ents, err := os.ReadDir(filepath.Join(st.Root(), d))
		if err != nil || len(ents) != 0 {
			t.Fatalf("store %s not empty: %v %v", d, ents, err)
		}
	}
}

func requireRoot(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t, "layers hold whiteouts (device nodes) and foreign owners")
}

func TestPull(t *testing.T) {
	requireRoot(t)
	reg := startRegistry(t, "", "")
	px := startProxy(t, reg.Host, "", "")
	push := newPusher(t, nil)

	baseTar := tarOf(t,
		tar.Header{Name: "etc/", Typeflag: tar.TypeDir, Mode: 0o755},
		file("etc/os-release", "ID=test\n", 0o644),
		file("etc/gone", "bye", 0o644),
		tar.Header{Name: "opt/d/", Typeflag: tar.TypeDir, Mode: 0o755},
		file("opt/d/old", "old", 0o644),
		file("usr/bin/su", "ELF", 0o4755),
		tar.Header{Name: "bin", Typeflag: tar.TypeSymlink, Linkname: "usr/bin"},
	)
	topTar := tarOf(t,
		file("etc/.wh.gone", "", 0o644),
		file("opt/d/.wh..wh..opq", "", 0o644),
		file("opt/d/new", "new", 0o644),
		tar.Header{Name: "app/", Typeflag: tar.TypeDir, Mode: 0o755, Uid: 1000, Gid: 1000},
		file("app/main", "#!/bin/sh\n", 0o755),
		tar.Header{Name: "app/main2", Typeflag: tar.TypeLink, Linkname: "app/main"},
	)
	cfg := v1.Config{Env: []string{"PATH=/usr/bin:/bin", "A=1"}, WorkingDir: "/app", User: "1000:1000",
		Entrypoint: []string{"/app/main"}, Cmd: []string{"serve"}}

	// Docker v2 manifest, gzip layers.
	base, top := layerOf(t, baseTar), layerOf(t, topTar)
	dockerImg := imageOf(t, empty.Image, "amd64", cfg, base, top)
	push.image(t, reg.Host+"/app:docker", dockerImg)

	// OCI index: arm64 and amd64; the amd64 image shares the base layer
	// (the same diffID, an OCI gzip blob), has the top layer as zstd and
	// one uncompressed layer.
	baseOCI := layerOf(t, baseTar, tarball.WithMediaType(types.OCILayer))
	topZstd := layerOf(t, topTar, tarball.WithCompression(compression.ZStd), tarball.WithMediaType(types.OCILayerZStd))
	plain := static.NewLayer(tarOf(t, file("plain.txt", "uncompressed", 0o644)), types.OCIUncompressedLayer)
	amd := imageOf(t, ociBase(), "amd64", v1.Config{Env: []string{"OCI=1"}}, baseOCI, topZstd, plain)
	arm := imageOf(t, ociBase(), "arm64", v1.Config{}, layerOf(t, tarOf(t, file("arch", "arm64", 0o644)), tarball.WithMediaType(types.OCILayer)))
	idx := mutate.AppendManifests(mutate.IndexMediaType(empty.Index, types.OCIImageIndex),
		mutate.IndexAddendum{Add: arm, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}},
		mutate.IndexAddendum{Add: amd, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "amd64"}}},
	)
	push.index(t, reg.Host+"/app:multi", idx)
	armOnly := mutate.AppendManifests(mutate.IndexMediaType(empty.Index, types.OCIImageIndex),
		mutate.IndexAddendum{Add: arm, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}})
	push.index(t, reg.Host+"/app:armonly", armOnly)
	push.image(t, reg.Host+"/app:arm-single", arm)

	st := newStore(t)
	ctx := context.Background()
	insecure := PullOptions{Insecure: true}

	t.Run("docker", func(t *testing.T) {
		px.reset()
		img, err := Pull(ctx, st, px.Host+"/app:docker", insecure)
		if err != nil {
			t.Fatal(err)
		}
		if img.Digest != digestOf(t, dockerImg) || img.Ref != px.Host+"/app:docker" {
			t.Errorf("ref %q digest %q, want %q", img.Ref, img.Digest, digestOf(t, dockerImg))
		}
		if want := []string{diffID(t, base), diffID(t, top)}; !slices.Equal(img.Layers, want) {
			t.Errorf("layers %v, want %v", img.Layers, want)
		}
		if !slices.Equal(img.Env, cfg.Env) || img.WorkingDir != "/app" || img.User != "1000:1000" ||
			!slices.Equal(img.Entrypoint, cfg.Entrypoint) || !slices.Equal(img.Cmd, cfg.Cmd) {
			t.Errorf("config: %+v", img)
		}
		for _, l := range []v1.Layer{base, top} {
			if n := px.blobGets(digestOf(t, l)); n != 1 {
				t.Errorf("layer blob %s fetched %d times, want 1", digestOf(t, l), n)
			}
		}
		topDir, err := st.Dir(img.Layers[1])
		if err != nil {
			t.Fatal(err)
		}
		var s unix.Stat_t
		if err := unix.Lstat(filepath.Join(topDir, "etc/gone"), &s); err != nil || s.Mode&unix.S_IFMT != unix.S_IFCHR || s.Rdev != 0 {
			t.Errorf("etc/gone is no whiteout: %v", err)
		}
		v := make([]byte, 8)
		for _, k := range []string{"trusted.overlay.opaque", "user.overlay.opaque"} {
			if n, err := unix.Lgetxattr(filepath.Join(topDir, "opt/d"), k, v); err != nil || string(v[:n]) != "y" {
				t.Errorf("opt/d: %s: %v", k, err)
			}
		}
		// The stack mounted for real shows the image's file system.
		baseDir, _ := st.Dir(img.Layers[0])
		mnt := filepath.Join(t.TempDir(), "rootfs")
		if err := os.Mkdir(mnt, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("overlay", mnt, "overlay", unix.MS_RDONLY, "lowerdir="+topDir+":"+baseDir); err != nil {
			testenv.Skipf(t, "overlay mount: %v", err)
		}
		defer unix.Unmount(mnt, unix.MNT_DETACH)
		for p, want := range map[string]bool{"etc/os-release": true, "etc/gone": false, "opt/d/old": false, "opt/d/new": true, "app/main2": true, "bin/su": true} {
			if _, err := os.Lstat(filepath.Join(mnt, p)); (err == nil) != want {
				t.Errorf("rootfs %s: present=%v, want %v", p, err == nil, want)
			}
		}
		if err := unix.Lstat(filepath.Join(mnt, "usr/bin/su"), &s); err != nil || s.Mode&0o7777 != 0o4755 {
			t.Errorf("su: mode %o %v", s.Mode&0o7777, err)
		}
	})

	t.Run("again-downloads-no-layer", func(t *testing.T) {
		px.reset()
		if _, err := Pull(ctx, st, px.Host+"/app:docker", insecure); err != nil {
			t.Fatal(err)
		}
		for _, l := range []v1.Layer{base, top} {
			if n := px.blobGets(digestOf(t, l)); n != 0 {
				t.Errorf("layer blob fetched %d times on the second pull, want 0", n)
			}
		}
	})

	t.Run("oci-index-shares-base", func(t *testing.T) {
		px.reset()
		img, err := Pull(ctx, st, px.Host+"/app:multi", insecure)
		if err != nil {
			t.Fatal(err)
		}
		if img.Digest != digestOf(t, amd) {
			t.Errorf("digest %s, want the amd64 manifest %s", img.Digest, digestOf(t, amd))
		}
		if want := []string{diffID(t, baseOCI), diffID(t, topZstd), diffID(t, plain)}; !slices.Equal(img.Layers, want) {
			t.Errorf("layers %v, want %v", img.Layers, want)
		}
		if img.Layers[0] != diffID(t, base) || img.Layers[1] != diffID(t, top) {
			t.Fatal("test setup: OCI layers should share the Docker image's diffIDs")
		}
		if n := px.blobGets(digestOf(t, baseOCI)); n != 0 {
			t.Errorf("shared base layer fetched %d times, want 0 (in the store already)", n)
		}
		if n := px.blobGets(digestOf(t, topZstd)); n != 0 {
			t.Errorf("zstd top layer (same diffID as the Docker one) fetched %d times, want 0", n)
		}
		if n := px.blobGets(digestOf(t, plain)); n != 1 {
			t.Errorf("uncompressed layer fetched %d times, want 1", n)
		}
		ents, _ := os.ReadDir(filepath.Join(st.Root(), "layers"))
		if len(ents) != 3 {
			t.Errorf("store holds %d layers, want 3 (base, top, plain: stored once)", len(ents))
		}
		if !slices.Equal(img.Env, []string{"OCI=1"}) {
			t.Errorf("env %v", img.Env)
		}
	})

	t.Run("zstd-fresh-store", func(t *testing.T) {
		st2 := newStore(t)
		img, err := Pull(ctx, st2, px.Host+"/app:multi", insecure)
		if err != nil {
			t.Fatal(err)
		}
		d, _ := st2.Dir(img.Layers[1])
		if b, err := os.ReadFile(filepath.Join(d, "opt/d/new")); err != nil || string(b) != "new" {
			t.Errorf("zstd layer content: %q %v", b, err)
		}
		d, _ = st2.Dir(img.Layers[2])
		if b, err := os.ReadFile(filepath.Join(d, "plain.txt")); err != nil || string(b) != "uncompressed" {
			t.Errorf("uncompressed layer content: %q %v", b, err)
		}
	})

	t.Run("concurrent-pulls-fetch-each-layer-once", func(t *testing.T) {
		var layers []v1.Layer
		for i := range 6 {
			layers = append(layers, layerOf(t, tarOf(t, file(fmt.Sprintf("l%d/data", i), strings.Repeat(fmt.Sprint(i), 50000), 0o644))))
		}
		push.image(t, reg.Host+"/app:many", imageOf(t, empty.Image, "amd64", v1.Config{}, layers...))
		px.reset()
		st2 := newStore(t)
		var wg sync.WaitGroup
		errs := make([]error, 3)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, errs[i] = Pull(ctx, st2, px.Host+"/app:many", insecure)
			}()
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		for _, l := range layers {
			if n := px.blobGets(digestOf(t, l)); n != 1 {
				t.Errorf("layer fetched %d times by 3 concurrent pulls, want 1", n)
			}
			d, err := st2.Dir(diffID(t, l))
			if err != nil {
				t.Fatal(err)
			}
			if ents, _ := os.ReadDir(d); len(ents) != 1 {
				t.Errorf("layer %s: %d entries", d, len(ents))
			}
		}
	})

	t.Run("by-digest", func(t *testing.T) {
		img, err := Pull(ctx, st, px.Host+"/app@"+digestOf(t, dockerImg), insecure)
		if err != nil || img.Digest != digestOf(t, dockerImg) {
			t.Fatalf("%v %v", img.Digest, err)
		}
	})

	for _, tc := range []struct {
		name, ref string
		opt       PullOptions
		want      error
	}{
		{"unknown-tag", "/app:nope", insecure, errdefs.ErrNotFound},
		{"unknown-repo", "/nope:latest", insecure, errdefs.ErrNotFound},
		{"unknown-digest", "/app@sha256:" + strings.Repeat("0", 64), insecure, errdefs.ErrNotFound},
		{"index-without-amd64", "/app:armonly", insecure, errdefs.ErrNotFound},
		{"single-arm64-manifest", "/app:arm-single", insecure, errdefs.ErrNotFound},
		{"bad-reference", "/APP:x", insecure, errdefs.ErrInvalid},
		{"plain-http-without-insecure", "/app:docker", PullOptions{}, errdefs.ErrDenied},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st3 := newStore(t)
			_, err := Pull(ctx, st3, px.Host+tc.ref, tc.opt)
			if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) {
				t.Fatalf("Pull = %v, want %v", err, tc.want)
			}
			t.Logf("refused: %v", err)
			storeEmpty(t, st3)
		})
	}
}

// liar is a layer whose DiffID is not its content's.
type liar struct {
	v1.Layer
	diffID v1.Hash
}

func (l liar) DiffID() (v1.Hash, error) { return l.diffID, nil }

func TestPullRefusesBadContent(t *testing.T) {
	requireRoot(t)
	reg := startRegistry(t, "", "")
	push := newPusher(t, nil)
	ctx := context.Background()
	insecure := PullOptions{Insecure: true}
	good := layerOf(t, tarOf(t, file("good", "good", 0o644)))

	// A blob changed in the registry's storage after the push: same
	// length, different bytes.
	tampered := layerOf(t, tarOf(t, file("data", strings.Repeat("tamper me ", 2000), 0o644)))
	push.image(t, reg.Host+"/bad:tampered", imageOf(t, empty.Image, "amd64", v1.Config{}, good, tampered))
	p := reg.blobPath(digestOf(t, tampered))
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	for i := len(b) / 3; i < len(b)/3+16; i++ {
		b[i] ^= 0xff
	}
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}

	// A blob the registry serves as pushed but whose uncompressed content
	// is not the diffID the config names.
	lie := liar{Layer: layerOf(t, tarOf(t, file("x", "x", 0o644))), diffID: v1.Hash{Algorithm: "sha256", Hex: strings.Repeat("ab", 32)}}
	push.image(t, reg.Host+"/bad:diffid", imageOf(t, empty.Image, "amd64", v1.Config{}, lie))

	// Correct digests, hostile content.
	var hostile bytes.Buffer
	w := tar.NewWriter(&hostile)
	_ = w.WriteHeader(&tar.Header{Name: "../../escape", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1})
	_, _ = w.Write([]byte("x"))
	_ = w.Close()
	push.image(t, reg.Host+"/bad:hostile", imageOf(t, empty.Image, "amd64", v1.Config{}, layerOf(t, hostile.Bytes())))

	// A blob that is not a compressed tar at all.
	junk := static.NewLayer([]byte("\x1f\x8bthis is no gzip stream at all"), types.DockerLayer)
	push.image(t, reg.Host+"/bad:junk", imageOf(t, empty.Image, "amd64", v1.Config{}, junk))

	for _, tc := range []struct{ tag, why string }{
		{"tampered", "digest mismatch"},
		{"diffid", "diffID mismatch"},
		{"hostile", "'..' component"},
		{"junk", "layer"},
	} {
		t.Run(tc.tag, func(t *testing.T) {
			st := newStore(t)
			_, err := Pull(ctx, st, reg.Host+"/bad:"+tc.tag, insecure)
			if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), tc.why) {
				t.Fatalf("Pull = %v, want ErrInvalid (%s)", err, tc.why)
			}
			t.Logf("refused: %v", err)
			// The good layer before the bad one may be published; the
			// bad one never is, nor any leftover.
			ents, _ := os.ReadDir(filepath.Join(st.Root(), "layers"))
			for _, e := range ents {
				if e.Name() != strings.Replace(diffID(t, good), ":", "-", 1) {
					t.Errorf("published: %s", e.Name())
				}
			}
			if ents, _ := os.ReadDir(filepath.Join(st.Root(), "tmp")); len(ents) != 0 {
				t.Errorf("leftovers in tmp: %v", ents)
			}
		})
	}
}

func TestPullBasicAuth(t *testing.T) {
	requireRoot(t)
	const user, pass = "alice", "s3cret-Pa55"
	reg := startRegistry(t, user, pass)
	push := newPusher(t, &authn.Basic{Username: user, Password: pass})
	push.image(t, reg.Host+"/private:v1", imageOf(t, empty.Image, "amd64", v1.Config{}, layerOf(t, tarOf(t, file("secret", "s", 0o600)))))
	testAuth(t, reg.Host+"/private:v1", user, pass)
}

func TestPullTokenAuth(t *testing.T) {
	requireRoot(t)
	const user, pass = "bob", "t0ken-Pa55"
	reg := startRegistry(t, "", "")
	push := newPusher(t, nil)
	push.image(t, reg.Host+"/private:v1", imageOf(t, empty.Image, "amd64", v1.Config{}, layerOf(t, tarOf(t, file("secret", "t", 0o600)))))
	px := startProxy(t, reg.Host, user, pass)
	testAuth(t, px.Host+"/private:v1", user, pass)
}

func testAuth(t *testing.T, ref, user, pass string) {
	ctx := context.Background()
	for _, tc := range []struct {
		name       string
		user, pass string
		want       error
	}{
		{"right", user, pass, nil},
		{"wrong-password", user, "wrong", errdefs.ErrDenied},
		{"unknown-user", "mallory", pass, errdefs.ErrDenied},
		{"no-credentials", "", "", errdefs.ErrDenied},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := newStore(t)
			img, err := Pull(ctx, st, ref, PullOptions{Username: tc.user, Password: tc.pass, Insecure: true})
			if tc.want == nil {
				if err != nil || len(img.Layers) != 1 {
					t.Fatalf("Pull = %+v, %v", img, err)
				}
				return
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("Pull = %v, want %v", err, tc.want)
			}
			if strings.Contains(err.Error(), pass) {
				t.Fatalf("error leaks the password: %v", err)
			}
			t.Logf("refused: %v", err)
			storeEmpty(t, st)
		})
	}
}

func TestPullContextCanceled(t *testing.T) {
	requireRoot(t)
	reg := startRegistry(t, "", "")
	push := newPusher(t, nil)
	push.image(t, reg.Host+"/c:v1", imageOf(t, empty.Image, "amd64", v1.Config{}, layerOf(t, tarOf(t, file("f", "f", 0o644)))))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	st := newStore(t)
	if _, err := Pull(ctx, st, reg.Host+"/c:v1", PullOptions{Insecure: true}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Pull = %v, want context.Canceled", err)
	}
	storeEmpty(t, st)
}

// TestPullRefusesHugeMetadata: a registry declaring or serving oversized
// manifests and configs is refused before they are read into memory.
func TestPullRefusesHugeMetadata(t *testing.T) {
	requireRoot(t)
	cfgDigest := "sha256:" + strings.Repeat("c", 64)
	small := `{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",` +
		`"config":{"mediaType":"application/vnd.docker.container.image.v1+json","size":1099511627776,"digest":"` + cfgDigest + `"},"layers":[]}`
	huge := `{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json","annotations":{"pad":"` +
		strings.Repeat("x", MaxManifestSize) + `"},"config":{"mediaType":"application/vnd.docker.container.image.v1+json","size":2,"digest":"` + cfgDigest + `"},"layers":[]}`
	var configGets atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/v2/":
		case strings.HasSuffix(r.URL.Path, "/manifests/bigconfig"):
			w.Header().Set("Content-Type", "application/vnd.docker.distribution.manifest.v2+json")
			_, _ = io.WriteString(w, small)
		case strings.HasSuffix(r.URL.Path, "/manifests/bigmanifest"):
			w.Header().Set("Content-Type", "application/vnd.docker.distribution.manifest.v2+json")
			_, _ = io.WriteString(w, huge)
		case strings.Contains(r.URL.Path, "/blobs/"):
			configGets.Add(1)
			http.Error(w, "no", http.StatusNotFound)
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	for _, tag := range []string{"bigconfig", "bigmanifest"} {
		t.Run(tag, func(t *testing.T) {
			st := newStore(t)
			_, err := Pull(context.Background(), st, host+"/x:"+tag, PullOptions{Insecure: true})
			if !errors.Is(err, errdefs.ErrTooLarge) {
				t.Fatalf("Pull = %v, want ErrTooLarge", err)
			}
			t.Logf("refused: %v", err)
			storeEmpty(t, st)
		})
	}
	if n := configGets.Load(); n != 0 {
		t.Errorf("config fetched %d times", n)
	}
}
