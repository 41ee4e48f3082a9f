package guest

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"go.uber.org/goleak"

	filesystempb "github.com/spacesbx/space/api/envd/filesystem"
	"github.com/spacesbx/space/api/envd/filesystem/filesystempbconnect"
	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/envd/process/processpbconnect"
	"github.com/spacesbx/space/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// env is a running server on a Unix socket with clients.
type env struct {
	t      *testing.T
	srv    *Server
	dir    string // scratch dir (world-writable home of "user")
	root   string // home of root
	http   *http.Client
	base   string
	proc   processpbconnect.ProcessClient
	fs     filesystempbconnect.FilesystemClient
	passwd string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	var ucg *os.File
	if os.Getenv("GUEST_TEST_CGEXEC") != "" {
		// Run the whole suite through the cgexec wrapper.
		testenv.RequireRoot(t, "runs processes as other users")
		_, ucg = testUserCgroup(t)
	}
	return newEnvCgroup(t, ucg)
}

// newEnvCgroup is newEnv with Config.UserCgroupProcs set to ucg.
func newEnvCgroup(t *testing.T, ucg *os.File) *env {
	t.Helper()
	testenv.RequireRoot(t, "runs processes as other users")
	// Not t.TempDir(): its parent is 0700, unreachable for uid 1000.
	dir, err := os.MkdirTemp("", "guest-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	home := filepath.Join(dir, "home", "user")
	rootHome := filepath.Join(dir, "root")
	for _, d := range []string{home, rootHome} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chown(home, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	passwd := filepath.Join(dir, "passwd")
	group := filepath.Join(dir, "group")
	writeFile(t, passwd, fmt.Sprintf("root:x:0:0:root:%s:/bin/sh\n# comment\nuser:x:1000:1000::%s:/bin/sh\nbroken:line\n", rootHome, home))
	writeFile(t, group, "root:x:0:\nuser:x:1000:\nextra:x:1500:user,other\n")
	srv, err := New(Config{
		Identity:        Identity{Sandbox: "sbx1", Generation: 3, Execution: "ex1", Worker: "w1", Substrate: "ns", Activation: "a1"},
		Env:             map[string]string{"SPACE_DEFAULT": "yes"},
		PasswdPath:      passwd,
		GroupPath:       group,
		MaxUploadBytes:  1 << 20,
		Logger:          slog.New(slog.NewTextHandler(io.Discard, nil)),
		UserCgroupProcs: ucg,
	})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "guest.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}
	hc := &http.Client{Transport: tr}
	e := &env{t: t, srv: srv, dir: dir, root: rootHome, http: hc, base: "http://guest", passwd: passwd,
		proc: processpbconnect.NewProcessClient(hc, "http://guest", connect.WithProtoJSON()),
		fs:   filesystempbconnect.NewFilesystemClient(hc, "http://guest", connect.WithProtoJSON()),
	}
	t.Cleanup(func() {
		if err := srv.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
		tr.CloseIdleConnections()
	})
	return e
}

func (e *env) home() string { return filepath.Join(e.dir, "home", "user") }

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// asUser sets the Authorization header the e2b SDK sends.
func asUser[T any](req *connect.Request[T], user string) *connect.Request[T] {
	req.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":")))
	return req
}

type result struct {
	pid    uint32
	stdout string
	stderr string
	pty    string
	end    *processpb.ProcessEvent_EndEvent
}

// collect reads a process stream to its end.
func collect(t *testing.T, next func() (*processpb.ProcessEvent, bool), errf func() error) result {
	t.Helper()
	var r result
	for {
		ev, ok := next()
		if !ok {
			break
		}
		switch {
		case ev.GetStart() != nil:
			r.pid = ev.GetStart().GetPid()
		case ev.GetData() != nil:
			d := ev.GetData()
			r.stdout += string(d.GetStdout())
			r.stderr += string(d.GetStderr())
			r.pty += string(d.GetPty())
		case ev.GetEnd() != nil:
			r.end = ev.GetEnd()
		}
	}
	if err := errf(); err != nil {
		t.Fatalf("stream error: %v", err)
	}
	if r.end == nil {
		t.Fatalf("no end event (stdout %q stderr %q)", r.stdout, r.stderr)
	}
	return r
}

func (e *env) run(user string, req *processpb.StartRequest) result {
	e.t.Helper()
	r := connect.NewRequest(req)
	if user != "" {
		asUser(r, user)
	}
	st, err := e.proc.Start(ctxT(e.t), r)
	if err != nil {
		e.t.Fatal(err)
	}
	defer st.Close()
	return collect(e.t, func() (*processpb.ProcessEvent, bool) {
		if !st.Receive() {
			return nil, false
		}
		return st.Msg().GetEvent(), true
	}, st.Err)
}

func sh(script string) *processpb.StartRequest {
	return &processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}}
}

func codeOf(err error) connect.Code {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	return connect.CodeUnknown
}

func (e *env) get(path string, hdr map[string]string) (*http.Response, []byte) {
	e.t.Helper()
	req, _ := http.NewRequest(http.MethodGet, e.base+path, nil)
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := e.http.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func (e *env) post(path, ct string, body []byte, hdr map[string]string) (*http.Response, []byte) {
	e.t.Helper()
	req, _ := http.NewRequest(http.MethodPost, e.base+path, bytes.NewReader(body))
	req.Header.Set("Content-Type", ct)
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := e.http.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if cond() {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s", what)
}

var _ = strings.Contains
var _ = filesystempb.FileType_FILE_TYPE_FILE

func mkdirAs(path string, uid int) error {
	if err := os.MkdirAll(path, 0o755); err != nil {
		return err
	}
	return os.Chown(path, uid, uid)
}
