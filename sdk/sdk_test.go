package sdk_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/sdk"
	"github.com/spacesbx/space/sdk/sdktest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func setup(t *testing.T) (*sdktest.Server, *sdk.Client) {
	t.Helper()
	f := sdktest.New()
	t.Cleanup(f.Close)
	c, err := sdk.New(sdk.Config{APIURL: f.API.URL, SandboxURL: f.Edge.URL, APIKey: sdktest.APIKey})
	if err != nil {
		t.Fatal(err)
	}
	return f, c
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

func TestNewValidates(t *testing.T) {
	if _, err := sdk.New(sdk.Config{}); err == nil {
		t.Fatal("empty config accepted")
	}
	if _, err := sdk.New(sdk.Config{APIURL: "ftp://x"}); err == nil {
		t.Fatal("bad URL accepted")
	}
}

func TestControlPlane(t *testing.T) {
	f, c := setup(t)
	sbx, err := c.CreateSandbox(ctx(t), sdk.CreateOptions{Timeout: 90 * time.Second, Metadata: map[string]string{"a": "b"}, Secure: true})
	if err != nil {
		t.Fatal(err)
	}
	st, _ := f.Get(sbx.ID)
	if st.Timeout != 90 || st.Metadata["a"] != "b" || st.Token == "" || sbx.AccessToken != st.Token || st.Template != "base" {
		t.Fatalf("state %+v handle %+v", st, sbx)
	}
	for i := 0; i < 3; i++ {
		if _, err := c.CreateSandbox(ctx(t), sdk.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	list, err := c.ListSandboxes(ctx(t))
	if err != nil || len(list) != 4 {
		t.Fatalf("list %d %v (pagination)", len(list), err)
	}
	info, err := c.GetSandbox(ctx(t), sbx.ID)
	if err != nil || info.EnvdAccessToken != st.Token || info.State != "running" {
		t.Fatalf("get %+v %v", info, err)
	}
	if err := c.SetTimeout(ctx(t), sbx.ID, 10*time.Minute); err != nil {
		t.Fatal(err)
	}
	if st, _ := f.Get(sbx.ID); st.Timeout != 600 {
		t.Fatalf("timeout %d", st.Timeout)
	}
	if err := c.KillSandbox(ctx(t), sbx.ID); err != nil {
		t.Fatal(err)
	}
	_, err = c.GetSandbox(ctx(t), sbx.ID)
	var se *sdk.Error
	if !errors.Is(err, sdk.ErrNotFound) || !errors.As(err, &se) || se.Status != 404 || !strings.Contains(se.Message, sbx.ID) {
		t.Fatalf("get after kill: %v", err)
	}
	_, err = c.CreateSandbox(ctx(t), sdk.CreateOptions{Template: "nope"})
	if !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("unknown template: %v", err)
	}
	bad, _ := sdk.New(sdk.Config{APIURL: f.API.URL, APIKey: "wrong"})
	if _, err := bad.ListSandboxes(ctx(t)); !errors.Is(err, sdk.ErrUnauthorized) {
		t.Fatalf("bad key: %v", err)
	}
	if _, err := c.GetSandbox(ctx(t), "../x"); !errors.Is(err, sdk.ErrBadRequest) {
		t.Fatalf("bad id: %v", err)
	}
}

func TestRun(t *testing.T) {
	_, c := setup(t)
	sbx, err := c.CreateSandbox(ctx(t), sdk.CreateOptions{Secure: true, EnvVars: map[string]string{"FOO": "bar"}})
	if err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	code, err := sbx.Run(ctx(t), "echo hello world", sdk.RunOptions{Stdout: &out, Stderr: &errb})
	if err != nil || code != 0 || out.String() != "hello world\n" {
		t.Fatalf("run: %d %v %q", code, err, out.String())
	}
	out.Reset()
	code, err = sbx.Exec(ctx(t), []string{"fail", "3", "oops"}, sdk.RunOptions{Stdout: &out, Stderr: &errb})
	if err != nil || code != 3 || errb.String() != "oops\n" {
		t.Fatalf("exec: %d %v %q", code, err, errb.String())
	}
	out.Reset()
	if _, err := sbx.Exec(ctx(t), []string{"whoami"}, sdk.RunOptions{User: "root", Stdout: &out}); err != nil || out.String() != "root\n" {
		t.Fatalf("user: %v %q", err, out.String())
	}
	out.Reset()
	if _, err := sbx.Exec(ctx(t), []string{"pwd"}, sdk.RunOptions{Cwd: "/tmp", Stdout: &out}); err != nil || out.String() != "/tmp\n" {
		t.Fatalf("cwd: %v %q", err, out.String())
	}
	code, err = sbx.Exec(ctx(t), []string{"signal"}, sdk.RunOptions{})
	var pe *sdk.ProcessError
	if code != -1 || !errors.As(err, &pe) || pe.Status != "signal: killed" {
		t.Fatalf("signal: %d %v", code, err)
	}
	// Wrong access token: the edge's JSON error keeps its message.
	bad := c.Attach(sbx.ID, "wrong")
	_, err = bad.Run(ctx(t), "echo x", sdk.RunOptions{})
	var se *sdk.Error
	if !errors.Is(err, sdk.ErrUnauthorized) || !errors.As(err, &se) || se.Message != "invalid access token" {
		t.Fatalf("bad token: %v", err)
	}
	if _, err := bad.ListDir(ctx(t), "/"); !errors.Is(err, sdk.ErrUnauthorized) {
		t.Fatalf("bad token listdir: %v", err)
	}
	if _, err := sbx.Exec(ctx(t), nil, sdk.RunOptions{}); !errors.Is(err, sdk.ErrBadRequest) {
		t.Fatalf("empty argv: %v", err)
	}
}

func TestFiles(t *testing.T) {
	f, c := setup(t)
	sbx, err := c.CreateSandbox(ctx(t), sdk.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sbx.WriteFile(ctx(t), "/home/user/a.txt", []byte("alpha")); err != nil {
		t.Fatal(err)
	}
	big := bytes.Repeat([]byte("0123456789"), 100000)
	if _, err := sbx.WriteFileFrom(ctx(t), "/home/user/dir/big.bin", bytes.NewReader(big)); err != nil {
		t.Fatal(err)
	}
	st, _ := f.Get(sbx.ID)
	if string(st.Files["/home/user/a.txt"]) != "alpha" || !bytes.Equal(st.Files["/home/user/dir/big.bin"], big) {
		t.Fatal("uploads not stored")
	}
	got, err := sbx.ReadFile(ctx(t), "/home/user/a.txt")
	if err != nil || string(got) != "alpha" {
		t.Fatalf("read %q %v", got, err)
	}
	var buf bytes.Buffer
	if n, err := sbx.ReadFileTo(ctx(t), "/home/user/dir/big.bin", &buf); err != nil || n != int64(len(big)) {
		t.Fatalf("read to: %d %v", n, err)
	}
	if _, err := sbx.ReadFile(ctx(t), "/nope"); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("missing file: %v", err)
	}
	entries, err := sbx.ListDir(ctx(t), "/home/user")
	if err != nil || len(entries) != 2 || entries[0].Name != "a.txt" || entries[0].Type != "file" || entries[0].Size != 5 ||
		entries[1].Name != "dir" || entries[1].Type != "dir" {
		t.Fatalf("listdir %+v %v", entries, err)
	}
	if _, err := sbx.ListDir(ctx(t), "/missing"); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("listdir missing: %v", err)
	}
}

func TestPTY(t *testing.T) {
	f, c := setup(t)
	sbx, err := c.CreateSandbox(ctx(t), sdk.CreateOptions{Secure: true})
	if err != nil {
		t.Fatal(err)
	}
	p, err := sbx.PTY(ctx(t), 24, 80)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if p.PID == 0 {
		t.Fatal("no pid")
	}
	if err := p.Resize(ctx(t), 40, 120); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(p, "ls\n"); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	n, err := p.Read(buf)
	if err != nil || string(buf[:n]) != "ls\n" {
		t.Fatalf("read %q %v", buf[:n], err)
	}
	if _, err := io.WriteString(p, "exit\n"); err != nil {
		t.Fatal(err)
	}
	rest, _ := io.ReadAll(p)
	if string(rest) != "exit\n" {
		t.Fatalf("rest %q", rest)
	}
	code, err := p.Wait()
	if code != 0 || err != nil {
		t.Fatalf("wait %d %v", code, err)
	}
	if st, _ := f.Get(sbx.ID); len(st.Resizes) != 1 || st.Resizes[0] != "40x120" {
		t.Fatalf("resizes %v", st.Resizes)
	}
}

func TestPTYCloseEndsStream(t *testing.T) {
	_, c := setup(t)
	sbx, err := c.CreateSandbox(ctx(t), sdk.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := sbx.PTY(ctx(t), 24, 80)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = p.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung")
	}
	if _, err := p.Write([]byte("x")); err == nil {
		t.Fatal("write after close succeeded")
	}
}
