//go:build linux

package microvm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

// exec runs cmd as user (/bin/bash -l -c, as the e2b SDK does) and returns
// its output and exit code.
func (s *agentSession) exec(t *testing.T, ctx context.Context, user, cmd string) (stdout, stderr string, code int32) {
	t.Helper()
	req := connect.NewRequest(&processpb.StartRequest{
		Process: &processpb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", cmd}},
	})
	req.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":")))
	st, err := s.proc.Start(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	var out, errOut strings.Builder
	code = -1
	for st.Receive() {
		ev := st.Msg().GetEvent()
		if d := ev.GetData(); d != nil {
			out.Write(d.GetStdout())
			errOut.Write(d.GetStderr())
		}
		if e := ev.GetEnd(); e != nil {
			code = e.GetExitCode()
		}
	}
	if err := st.Err(); err != nil {
		t.Fatalf("%q: %v", cmd, err)
	}
	return out.String(), errOut.String(), code
}

// mustExec is exec that fails the test on a non-zero exit.
func (s *agentSession) mustExec(t *testing.T, ctx context.Context, user, cmd string) string {
	t.Helper()
	out, errOut, code := s.exec(t, ctx, user, cmd)
	if code != 0 {
		t.Fatalf("%q as %s: exit %d, stdout %q, stderr %q", cmd, user, code, out, errOut)
	}
	return out
}

// testImage builds a two-layer image in layer form under dir: a static
// busybox userland at the bottom; on top a file that shadows one below, a
// whiteout (0:0 character device) hiding another, an opaque directory
// (both xattr forms) hiding its lower contents; below also a setuid file,
// a hard link pair, a user-owned file and a symlink.
func testImage(t *testing.T, dir string) *substrate.Image {
	t.Helper()
	testenv.RequireRoot(t, "layers hold root-owned, setuid files and device whiteouts")
	bb, err := os.ReadFile(DefaultBusyboxPath)
	if err != nil {
		testenv.Skipf(t, "no static busybox: %v", err)
	}
	low, up := filepath.Join(dir, "l1"), filepath.Join(dir, "l2")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	mkdir := func(root, p string, mode os.FileMode, uid int) {
		must(os.MkdirAll(filepath.Join(root, p), 0o755))
		must(os.Chmod(filepath.Join(root, p), mode))
		must(os.Lchown(filepath.Join(root, p), uid, uid))
	}
	file := func(root, p, content string, mode os.FileMode, uid int) {
		must(os.WriteFile(filepath.Join(root, p), []byte(content), 0o600))
		must(os.Lchown(filepath.Join(root, p), uid, uid))
		must(os.Chmod(filepath.Join(root, p), mode))
	}
	for _, d := range []string{"bin", "etc", "proc", "sys", "dev", "run", "tmp", "root", "home", "usr/bin", "opt/dir", "var/tmp"} {
		mkdir(low, d, 0o755, 0)
	}
	must(os.Chmod(filepath.Join(low, "tmp"), os.ModeSticky|0o777))
	must(os.Chmod(filepath.Join(low, "root"), 0o700))
	mkdir(low, "home/user", 0o755, 1000)
	file(low, "bin/busybox", string(bb), 0o755, 0)
	out, err := exec.Command(DefaultBusyboxPath, "--list").Output()
	must(err)
	for _, a := range strings.Fields(string(out)) {
		if a != "busybox" {
			must(os.Symlink("busybox", filepath.Join(low, "bin", a)))
		}
	}
	file(low, "bin/bash", "#!/bin/sh\nexec /bin/sh \"$@\"\n", 0o755, 0)
	file(low, "etc/passwd", imgPasswd, 0o644, 0)
	file(low, "etc/group", imgGroup, 0o644, 0)
	file(low, "etc/profile", imgProfile, 0o644, 0)
	file(low, "etc/shadowed", "from-lower\n", 0o644, 0)
	file(low, "etc/gone", "deleted above\n", 0o644, 0)
	file(low, "opt/dir/a", "a\n", 0o644, 0)
	file(low, "opt/dir/b", "b\n", 0o644, 0)
	file(low, "usr/bin/suid", string(bb), 0o755, 0)
	must(os.Chmod(filepath.Join(low, "usr/bin/suid"), os.ModeSetuid|0o755))
	file(low, "usr/bin/hl1", "linked\n", 0o644, 0)
	must(os.Link(filepath.Join(low, "usr/bin/hl1"), filepath.Join(low, "usr/bin/hl2")))
	file(low, "home/user/secret", "user's\n", 0o640, 1000)
	must(os.Symlink("/etc/shadowed", filepath.Join(low, "usr/bin/link")))

	mkdir(up, "etc", 0o755, 0)
	mkdir(up, "opt/dir", 0o755, 0)
	file(up, "etc/shadowed", "from-upper\n", 0o644, 0)
	must(unix.Mknod(filepath.Join(up, "etc/gone"), unix.S_IFCHR, 0))
	for _, x := range []string{"trusted.overlay.opaque", "user.overlay.opaque"} {
		must(unix.Setxattr(filepath.Join(up, "opt/dir"), x, []byte("y"), 0))
	}
	file(up, "opt/dir/c", "c\n", 0o644, 0)
	for _, l := range []string{low, up} {
		must(os.Chmod(l, 0o755))
	}
	must(os.Chmod(dir, 0o700))
	return &substrate.Image{ID: "sha256:test-" + filepath.Base(dir), Layers: []string{low, up}}
}

// TestImageVM boots VMs whose root is a hand-made two-layer image:
// the files are the image's (shadowed, whited out, opaque, setuid, hard
// links, owners), the image disk is read-only for the guest, writes land
// on the layer disk and survive a Stop and a Start on the same directory,
// two VMs share the one cached image, and a saved state restores with its
// layer disk (files and a running process) in another directory.
func TestImageVM(t *testing.T) {
	s, agent, ctx := agentSubstrate(t)
	s.cfg.RootDiskDir = filepath.Join(t.TempDir(), "vm-images")
	img := testImage(t, t.TempDir())
	t0 := time.Now()
	d, err := s.ensureRootDisk(img)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(d.path)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("root disk: %d MiB (%d KiB allocated), flattened in %s", fi.Size()>>20, fi.Sys().(*syscall.Stat_t).Blocks/2, time.Since(t0).Round(time.Millisecond))
	if fi.Mode().Perm() != 0o400 {
		t.Errorf("root disk mode %v, want 0400", fi.Mode().Perm())
	}
	base := t.TempDir()
	lim := substrate.Limits{DiskBytes: 256 << 20}
	spec := func(act string) substrate.Spec {
		return substrate.Spec{Route: testRoute(act), Template: "img", Dir: filepath.Join(base, act), AgentPath: agent, Image: img, Limits: lim}
	}

	// First VM: a clone of the image's template (built by this start).
	t0 = time.Now()
	sp1 := spec("i1")
	inst, err := s.Start(ctx, sp1)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Stop(context.Background())
	a := activate(t, ctx, inst, sp1.Route)
	t.Logf("image VM (template built, then cloned) activated %s after Start began", time.Since(t0).Round(time.Millisecond))
	checkImageFiles(t, ctx, a)

	// The image disk is read-only for the guest, even for its root.
	dev := strings.TrimSpace(a.mustExec(t, ctx, "root", `for b in /sys/block/vd*; do [ "$(cat $b/serial)" = `+rootDiskSerial+` ] && echo /dev/${b##*/}; done; true`))
	if !strings.HasPrefix(dev, "/dev/vd") {
		t.Fatalf("root disk device %q", dev)
	}
	if out := a.mustExec(t, ctx, "root", "cat /sys/block/"+dev[5:]+"/ro"); out != "1\n" {
		t.Errorf("%s ro = %q, want 1", dev, out)
	}
	write := "dd if=/dev/zero of=" + dev + " bs=4096 count=1 seek=8 conv=notrunc,fsync"
	if out, errOut, code := a.exec(t, ctx, "root", write); code == 0 {
		t.Errorf("writing %s succeeded: %q %q", dev, out, errOut)
	} else {
		t.Logf("write to %s refused by the guest kernel: %s", dev, strings.TrimSpace(errOut))
	}
	// Nor after root cleared the block device's read-only policy (the
	// disk stays read-only: virtio's RO feature, from QEMU's readonly=on
	// on a read-only descriptor).
	if out, errOut, code := a.exec(t, ctx, "root", "blockdev --setrw "+dev+"; "+write); code == 0 {
		t.Errorf("writing %s after blockdev --setrw succeeded: %q %q", dev, out, errOut)
	}

	// Writes go to the layer disk: they persist across Stop and Start on
	// the same directory (a cold boot: the layer is the sandbox's own).
	a.mustExec(t, ctx, "user", "echo kept > ~/new; echo changed > /tmp/x; sync")
	a.mustExec(t, ctx, "root", "echo rootwrite > /etc/shadowed; rm /opt/dir/c; sync")
	a.close()
	if err := inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(sp1.Dir, LayerDiskName)); err != nil {
		t.Fatalf("layer disk after Stop: %v", err)
	}
	t0 = time.Now()
	sp1b := sp1
	sp1b.Route.ActivationID = "i1b"
	inst, err = s.Start(ctx, sp1b)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Stop(context.Background())
	a = activate(t, ctx, inst, sp1b.Route)
	t.Logf("image VM restarted on its layer (cold boot) activated %s after Start began", time.Since(t0).Round(time.Millisecond))
	if out := a.mustExec(t, ctx, "user", "cat ~/new /etc/shadowed; ls /opt/dir | wc -l; [ -e /etc/gone ] || echo gone"); out != "kept\nrootwrite\n0\ngone\n" {
		t.Errorf("after restart: %q", out)
	}

	// A second VM of the same image, running at the same time: the same
	// cached disk (one file, opened by both QEMUs), its own layer.
	sp2 := spec("i2")
	inst2, err := s.Start(ctx, sp2)
	if err != nil {
		t.Fatal(err)
	}
	defer inst2.Stop(context.Background())
	a2 := activate(t, ctx, inst2, sp2.Route)
	checkImageFiles(t, ctx, a2)
	if out, _, _ := a2.exec(t, ctx, "user", "cat ~/new 2>&1"); strings.Contains(out, "kept") {
		t.Errorf("second VM sees the first one's layer: %q", out)
	}
	imgs, _ := filepath.Glob(filepath.Join(s.cfg.RootDiskDir, "*.img"))
	if len(imgs) != 1 {
		t.Errorf("root disk cache holds %v, want one image", imgs)
	}
	for _, in := range []substrate.Instance{inst, inst2} {
		if !qemuHasOpen(t, in.InitPID(), d.path) {
			t.Errorf("qemu %d does not hold %s open", in.InitPID(), d.path)
		}
	}

	// Save and restore the second VM elsewhere: its layer disk travels in
	// the state, with its memory (a process keeps running).
	bg := strings.TrimSpace(a2.mustExec(t, ctx, "user", `echo before-save > ~/saved; setsid sh -c 'while :; do sleep 1; done' </dev/null >/dev/null 2>&1 & echo $!`))
	if err := inst2.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	stPath := filepath.Join(base, "state")
	f, err := os.Create(stPath)
	if err != nil {
		t.Fatal(err)
	}
	t0 = time.Now()
	n, err := inst2.(substrate.StateSaver).SaveState(ctx, f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("SaveState of an image VM: %.1f MiB in %s", float64(n)/(1<<20), time.Since(t0).Round(time.Millisecond))
	a2.close()
	if err := inst2.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	sp3 := spec("i3")
	sp3.RestoreState = stPath
	t0 = time.Now()
	inst3, err := s.Start(ctx, sp3)
	if err != nil {
		t.Fatal(err)
	}
	defer inst3.Stop(context.Background())
	a3 := activate(t, ctx, inst3, sp3.Route)
	t.Logf("restored image VM activated %s after Start began", time.Since(t0).Round(time.Millisecond))
	if out := a3.mustExec(t, ctx, "user", "cat ~/saved /etc/shadowed; grep -q '^State:[[:space:]]*[RS]' /proc/"+bg+"/status && echo alive"); out != "before-save\nfrom-upper\nalive\n" {
		t.Errorf("after restore: %q", out)
	}
	a3.mustExec(t, ctx, "user", "echo after > ~/after; sync")

	// A worker restart: the restored VM is detached and adopted by a new
	// substrate, which learns its disks from the adoption state (refused
	// for a spec without the image or with another one).
	state := inst3.(substrate.Adoptable).AdoptState()
	inst3.(substrate.Adoptable).Detach()
	cfg2 := s.cfg
	cfg2.Accel = s.Accel()
	s2, err := New(cfg2)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	for name, bad := range map[string]*substrate.Image{"no image": nil, "another image": {ID: "sha256:other", Layers: img.Layers}} {
		sp := sp3
		sp.Image = bad
		if _, err := s2.Adopt(ctx, sp, state); !errors.Is(err, substrate.ErrNotAdoptable) {
			t.Errorf("adopt with %s: %v", name, err)
		}
	}
	adopted, err := s2.Adopt(ctx, sp3, state)
	if err != nil {
		t.Fatal(err)
	}
	defer adopted.Stop(context.Background())
	if out := a3.mustExec(t, ctx, "user", "cat ~/after"); out != "after\n" {
		t.Errorf("adopted VM: %q", out)
	}
	if st, err := adopted.(substrate.StatsReporter).Stats(ctx); err != nil || st.DiskTotal != lim.DiskBytes || st.DiskUsed <= 0 {
		t.Errorf("adopted VM's stats: disk %d of %d, %v", st.DiskUsed, st.DiskTotal, err)
	}
	if err := adopted.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	var saved bytes.Buffer
	if _, err := adopted.(substrate.StateSaver).SaveState(ctx, &saved); err != nil {
		t.Fatal(err)
	}
	if h, err := readHeader(&saved); err != nil || h.RootDisk == nil || h.RootDisk.SHA256 != d.SHA256 || h.Layer == nil || h.Layer.Size != lim.DiskBytes {
		t.Errorf("adopted VM's saved state header %+v, %v", h, err)
	}
	a3.close()
	if err := adopted.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	// Whatever the guests did, the cached image is the bytes it was built as.
	if sum := fileSHA256(t, d.path); sum != d.SHA256 {
		t.Errorf("root disk changed: sha256 %s, built as %s", sum, d.SHA256)
	}

	// A state of an image VM does not restore as a VM without one.
	sp4 := spec("i4")
	sp4.RestoreState, sp4.Image = stPath, nil
	if inst4, err := s.Start(ctx, sp4); err == nil {
		inst4.Stop(ctx)
		t.Error("an image VM's state restored without its image")
	}
}

// checkImageFiles checks, through the agent, that the guest's root is the
// test image (testImage) merged as overlayfs merges it.
func checkImageFiles(t *testing.T, ctx context.Context, a *agentSession) {
	t.Helper()
	cmds := []struct{ cmd, want string }{
		{"cat /etc/shadowed", "from-upper\n"},
		{"stat -c '%a %u:%g' / /tmp /root", "755 0:0\n1777 0:0\n700 0:0\n"},
		{"[ -e /etc/gone ] && echo present || echo hidden", "hidden\n"},
		{"ls /opt/dir", "c\n"},
		{"stat -c '%a %u:%g' /usr/bin/suid", "4755 0:0\n"},
		{"[ $(stat -c %i /usr/bin/hl1) = $(stat -c %i /usr/bin/hl2) ] && stat -c %h /usr/bin/hl1", "2\n"},
		{"stat -c '%a %u:%g' /home/user/secret; cat /home/user/secret", "640 1000:1000\nuser's\n"},
		{"readlink /usr/bin/link; readlink /bin/sh", "/etc/shadowed\nbusybox\n"},
		{"id -u; whoami", "1000\nuser\n"},
		{"awk '$2 == \"/\" {t = $3} END {print t}' /proc/mounts", "overlay\n"},
	}
	for _, c := range cmds {
		if out := a.mustExec(t, ctx, "user", c.cmd); out != c.want {
			t.Errorf("%s: %q, want %q", c.cmd, out, c.want)
		}
	}
}

// qemuHasOpen reports whether process pid has path open.
func qemuHasOpen(t *testing.T, pid int, path string) bool {
	t.Helper()
	var want unix.Stat_t
	if err := unix.Stat(path, &want); err != nil {
		t.Fatal(err)
	}
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, fd := range fds {
		var st unix.Stat_t
		if unix.Stat(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()), &st) == nil && st.Dev == want.Dev && st.Ino == want.Ino {
			return true
		}
	}
	return false
}

// TestRootDiskRejects: bad images are refused with a typed error before
// anything is built.
func TestRootDiskRejects(t *testing.T) {
	for name, img := range map[string]*substrate.Image{
		"no id":         {Layers: []string{"/x"}},
		"no layers":     {ID: "sha256:a"},
		"relative":      {ID: "sha256:a", Layers: []string{"x"}},
		"colon":         {ID: "sha256:a", Layers: []string{"/a:b"}},
		"comma":         {ID: "sha256:a", Layers: []string{"/a,upperdir=/x"}},
		"unclean":       {ID: "sha256:a", Layers: []string{"/a/../b"}},
		"nul in id":     {ID: "sha256:\x00", Layers: []string{"/a"}},
		"backslash":     {ID: "sha256:a", Layers: []string{`/a\:b`}},
		"too many":      {ID: "sha256:a", Layers: slices.Repeat([]string{"/a"}, 501)},
		"newline layer": {ID: "sha256:a", Layers: []string{"/a\nb"}},
	} {
		if _, err := rootDiskKey(img); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := rootDiskKey(&substrate.Image{ID: "sha256:a", Layers: []string{"/var/lib/space/layers/sha256-a"}}); err != nil {
		t.Errorf("a good image: %v", err)
	}
}

func fileSHA256(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// debianBase finds a Debian base rootfs that internal/baseimage left in
// the machine-wide cache (<cache>/<id>/image.json and rootfs/), or skips.
func debianBase(t *testing.T) *substrate.Image {
	t.Helper()
	metas, _ := filepath.Glob("/var/cache/space/images/*/image.json")
	for _, m := range metas {
		b, err := os.ReadFile(m)
		if err != nil {
			continue
		}
		var meta struct {
			ID string `json:"id"`
		}
		root := filepath.Join(filepath.Dir(m), "rootfs")
		if json.Unmarshal(b, &meta) != nil || meta.ID == "" {
			continue
		}
		if _, err := os.Lstat(filepath.Join(root, "usr/bin/python3")); err != nil {
			continue
		}
		return &substrate.Image{ID: meta.ID, Layers: []string{root}}
	}
	testenv.Skipf(t, "no Debian base rootfs with python3 under /var/cache/space/images (internal/baseimage builds one)")
	return nil
}

// TestDebianBaseVM boots the Debian base (when one was built on this
// host) and runs python3 in it. Its root disk goes to the machine-wide
// cache: built once, reused by later runs.
func TestDebianBaseVM(t *testing.T) {
	img := debianBase(t)
	testenv.RequireRoot(t, "the root disk cache is root's")
	s, agent, ctx := agentSubstrate(t)
	t0 := time.Now()
	if err := s.PrepareImage(img); err != nil {
		t.Fatal(err)
	}
	d, err := s.ensureRootDisk(img)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Debian base %s: root disk %s, %d MiB, ready in %s", img.ID, d.path, d.Size>>20, time.Since(t0).Round(time.Millisecond))
	s.cfg.NoTemplates = true // one VM: a template would only add a boot
	sp := substrate.Spec{Route: testRoute("deb1"), Template: "base", Dir: filepath.Join(t.TempDir(), "deb1"), AgentPath: agent, Image: img}
	t0 = time.Now()
	inst, err := s.Start(ctx, sp)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Stop(context.Background())
	a := activate(t, ctx, inst, sp.Route)
	t.Logf("Debian base VM activated %s after Start began (cold boot; %s)", time.Since(t0).Round(time.Millisecond), initReady(inst))
	if out := a.mustExec(t, ctx, "root", "python3 -c 'print(1)'"); out != "1\n" {
		t.Errorf("python3 printed %q", out)
	}
	if out := a.mustExec(t, ctx, "root", ". /etc/os-release; echo $ID; awk '$2 == \"/\" {t = $3} END {print t}' /proc/mounts"); out != "debian\noverlay\n" {
		t.Errorf("os-release and root: %q", out)
	}
	if out, _, code := a.exec(t, ctx, "user", "id -un; sudo -n id -u"); code == 0 {
		t.Logf("as user: %q", out)
	} else {
		t.Logf("the base has no working user/sudo (baseimage's part): %q", out)
	}
}

// initReady returns the init's lines from the console (the guest's
// uptime at its steps and when it handed over to the agent).
func initReady(inst substrate.Instance) string {
	b, _ := os.ReadFile(filepath.Join(inst.(*instance).dir, ConsoleLog))
	var lines []string
	for _, l := range strings.Split(string(b), "\n") {
		if i := strings.Index(l, "space-init: "); i >= 0 {
			lines = append(lines, strings.TrimSpace(l[i+len("space-init: "):]))
		}
	}
	if len(lines) == 0 {
		return "no init lines: a clone"
	}
	return strings.Join(lines, "; ")
}
