package guest

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"errors"
	"io"
	"mime/multipart"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	filesystempb "github.com/spacesbx/space/api/envd/filesystem"
)

func TestHealthIdentityAndUnknownRoute(t *testing.T) {
	e := newEnv(t)
	resp, _ := e.get("/health", nil)
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("health %d", resp.StatusCode)
	}
	resp, body := e.get("/_space/identity", nil)
	var id Identity
	if resp.StatusCode != 200 || json.Unmarshal(body, &id) != nil || id != e.srv.cfg.Identity {
		t.Fatalf("identity %d %s", resp.StatusCode, body)
	}
	if strings.Contains(string(body), "pod_uid") || !strings.Contains(string(body), `"generation":3`) {
		t.Fatalf("identity json %s", body)
	}
	resp, body = e.get("/nope", nil)
	assertJSONError(t, resp, body, 404)
}

func assertJSONError(t *testing.T, resp *http.Response, body []byte, status int) string {
	t.Helper()
	var ee struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if resp.StatusCode != status || json.Unmarshal(body, &ee) != nil || ee.Code != status || ee.Message == "" ||
		resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("want JSON error %d, got %d %q", status, resp.StatusCode, body)
	}
	return ee.Message
}

func multipartBody(t *testing.T, files map[string]string) (string, []byte) {
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	for name, content := range files {
		w, err := mw.CreateFormFile("file", name)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = w.Write([]byte(content))
	}
	_ = mw.Close()
	return mw.FormDataContentType(), buf.Bytes()
}

func TestFilesUploadDownload(t *testing.T) {
	e := newEnv(t)
	// Multipart with the full path as filename (SDK writeFiles), relative to home.
	ct, body := multipartBody(t, map[string]string{"a/b/one.txt": "one", "/tmp/" + filepath.Base(e.dir) + "-two.txt": "two"})
	t.Cleanup(func() { _ = os.Remove("/tmp/" + filepath.Base(e.dir) + "-two.txt") })
	resp, out := e.post("/files", ct, body, nil)
	if resp.StatusCode != 200 {
		t.Fatalf("upload %d %s", resp.StatusCode, out)
	}
	var entries []fileEntry
	if err := json.Unmarshal(out, &entries); err != nil || len(entries) != 2 {
		t.Fatalf("entries %s", out)
	}
	one := filepath.Join(e.home(), "a/b/one.txt")
	found := false
	for _, en := range entries {
		if en.Path == one && en.Name == "one.txt" && en.Type == "file" {
			found = true
		}
	}
	if !found {
		t.Fatalf("entries %s", out)
	}
	for _, p := range []string{one, filepath.Dir(one), filepath.Dir(filepath.Dir(one))} {
		st, err := os.Stat(p)
		if err != nil || st.Sys().(*syscall.Stat_t).Uid != 1000 {
			t.Fatalf("%s not owned by user: %v", p, err)
		}
	}
	// Download it back (username param, ~ path).
	resp, got := e.get("/files?path="+url.QueryEscape("~/a/b/one.txt")+"&username=user", nil)
	if resp.StatusCode != 200 || string(got) != "one" || !strings.Contains(resp.Header.Get("Content-Disposition"), `filename=one.txt`) ||
		!strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain") {
		t.Fatalf("download %d %q %v", resp.StatusCode, got, resp.Header)
	}
	// Octet-stream with path param, gzip-encoded, with metadata, as root.
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, _ = zw.Write([]byte("binary\x00data"))
	_ = zw.Close()
	rootFile := filepath.Join(e.root, "bin.dat")
	resp, out = e.post("/files?username=root&path="+url.QueryEscape(rootFile), "application/octet-stream", gz.Bytes(),
		map[string]string{"Content-Encoding": "gzip", "X-Metadata-Owner-Team": "infra"})
	if resp.StatusCode != 200 {
		t.Fatalf("octet upload %d %s", resp.StatusCode, out)
	}
	entries = nil
	_ = json.Unmarshal(out, &entries)
	if len(entries) != 1 || entries[0].Path != rootFile || entries[0].Metadata["owner-team"] != "infra" {
		t.Fatalf("octet entries %s", out)
	}
	if b, _ := os.ReadFile(rootFile); string(b) != "binary\x00data" {
		t.Fatalf("content %q", b)
	}
	// Metadata readable through Stat (if the filesystem supports user xattrs).
	st, err := e.fs.Stat(ctxT(t), asUser(connect.NewRequest(&filesystempb.StatRequest{Path: rootFile}), "root"))
	if err != nil {
		t.Fatal(err)
	}
	if md := st.Msg.GetEntry().GetMetadata(); md["owner-team"] != "infra" {
		t.Fatalf("metadata %v", md)
	}
	// Gzip download.
	req, _ := http.NewRequest("GET", e.base+"/files?username=root&path="+url.QueryEscape(rootFile), nil)
	req.Header.Set("Accept-Encoding", "gzip")
	r2, err := e.http.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	zr, err := gzip.NewReader(r2.Body)
	if err != nil || r2.Header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("gzip download: %v %v", err, r2.Header)
	}
	b, _ := io.ReadAll(zr)
	r2.Body.Close()
	if string(b) != "binary\x00data" {
		t.Fatalf("gzip content %q", b)
	}
	// Overwrite keeps the file's mode.
	_ = os.Chmod(rootFile, 0o600)
	resp, _ = e.post("/files?username=root&path="+url.QueryEscape(rootFile), "application/octet-stream", []byte("v2"), nil)
	if fi, _ := os.Stat(rootFile); resp.StatusCode != 200 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("overwrite %d mode %v", resp.StatusCode, fi.Mode())
	}
}

func TestFilesErrors(t *testing.T) {
	e := newEnv(t)
	resp, body := e.get("/files?path=missing.txt", nil)
	if msg := assertJSONError(t, resp, body, 404); msg != "path '"+e.home()+"/missing.txt' does not exist" {
		t.Fatalf("message %q", msg)
	}
	resp, body = e.get("/files?path="+url.QueryEscape(e.home()), nil)
	if msg := assertJSONError(t, resp, body, 400); !strings.Contains(msg, "is a directory") {
		t.Fatalf("message %q", msg)
	}
	resp, body = e.get("/files?path=x&username=ghost", nil)
	assertJSONError(t, resp, body, 401)
	resp, body = e.get("/files?path=a%00b", nil)
	assertJSONError(t, resp, body, 400)
	resp, body = e.get("/files?path=x", map[string]string{"Accept-Encoding": "br, identity;q=0"})
	assertJSONError(t, resp, body, 406)
	resp, body = e.post("/files", "application/octet-stream", []byte("x"), nil)
	assertJSONError(t, resp, body, 400) // path required
	resp, body = e.post("/files?path="+url.QueryEscape(e.home()), "application/octet-stream", []byte("x"), nil)
	assertJSONError(t, resp, body, 400) // is a directory
	resp, body = e.post("/files?path=x", "text/plain", []byte("x"), nil)
	assertJSONError(t, resp, body, 400)
	resp, body = e.post("/files", "multipart/form-data; boundary=zzz", []byte("garbage"), nil)
	assertJSONError(t, resp, body, 400)
	resp, body = e.post("/files?path=x", "application/octet-stream", []byte("x"), map[string]string{"Content-Encoding": "gzip"})
	assertJSONError(t, resp, body, 400)
	resp, body = e.post("/files?path=x", "application/octet-stream", []byte("x"), map[string]string{"X-Metadata-K": "\u00e9"})
	assertJSONError(t, resp, body, 400)
	resp, body = e.post("/files?path=big", "application/octet-stream", make([]byte, 2<<20), nil)
	assertJSONError(t, resp, body, 413)
	if _, err := os.Stat(filepath.Join(e.home(), "big")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("oversized upload left a file: %v", err)
	}
	if m, _ := filepath.Glob(filepath.Join(e.home(), ".big.upload-*")); len(m) != 0 {
		t.Fatalf("temp files left: %v", m)
	}
}

func TestFilesystemRPCs(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	// MakeDir (nested), then again -> AlreadyExists.
	mk, err := e.fs.MakeDir(ctx, connect.NewRequest(&filesystempb.MakeDirRequest{Path: "d1/d2/d3"}))
	if err != nil {
		t.Fatal(err)
	}
	if mk.Msg.GetEntry().GetType() != filesystempb.FileType_FILE_TYPE_DIRECTORY || mk.Msg.GetEntry().GetOwner() != "user" || mk.Msg.GetEntry().GetPath() != e.home()+"/d1/d2/d3" {
		t.Fatalf("makedir entry %v", mk.Msg.GetEntry())
	}
	if _, err := e.fs.MakeDir(ctx, connect.NewRequest(&filesystempb.MakeDirRequest{Path: "d1"})); codeOf(err) != connect.CodeAlreadyExists {
		t.Fatalf("makedir existing: %v", err)
	}
	writeFile(t, e.home()+"/d1/f.txt", "12345")
	writeFile(t, e.home()+"/d1/d2/g.txt", "x")
	_ = os.Symlink("f.txt", e.home()+"/d1/link")
	// Stat.
	st, err := e.fs.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: "~/d1/f.txt"}))
	if err != nil {
		t.Fatal(err)
	}
	en := st.Msg.GetEntry()
	if en.GetName() != "f.txt" || en.GetSize() != 5 || en.GetType() != filesystempb.FileType_FILE_TYPE_FILE || en.GetMode() != 0o644 ||
		en.GetPermissions() != "-rw-r--r--" || en.GetOwner() != "root" || en.GetGroup() != "root" || time.Since(en.GetModifiedTime().AsTime()) > time.Minute {
		t.Fatalf("stat %v", en)
	}
	st, err = e.fs.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: "d1/link"}))
	if err != nil || st.Msg.GetEntry().GetType() != filesystempb.FileType_FILE_TYPE_SYMLINK || st.Msg.GetEntry().GetSymlinkTarget() != e.home()+"/d1/f.txt" {
		t.Fatalf("stat link %v %v", st, err)
	}
	if _, err := e.fs.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: "nope"})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("stat missing: %v", err)
	}
	if _, err := e.fs.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: "a\x00"})); codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("stat NUL: %v", err)
	}
	if _, err := e.fs.Stat(ctx, asUser(connect.NewRequest(&filesystempb.StatRequest{Path: "x"}), "ghost")); codeOf(err) != connect.CodeUnauthenticated {
		t.Fatalf("stat ghost: %v", err)
	}
	// ListDir depth 1 and 3.
	names := func(depth uint32) []string {
		t.Helper()
		ls, err := e.fs.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: "d1", Depth: depth}))
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, en := range ls.Msg.GetEntries() {
			out = append(out, strings.TrimPrefix(en.GetPath(), e.home()+"/d1/"))
		}
		return out
	}
	if got := strings.Join(names(1), ","); got != "d2,f.txt,link" {
		t.Fatalf("depth 1: %s", got)
	}
	if got := strings.Join(names(3), ","); got != "d2,d2/d3,d2/g.txt,f.txt,link" {
		t.Fatalf("depth 3: %s", got)
	}
	if _, err := e.fs.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: "d1/f.txt"})); codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("listdir file: %v", err)
	}
	if _, err := e.fs.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: "nope"})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("listdir missing: %v", err)
	}
	// Move into a new directory.
	mv, err := e.fs.Move(ctx, connect.NewRequest(&filesystempb.MoveRequest{Source: "d1/f.txt", Destination: "moved/f2.txt"}))
	if err != nil || mv.Msg.GetEntry().GetPath() != e.home()+"/moved/f2.txt" {
		t.Fatalf("move %v %v", mv, err)
	}
	if _, err := e.fs.Move(ctx, connect.NewRequest(&filesystempb.MoveRequest{Source: "d1/f.txt", Destination: "x"})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("move missing: %v", err)
	}
	// Remove.
	if _, err := e.fs.Remove(ctx, connect.NewRequest(&filesystempb.RemoveRequest{Path: "d1"})); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(e.home() + "/d1"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("not removed: %v", err)
	}
}

func TestWatchDirRecursive(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	// w is the user's: the uploads below write into it as the user.
	if err := mkdirAs(e.home()+"/w/sub", 1000); err != nil || os.Chown(e.home()+"/w", 1000, 1000) != nil {
		t.Fatal(err)
	}
	req := connect.NewRequest(&filesystempb.WatchDirRequest{Path: "w", Recursive: true, IncludeEntry: true})
	req.Header().Set("Keepalive-Ping-Interval", "50")
	st, err := e.fs.WatchDir(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if !st.Receive() || st.Msg().GetStart() == nil {
		t.Fatalf("no start event: %v", st.Err())
	}
	want := map[string]bool{"create sub/a.txt": false, "write sub/a.txt": false, "create new": false, "create new/b.txt": false, "remove sub/a.txt": false}
	types := map[filesystempb.EventType]string{filesystempb.EventType_EVENT_TYPE_CREATE: "create", filesystempb.EventType_EVENT_TYPE_WRITE: "write", filesystempb.EventType_EVENT_TYPE_REMOVE: "remove"}
	// receive marks wanted events until until has been seen.
	receive := func(until string) {
		t.Helper()
		for !want[until] && st.Receive() {
			fe := st.Msg().GetFilesystem()
			if fe == nil {
				continue
			}
			k := types[fe.GetType()] + " " + fe.GetName()
			if _, ok := want[k]; ok {
				want[k] = true
			}
			if k == "create new/b.txt" && fe.GetEntry().GetPath() != e.home()+"/w/new/b.txt" {
				t.Errorf("include_entry: %v", fe.GetEntry())
			}
		}
		if !want[until] {
			t.Fatalf("missing %s: %v (err %v)", until, want, st.Err())
		}
	}
	writeFile(t, e.home()+"/w/sub/a.txt", "a")
	_ = os.Mkdir(e.home()+"/w/new", 0o755)
	// The watch reports a new directory once it watches it (not a fixed
	// sleep: under load that is flaky).
	receive("create new")
	writeFile(t, e.home()+"/w/new/b.txt", "b")
	_ = os.Remove(e.home() + "/w/sub/a.txt")
	for k := range want {
		receive(k)
	}
	// Uploads (atomic temp file + rename) show up under the final name
	// only, as envd's in-place write: create and write for a new file,
	// write for an existing one.
	upload := func(want ...string) {
		t.Helper()
		resp, _ := e.post("/files?path="+url.QueryEscape("w/up.txt"), "application/octet-stream", []byte("u"), nil)
		if resp.StatusCode != 200 {
			t.Fatalf("upload %d", resp.StatusCode)
		}
		var got []string
		for len(got) < len(want) && st.Receive() {
			fe := st.Msg().GetFilesystem()
			if strings.Contains(fe.GetName(), ".upload-") {
				t.Fatalf("temp file event %v", fe)
			}
			if fe.GetName() == "up.txt" {
				got = append(got, types[fe.GetType()])
			}
		}
		if strings.Join(got, ",") != strings.Join(want, ",") {
			t.Fatalf("upload events %v, want %v", got, want)
		}
	}
	upload("create", "write")
	upload("write")
	// Bad inputs.
	bad, err := e.fs.WatchDir(ctx, connect.NewRequest(&filesystempb.WatchDirRequest{Path: "w/nope"}))
	if err == nil {
		for bad.Receive() {
		}
		err = bad.Err()
		bad.Close()
	}
	if codeOf(err) != connect.CodeNotFound {
		t.Fatalf("watch missing: %v", err)
	}
}

func TestPollWatcher(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	_ = os.MkdirAll(e.home()+"/pw", 0o755)
	cw, err := e.fs.CreateWatcher(ctx, connect.NewRequest(&filesystempb.CreateWatcherRequest{Path: "pw"}))
	if err != nil {
		t.Fatal(err)
	}
	id := cw.Msg.GetWatcherId()
	writeFile(t, e.home()+"/pw/x", "x")
	var got []string
	eventually(t, "watcher events", func() bool {
		ev, err := e.fs.GetWatcherEvents(ctx, connect.NewRequest(&filesystempb.GetWatcherEventsRequest{WatcherId: id}))
		if err != nil {
			t.Fatal(err)
		}
		for _, fe := range ev.Msg.GetEvents() {
			got = append(got, fe.GetType().String()+" "+fe.GetName())
		}
		return strings.Contains(strings.Join(got, ","), "EVENT_TYPE_CREATE x")
	})
	if _, err := e.fs.RemoveWatcher(ctx, connect.NewRequest(&filesystempb.RemoveWatcherRequest{WatcherId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := e.fs.GetWatcherEvents(ctx, connect.NewRequest(&filesystempb.GetWatcherEventsRequest{WatcherId: id})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("after remove: %v", err)
	}
	if _, err := e.fs.RemoveWatcher(ctx, connect.NewRequest(&filesystempb.RemoveWatcherRequest{WatcherId: id})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("double remove: %v", err)
	}
	// A watcher left open is stopped by Close (goleak checks).
	if _, err := e.fs.CreateWatcher(ctx, connect.NewRequest(&filesystempb.CreateWatcherRequest{Path: "pw", Recursive: true})); err != nil {
		t.Fatal(err)
	}
}

func TestMalformedConnectJSON(t *testing.T) {
	e := newEnv(t)
	resp, body := e.post("/filesystem.Filesystem/Stat", "application/json", []byte(`{"path": 12`), nil)
	if resp.StatusCode != 400 || !strings.Contains(string(body), "invalid_argument") {
		t.Fatalf("malformed: %d %s", resp.StatusCode, body)
	}
	resp, body = e.post("/filesystem.Filesystem/Stat", "application/json", []byte(`{"path": "`+strings.Repeat("a", 17<<20)+`"}`), nil)
	if resp.StatusCode < 400 || resp.StatusCode == 500 {
		t.Fatalf("oversized: %d %.200s", resp.StatusCode, body)
	}
}
