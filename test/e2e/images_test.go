package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// tinyImage is a busybox userland built here: /bin/busybox with the
// shells and tools as links, an /etc of its own and a marker file.
func tinyImage(t *testing.T) v1.Image {
	t.Helper()
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		testenv.Skipf(t, "no static busybox (make vm-deps installs busybox-static): %v", err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dir := func(n string, mode int64) {
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: n, Mode: mode})
	}
	file := func(n string, mode int64, b []byte) {
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: n, Mode: mode, Size: int64(len(b))})
		tw.Write(b)
	}
	for _, d := range []string{"bin/", "etc/", "tmp/", "root/", "home/", "usr/", "usr/bin/", "sbin/", "usr/sbin/"} {
		dir(d, 0o755)
	}
	tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777})
	file("bin/busybox", 0o755, bb)
	// Debian's busybox has no bash applet: bash is sh.
	file("bin/bash", 0o755, []byte("#!/bin/sh\nexec /bin/sh \"$@\"\n"))
	for _, l := range []string{"bin/sh", "bin/cat", "bin/echo", "bin/id", "bin/ls", "bin/mkdir", "bin/cp", "bin/rm", "bin/tar", "bin/chown", "bin/chmod",
		"bin/test", "bin/sleep", "bin/basename", "bin/dirname", "usr/bin/env", "usr/bin/id", "sbin/adduser", "usr/sbin/adduser", "bin/grep", "bin/wc"} {
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: l, Linkname: "/bin/busybox", Mode: 0o777})
	}
	file("etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/bin/sh\n"))
	file("etc/group", 0o644, []byte("root:x:0:\n"))
	file("etc/image-marker", 0o644, []byte("from the registry\n"))
	tw.Close()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf.Bytes())), nil })
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS = "amd64", "linux"
	cf.Config.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "IMAGE_ENV=set-by-image"}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func push(t *testing.T, img v1.Image, ref string, auth authn.Authenticator) {
	t.Helper()
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img, remote.WithAuth(auth)); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
}

// TestTemplateFromImage builds templates fromImage on local registries
// (one open, one with credentials) through the template API, creates
// sandboxes of them, and checks what is refused.
func TestTemplateFromImage(t *testing.T) {
	testenv.RequirePlatform(t)
	img := tinyImage(t)
	open := testenv.StartRegistry(t, "", "").Host
	locked := testenv.StartRegistry(t, "alice", "s3cret-pass").Host
	push(t, img, open+"/tiny:1", authn.Anonymous)
	push(t, img, locked+"/tiny:1", &authn.Basic{Username: "alice", Password: "s3cret-pass"})

	p := testenv.StartPlatform(t, testenv.PlatformOptions{Workers: 1, APIKey: apiKey, ReadyTimeout: 60 * time.Second,
		Args: []string{"--insecure-registry=" + open, "--insecure-registry=" + locked}})
	c, err := sdk.New(sdk.Config{APIURL: p.APIURL, SandboxURL: p.SandboxURL, APIKey: apiKey})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	build := func(tplName string, spec sdk.BuildSpec) error {
		ref, err := c.RequestBuild(ctx, tplName, nil)
		if err != nil {
			return err
		}
		if err := c.StartBuild(ctx, ref, spec); err != nil {
			return err
		}
		return c.WaitBuild(ctx, ref, func(l sdk.BuildLogEntry) { t.Logf("%s: %s", tplName, l.Message) })
	}
	steps := []sdk.BuildStep{{Type: "RUN", Args: []string{"echo built > /built.txt && chown user /built.txt"}}}

	// An open registry; then a sandbox of the template runs the image.
	if err := build("from-open", sdk.BuildSpec{FromImage: open + "/tiny:1", Steps: steps}); err != nil {
		t.Fatalf("build from the open registry: %v", err)
	}
	sbx, err := c.CreateSandbox(ctx, sdk.CreateOptions{Template: "from-open", Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer sbx.Kill(context.Background())
	var out strings.Builder
	code, err := sbx.Run(ctx, "cat /etc/image-marker /built.txt; echo $IMAGE_ENV; id -un; ls /usr/bin/python3 2>&1 || true", sdk.RunOptions{Stdout: &out, Stderr: &out})
	if err != nil || code != 0 {
		t.Fatalf("run in the image sandbox: %d %v\n%s", code, err, out.String())
	}
	want := "from the registry\nbuilt\nset-by-image\nuser\n"
	if !strings.HasPrefix(out.String(), want) || !strings.Contains(out.String(), "No such file") {
		t.Fatalf("the sandbox is not the image (no host /usr, the image's env, the sandbox user):\n%q", out.String())
	}

	// Credentials: right ones work, wrong or none are refused.
	creds := func(user, pass string) *sdk.FromImageRegistry {
		return &sdk.FromImageRegistry{Type: "registry", Username: user, Password: pass}
	}
	if err := build("from-locked", sdk.BuildSpec{FromImage: locked + "/tiny:1", FromImageRegistry: creds("alice", "s3cret-pass"), Steps: steps}); err != nil {
		t.Fatalf("build with credentials: %v", err)
	}
	for name, reg := range map[string]*sdk.FromImageRegistry{"wrong-pass": creds("alice", "nope"), "no-creds": nil} {
		err := build("locked-"+name, sdk.BuildSpec{FromImage: locked + "/tiny:1", FromImageRegistry: reg, Steps: steps})
		var be *sdk.BuildError
		if !errors.As(err, &be) || !strings.Contains(be.Message, "denied") || strings.Contains(be.Message, "nope") {
			t.Fatalf("%s: %v, want a denied build error without the password", name, err)
		}
	}
	// A registry on a private address the operator did not list.
	err = build("unlisted", sdk.BuildSpec{FromImage: "127.0.0.1:1/tiny:1", Steps: steps})
	var be *sdk.BuildError
	if !errors.As(err, &be) || !strings.Contains(be.Message, "private address") {
		t.Fatalf("unlisted loopback registry: %v", err)
	}
}
