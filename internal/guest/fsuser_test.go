package guest

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	filesystempb "github.com/spacesbx/space/api/envd/filesystem"
	"github.com/spacesbx/space/internal/testenv"
)

// rootOnly makes the root home private (0700, as /root is) and puts a
// root-only file in it and one in the scratch dir; it returns both paths.
func (e *env) rootOnly() (inHome, outside string) {
	e.t.Helper()
	if err := os.Chmod(e.root, 0o700); err != nil {
		e.t.Fatal(err)
	}
	inHome = filepath.Join(e.root, "secret")
	outside = filepath.Join(e.dir, "secret")
	for _, p := range []string{inHome, outside} {
		if err := os.WriteFile(p, []byte("root only"), 0o600); err != nil {
			e.t.Fatal(err)
		}
	}
	return inHome, outside
}

func basic(user string) map[string]string {
	return map[string]string{"Authorization": "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"))}
}

func ownerOf(t *testing.T, p string) (uid, gid uint32) {
	t.Helper()
	st, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	return st.Sys().(*syscall.Stat_t).Uid, st.Sys().(*syscall.Stat_t).Gid
}

// TestFilesUserReadsRootOnlyFile: /files reads as the requested user (the
// default "user" when none is named), so the kernel refuses a root-only file
// with 403; root reads it.
func TestFilesUserReadsRootOnlyFile(t *testing.T) {
	e := newEnv(t)
	inHome, outside := e.rootOnly()
	for _, q := range []string{
		"path=" + url.QueryEscape(outside),
		"path=" + url.QueryEscape(outside) + "&username=user",
		"path=" + url.QueryEscape(inHome) + "&username=user", // no search permission on the home
	} {
		resp, body := e.get("/files?"+q, nil)
		if msg := assertJSONError(t, resp, body, 403); !strings.Contains(msg, "permission denied") {
			t.Fatalf("%s: message %q", q, msg)
		}
	}
	// Basic authorization names the user when the URL does not.
	resp, body := e.get("/files?path="+url.QueryEscape(outside), basic("user"))
	assertJSONError(t, resp, body, 403)
	for _, q := range []string{"path=" + url.QueryEscape(outside) + "&username=root", "path=secret&username=root"} {
		if resp, body := e.get("/files?"+q, nil); resp.StatusCode != 200 || string(body) != "root only" {
			t.Fatalf("root read %s: %d %q", q, resp.StatusCode, body)
		}
	}
	// A symlink of the user's to the file changes nothing: the kernel
	// checks the target as the user.
	if err := os.Symlink(outside, filepath.Join(e.home(), "link")); err != nil {
		t.Fatal(err)
	}
	resp, body = e.get("/files?path=link", nil)
	assertJSONError(t, resp, body, 403)
	// A missing file in a directory the user cannot search is 403, not 404:
	// the user may not learn what is there.
	resp, body = e.get("/files?path="+url.QueryEscape(filepath.Join(e.root, "nope")), nil)
	assertJSONError(t, resp, body, 403)
}

// TestFilesUserWritesRootDir: uploads (octet-stream and multipart) run as
// the user, so a root-owned directory refuses them with 403 and nothing is
// created there.
func TestFilesUserWritesRootDir(t *testing.T) {
	e := newEnv(t)
	target := filepath.Join(e.root, "x") // root's home: 0755, root-owned
	resp, body := e.post("/files?path="+url.QueryEscape(target), "application/octet-stream", []byte("x"), nil)
	if msg := assertJSONError(t, resp, body, 403); !strings.Contains(msg, "permission denied") {
		t.Fatalf("message %q", msg)
	}
	ct, mp := multipartBody(t, map[string]string{target: "x"})
	resp, body = e.post("/files?username=user", ct, mp, nil)
	assertJSONError(t, resp, body, 403)
	// Parent directories are created as the user too.
	resp, body = e.post("/files?path="+url.QueryEscape(filepath.Join(e.root, "a/b/c")), "application/octet-stream", []byte("x"), nil)
	assertJSONError(t, resp, body, 403)
	if ents, _ := os.ReadDir(e.root); len(ents) != 0 {
		t.Fatalf("user created %v in root's home", ents)
	}
	// An existing root-owned file the user may not write is refused as
	// well, even where the user could write the directory.
	own := filepath.Join(e.home(), "roots.txt")
	if err := os.WriteFile(own, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(e.root, 0o700); err != nil {
		t.Fatal(err)
	}
	resp, body = e.post("/files?path="+url.QueryEscape(filepath.Join(e.root, "y")), "application/octet-stream", []byte("x"), nil)
	assertJSONError(t, resp, body, 403)
	// Root writes there.
	if resp, body := e.post("/files?username=root&path="+url.QueryEscape(target), "application/octet-stream", []byte("r"), nil); resp.StatusCode != 200 {
		t.Fatalf("root upload %d %s", resp.StatusCode, body)
	}
	if uid, _ := ownerOf(t, target); uid != 0 {
		t.Fatalf("root's file owned by %d", uid)
	}
}

// TestFilesWrittenAsUserOwnedByUser: what an upload or MakeDir creates
// belongs to the user (uid and gid 1000), replacing a root-owned file in the
// user's directory included; a file the user may write in a directory they
// may not is rewritten in place and keeps its owner.
func TestFilesWrittenAsUserOwnedByUser(t *testing.T) {
	e := newEnv(t)
	resp, body := e.post("/files?path="+url.QueryEscape("n1/n2/f.txt"), "application/octet-stream", []byte("mine"), nil)
	if resp.StatusCode != 200 {
		t.Fatalf("upload %d %s", resp.StatusCode, body)
	}
	for _, p := range []string{"n1", "n1/n2", "n1/n2/f.txt"} {
		if uid, gid := ownerOf(t, filepath.Join(e.home(), p)); uid != 1000 || gid != 1000 {
			t.Fatalf("%s owned by %d:%d", p, uid, gid)
		}
	}
	roots := filepath.Join(e.home(), "roots.txt")
	if err := os.WriteFile(roots, []byte("old"), 0o666); err != nil {
		t.Fatal(err)
	}
	if resp, body := e.post("/files?path=roots.txt", "application/octet-stream", []byte("new"), nil); resp.StatusCode != 200 {
		t.Fatalf("replace %d %s", resp.StatusCode, body)
	}
	if uid, _ := ownerOf(t, roots); uid != 1000 {
		t.Fatalf("replaced file owned by %d", uid)
	}
	mk, err := e.fs.MakeDir(ctxT(t), connect.NewRequest(&filesystempb.MakeDirRequest{Path: "m1/m2"}))
	if err != nil || mk.Msg.GetEntry().GetOwner() != "user" || mk.Msg.GetEntry().GetGroup() != "user" {
		t.Fatalf("makedir %v %v", mk, err)
	}
	if uid, gid := ownerOf(t, filepath.Join(e.home(), "m1")); uid != 1000 || gid != 1000 {
		t.Fatalf("m1 owned by %d:%d", uid, gid)
	}
	// World-writable file in root's (0755) directory: written in place.
	shared := filepath.Join(e.root, "shared")
	if err := os.WriteFile(shared, []byte("old"), 0o666); err != nil {
		t.Fatal(err)
	}
	_ = os.Chmod(shared, 0o666) // past the umask
	if resp, body := e.post("/files?path="+url.QueryEscape(shared), "application/octet-stream", []byte("new"), nil); resp.StatusCode != 200 {
		t.Fatalf("in-place %d %s", resp.StatusCode, body)
	}
	if b, _ := os.ReadFile(shared); string(b) != "new" {
		t.Fatalf("in-place content %q", b)
	}
	if uid, _ := ownerOf(t, shared); uid != 0 {
		t.Fatalf("in-place file owned by %d", uid)
	}
}

// TestFilesystemRPCsAsUser: every filesystem.Filesystem RPC runs as the
// caller, so root's private things answer permission_denied to "user".
func TestFilesystemRPCsAsUser(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	inHome, outside := e.rootOnly()
	want := func(what string, err error) {
		t.Helper()
		if codeOf(err) != connect.CodePermissionDenied {
			t.Fatalf("%s: %v, want permission_denied", what, err)
		}
	}
	_, err := e.fs.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: inHome}))
	want("stat in root's home", err)
	_, err = e.fs.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: e.root}))
	want("listdir root's home", err)
	_, err = e.fs.MakeDir(ctx, connect.NewRequest(&filesystempb.MakeDirRequest{Path: filepath.Join(e.dir, "d")}))
	want("makedir in root's dir", err)
	_, err = e.fs.Move(ctx, connect.NewRequest(&filesystempb.MoveRequest{Source: outside, Destination: "stolen"}))
	want("move root's file", err)
	_, err = e.fs.Remove(ctx, connect.NewRequest(&filesystempb.RemoveRequest{Path: outside}))
	want("remove root's file", err)
	if _, err := os.Stat(outside); err != nil {
		t.Fatalf("root's file gone: %v", err)
	}
	ws, err := e.fs.WatchDir(ctx, connect.NewRequest(&filesystempb.WatchDirRequest{Path: e.root}))
	if err == nil {
		for ws.Receive() {
		}
		err = ws.Err()
		ws.Close()
	}
	want("watch root's home", err)
	_, err = e.fs.CreateWatcher(ctx, connect.NewRequest(&filesystempb.CreateWatcherRequest{Path: e.root}))
	want("watcher on root's home", err)
	// The same as root works.
	if _, err := e.fs.Stat(ctx, asUser(connect.NewRequest(&filesystempb.StatRequest{Path: inHome}), "root")); err != nil {
		t.Fatal(err)
	}
	if _, err := e.fs.Remove(ctx, asUser(connect.NewRequest(&filesystempb.RemoveRequest{Path: outside}), "root")); err != nil {
		t.Fatal(err)
	}
	// A recursive watch skips what the user cannot read; an entry the
	// user cannot stat comes without info.
	if err := mkdirAs(e.home()+"/w", 1000); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(e.home()+"/w/private", 0o700); err != nil {
		t.Fatal(err)
	}
	ls, err := e.fs.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: "w", Depth: 3}))
	if err != nil || len(ls.Msg.GetEntries()) != 1 {
		t.Fatalf("listdir with a private subdir: %v %v", ls, err)
	}
}

// TestSignedURLPinsUser: a signed /files URL acts as the user its signature
// covers (the username parameter, else the default user); Basic
// authorization naming another user is refused with 401, so it cannot
// widen the URL to root's home.
func TestSignedURLPinsUser(t *testing.T) {
	e := newEnv(t)
	inHome, _ := e.rootOnly()
	sig := "&signature=v1_abc&signature_expiration=1900000000"
	// Signed for the default user, Basic root: -> 401, not root's file.
	for _, q := range []string{"path=secret", "path=" + url.QueryEscape(inHome)} {
		resp, body := e.get("/files?"+q+sig, basic("root"))
		if msg := assertJSONError(t, resp, body, 401); !strings.Contains(msg, "signed for user 'user'") {
			t.Fatalf("message %q", msg)
		}
	}
	resp, body := e.post("/files?path=secret"+sig, "application/octet-stream", []byte("x"), basic("root"))
	assertJSONError(t, resp, body, 401)
	// Signed for user, with or without a matching Basic user: user's
	// permissions (root's file is refused, relative paths are the user's).
	resp, body = e.get("/files?path="+url.QueryEscape(inHome)+sig, nil)
	assertJSONError(t, resp, body, 403)
	resp, body = e.get("/files?path="+url.QueryEscape(inHome)+"&username=user"+sig, basic("user"))
	assertJSONError(t, resp, body, 403)
	resp, body = e.get("/files?path=secret"+sig, nil)
	if msg := assertJSONError(t, resp, body, 404); !strings.Contains(msg, e.home()) {
		t.Fatalf("resolved against another home: %q", msg)
	}
	// A second username (or path) the signature may not cover: 401.
	resp, body = e.get("/files?path=secret&username=user&username=root"+sig, nil)
	assertJSONError(t, resp, body, 401)
	resp, body = e.get("/files?path=secret&path="+url.QueryEscape(inHome)+sig, nil)
	assertJSONError(t, resp, body, 401)
	// Signed for root: root's file.
	if resp, body := e.get("/files?path=secret&username=root"+sig, basic("root")); resp.StatusCode != 200 || string(body) != "root only" {
		t.Fatalf("signed for root: %d %q", resp.StatusCode, body)
	}
	// Unsigned requests keep envd's precedence: username, then Basic.
	if resp, body := e.get("/files?path=secret", basic("root")); resp.StatusCode != 200 || string(body) != "root only" {
		t.Fatalf("unsigned Basic root: %d %q", resp.StatusCode, body)
	}
}

// TestFilesReadOnlyAndFullFS: EROFS is 403 (permission_denied) and ENOSPC
// is 507 (resource_exhausted) with JSON bodies, never 500. The file systems
// are tmpfs mounts in a private mount namespace: the test re-executes
// itself in one.
func TestFilesReadOnlyAndFullFS(t *testing.T) {
	testenv.RequireRoot(t, "runs processes as other users")
	if os.Getenv("GUEST_TEST_MOUNTNS") == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestFilesReadOnlyAndFullFS$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), "GUEST_TEST_MOUNTNS=1")
		cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
		out, err := cmd.CombinedOutput()
		if bytes.Contains(out, []byte("--- SKIP")) {
			testenv.Skipf(t, "in a mount namespace: %s", out)
		}
		if err != nil || !bytes.Contains(out, []byte("--- PASS: TestFilesReadOnlyAndFullFS")) {
			t.Fatalf("in a mount namespace: %v\n%s", err, out)
		}
		return
	}
	e := newEnv(t)
	ctx := ctxT(t)
	ro := filepath.Join(e.home(), "ro")
	full := filepath.Join(e.home(), "full")
	for _, d := range []string{ro, full} {
		if err := mkdirAs(d, 1000); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Mount("tmpfs", ro, "tmpfs", 0, "mode=0777"); err != nil {
		testenv.Skipf(t, "cannot mount tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(ro, unix.MNT_DETACH) })
	writeFile(t, filepath.Join(ro, "f"), "x")
	_ = os.Chown(filepath.Join(ro, "f"), 1000, 1000)
	if err := unix.Mount("tmpfs", ro, "tmpfs", unix.MS_REMOUNT|unix.MS_RDONLY, "mode=0777"); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", full, "tmpfs", 0, "size=64k,mode=0777"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(full, unix.MNT_DETACH) })

	for _, user := range []string{"user", "root"} {
		for _, p := range []string{"ro/f", "ro/new", "ro/d/new"} {
			resp, body := e.post("/files?username="+user+"&path="+url.QueryEscape(filepath.Join(e.home(), p)), "application/octet-stream", []byte("x"), nil)
			if msg := assertJSONError(t, resp, body, 403); !strings.Contains(msg, "read-only file system") {
				t.Fatalf("%s %s: message %q", user, p, msg)
			}
		}
		ct, mp := multipartBody(t, map[string]string{filepath.Join(ro, "m"): "x"})
		resp, body := e.post("/files?username="+user, ct, mp, nil)
		assertJSONError(t, resp, body, 403)
		for what, err := range map[string]error{
			"makedir": func() error {
				_, err := e.fs.MakeDir(ctx, asUser(connect.NewRequest(&filesystempb.MakeDirRequest{Path: filepath.Join(ro, "d")}), user))
				return err
			}(),
			"remove": func() error {
				_, err := e.fs.Remove(ctx, asUser(connect.NewRequest(&filesystempb.RemoveRequest{Path: filepath.Join(ro, "f")}), user))
				return err
			}(),
			"move": func() error {
				_, err := e.fs.Move(ctx, asUser(connect.NewRequest(&filesystempb.MoveRequest{Source: filepath.Join(ro, "f"), Destination: filepath.Join(ro, "g")}), user))
				return err
			}(),
		} {
			if codeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "read-only file system") {
				t.Fatalf("%s %s on a read-only fs: %v", user, what, err)
			}
		}
	}
	// Full: 507 with envd's message, and no temp file left behind.
	resp, body := e.post("/files?path=full/big", "application/octet-stream", make([]byte, 512<<10), nil)
	if msg := assertJSONError(t, resp, body, 507); msg != "not enough disk space available" {
		t.Fatalf("message %q", msg)
	}
	if ents, _ := os.ReadDir(full); len(ents) != 0 {
		t.Fatalf("left behind: %v", ents)
	}
}

// threadStatus returns the credential lines of every thread of the process
// (/proc/self/task/*/status), keyed by tid.
func threadStatus(t *testing.T) map[string]string {
	t.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, task := range tasks {
		f, err := os.Open(filepath.Join("/proc/self/task", task.Name(), "status"))
		if errors.Is(err, fs.ErrNotExist) {
			continue // the thread exited meanwhile
		}
		if err != nil {
			t.Fatal(err)
		}
		var lines []string
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			for _, k := range []string{"Uid:", "Gid:", "Groups:", "CapEff:", "CapPrm:"} {
				if strings.HasPrefix(sc.Text(), k) {
					lines = append(lines, strings.Join(strings.Fields(sc.Text()), " "))
				}
			}
		}
		_ = f.Close()
		out[task.Name()] = strings.Join(lines, "; ")
	}
	return out
}

// TestRunAsLeavesNoThreadSwitched: many concurrent file operations as user
// and root (run it with -race), then every thread of the process has the
// agent's credentials again, no thread was lost, and root still reads a
// root-only file on whatever thread serves it.
func TestRunAsLeavesNoThreadSwitched(t *testing.T) {
	e := newEnv(t)
	inHome, outside := e.rootOnly()
	ctx := ctxT(t)
	before := fsThreadsLost.Load()
	n := 4 * runtime.GOMAXPROCS(0)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			for j := range 20 {
				var err error
				switch j % 5 {
				case 0:
					if resp, _ := e.get("/files?path="+url.QueryEscape(outside), nil); resp.StatusCode != 403 {
						err = fmt.Errorf("user read: %d", resp.StatusCode)
					}
				case 1:
					p := fmt.Sprintf("c/%d/%d", i, j)
					if resp, b := e.post("/files?path="+p, "application/octet-stream", []byte("x"), nil); resp.StatusCode != 200 {
						err = fmt.Errorf("user write: %d %s", resp.StatusCode, b)
					}
				case 2:
					if resp, b := e.get("/files?username=root&path="+url.QueryEscape(inHome), nil); resp.StatusCode != 200 || string(b) != "root only" {
						err = fmt.Errorf("root read: %d", resp.StatusCode)
					}
				case 3:
					if _, e2 := e.fs.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: "c"})); e2 != nil {
						err = fmt.Errorf("listdir: %w", e2)
					}
				case 4:
					if _, e2 := e.fs.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: inHome})); codeOf(e2) != connect.CodePermissionDenied {
						err = fmt.Errorf("user stat: %v", e2)
					}
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if lost := fsThreadsLost.Load() - before; lost != 0 {
		t.Fatalf("%d threads could not be restored", lost)
	}
	base, err := agentCreds()
	if err != nil {
		t.Fatal(err)
	}
	if base.fsuid != 0 {
		t.Fatalf("agent fsuid %d", base.fsuid)
	}
	// Every thread: real, effective, saved and fs uid/gid 0, the agent's
	// groups and capabilities.
	var want string
	for tid, st := range threadStatus(t) {
		if !strings.Contains(st, "Uid: 0 0 0 0") || !strings.Contains(st, "Gid: 0 0 0 0") {
			t.Fatalf("thread %s: %s", tid, st)
		}
		if want == "" {
			want = st
		}
		if st != want {
			t.Fatalf("thread %s has %q, another %q", tid, st, want)
		}
	}
	// Root reads from as many threads as the runtime will use at once.
	var rg sync.WaitGroup
	for range n {
		rg.Go(func() {
			runtime.LockOSThread() // spread the direct reads over threads
			defer runtime.UnlockOSThread()
			if b, err := os.ReadFile(inHome); err != nil || string(b) != "root only" {
				t.Errorf("root read on a thread: %v", err)
			}
			if resp, b := e.get("/files?username=root&path=secret", nil); resp.StatusCode != 200 || string(b) != "root only" {
				t.Errorf("root download: %d", resp.StatusCode)
			}
		})
	}
	rg.Wait()
}

// TestRunAsPanicRestores: a panic in the function reaches the caller and
// the thread is restored first.
func TestRunAsPanicRestores(t *testing.T) {
	testenv.RequireRoot(t, "runs processes as other users")
	before := fsThreadsLost.Load()
	user := &account{Name: "user", UID: 1000, GID: 1000, Groups: []uint32{1000, 1500}}
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Fatalf("recovered %v", r)
			}
		}()
		_ = runAs(user, func() error {
			c, err := currentThreadCreds()
			if err != nil || c.fsuid != 1000 || c.fsgid != 1000 || fmt.Sprint(c.groups) != "[1000 1500]" ||
				c.caps[0].Effective != 0 || c.caps[1].Effective != 0 {
				t.Errorf("inside runAs: %+v %v", c, err)
			}
			panic("boom")
		})
	}()
	if fsThreadsLost.Load() != before {
		t.Fatal("thread lost")
	}
	for tid, st := range threadStatus(t) {
		if !strings.Contains(st, "Uid: 0 0 0 0") {
			t.Fatalf("thread %s: %s", tid, st)
		}
	}
}

// TestFilesAgentProcFiles: the agent's own /proc/<pid> files that the mode
// bits leave readable (maps) are refused to a user, whose own processes may
// not read them either; other /proc files and root are unaffected.
func TestFilesAgentProcFiles(t *testing.T) {
	e := newEnv(t)
	if _, err := os.Stat("/proc/self/maps"); err != nil {
		testenv.Skipf(t, "no procfs: %v", err)
	}
	pid := strconv.Itoa(os.Getpid())
	tid := strconv.Itoa(unix.Gettid())
	for _, p := range []string{"/proc/self/maps", "/proc/" + pid + "/smaps", "/proc/" + pid + "/task/" + tid + "/maps", "/proc/" + tid + "/maps", "/proc/self/environ"} {
		resp, body := e.get("/files?path="+url.QueryEscape(p), nil)
		assertJSONError(t, resp, body, 403)
		if resp, _ := e.get("/files?username=root&path="+url.QueryEscape(p), nil); resp.StatusCode != 200 {
			t.Fatalf("root %s: %d", p, resp.StatusCode)
		}
	}
	if resp, body := e.get("/files?path=/proc/self/cmdline", nil); resp.StatusCode != 403 {
		t.Fatalf("user /proc/self/cmdline: %d %q", resp.StatusCode, body)
	}
	if resp, body := e.get("/files?path=/proc/version", nil); resp.StatusCode != 200 || len(body) == 0 {
		t.Fatalf("user /proc/version: %d %q", resp.StatusCode, body)
	}
}

// TestRunAsKillsUnrestorableThread: when the thread's credentials cannot
// be restored (here fn drops a capability from the thread's permitted set,
// which nothing can raise again), the thread is not handed back to the
// scheduler: it exits with its goroutine (the main thread, which the
// runtime cannot exit, is parked for good instead), and every thread left
// running has the agent's capabilities. It runs in a child process: a
// parked main thread would stay in this one.
func TestRunAsKillsUnrestorableThread(t *testing.T) {
	testenv.RequireRoot(t, "runs processes as other users")
	if os.Getenv("GUEST_TEST_UNRESTORABLE") == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestRunAsKillsUnrestorableThread$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), "GUEST_TEST_UNRESTORABLE=1")
		out, err := cmd.CombinedOutput()
		if bytes.Contains(out, []byte("--- SKIP")) {
			testenv.Skipf(t, "child: %s", out)
		}
		if err != nil || !bytes.Contains(out, []byte("--- PASS: TestRunAsKillsUnrestorableThread")) {
			t.Fatalf("child: %v\n%s", err, out)
		}
		return
	}
	base, err := agentCreds()
	if err != nil {
		t.Fatal(err)
	}
	if base.caps[0].Permitted&(1<<unix.CAP_KILL) == 0 {
		testenv.Skipf(t, "agent lacks CAP_KILL")
	}
	before := fsThreadsLost.Load()
	user := &account{Name: "user", UID: 1000, GID: 1000, Groups: []uint32{1000}}
	damage := func() int {
		var tid int
		err := runAs(user, func() error {
			tid = unix.Gettid()
			var c [2]unix.CapUserData
			if err := capget(&c); err != nil {
				return err
			}
			c[0].Permitted &^= 1 << unix.CAP_KILL
			c[0].Effective &^= 1 << unix.CAP_KILL
			c[0].Inheritable &^= 1 << unix.CAP_KILL
			return capset(&c)
		})
		if err != nil {
			t.Fatal(err)
		}
		return tid
	}
	tid := damage()
	mainParked := tid == os.Getpid()
	if mainParked {
		tid = damage() // the main thread is parked now: another one
	}
	if lost := fsThreadsLost.Load() - before; (!mainParked && lost != 1) || (mainParked && lost != 2) {
		t.Fatalf("threads lost %d (main thread parked: %v)", lost, mainParked)
	}
	eventually(t, "the damaged thread to exit", func() bool {
		_, err := os.Stat("/proc/self/task/" + strconv.Itoa(tid))
		return errors.Is(err, fs.ErrNotExist)
	})
	want := fmt.Sprintf("CapPrm: %08x%08x", base.caps[1].Permitted, base.caps[0].Permitted)
	for id, st := range threadStatus(t) {
		if mainParked && id == strconv.Itoa(os.Getpid()) {
			continue
		}
		if !strings.Contains(st, want) {
			t.Fatalf("thread %s: %s, want %s", id, st, want)
		}
	}
	// The process still works: more operations as the user and as root.
	for range 20 {
		if err := runAs(user, func() error { return nil }); err != nil {
			t.Fatal(err)
		}
	}
	if fsThreadsLost.Load()-before > 2 {
		t.Fatal("a healthy operation lost its thread")
	}
}
