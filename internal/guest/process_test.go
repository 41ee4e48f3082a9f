package guest

import (
	"context"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	processpb "github.com/spacesbx/space/api/envd/process"
)

func TestStartEchoAndExitCodes(t *testing.T) {
	e := newEnv(t)
	r := e.run("", sh("echo hello; echo oops >&2"))
	if r.stdout != "hello\n" || r.stderr != "oops\n" {
		t.Fatalf("stdout %q stderr %q", r.stdout, r.stderr)
	}
	if r.pid == 0 || r.end.GetExitCode() != 0 || !r.end.GetExited() || r.end.GetStatus() != "exit status 0" {
		t.Fatalf("pid %d end %v", r.pid, r.end)
	}
	r = e.run("", sh("exit 7"))
	if r.end.GetExitCode() != 7 || !r.end.GetExited() || r.end.GetError() != "exit status 7" {
		t.Fatalf("end %v", r.end)
	}
}

func TestStartBadInput(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	for name, req := range map[string]*processpb.StartRequest{
		"no process": {},
		"empty cmd":  {Process: &processpb.ProcessConfig{}},
		"nul arg":    {Process: &processpb.ProcessConfig{Cmd: "/bin/echo", Args: []string{"a\x00b"}}},
		"bad env":    {Process: &processpb.ProcessConfig{Cmd: "/bin/echo", Envs: map[string]string{"A=B": "c"}}},
		"missing":    {Process: &processpb.ProcessConfig{Cmd: "no-such-binary-xyz"}},
		"bad cwd":    {Process: &processpb.ProcessConfig{Cmd: "/bin/echo", Cwd: ptr("/no/such/dir")}},
		"nul cwd":    {Process: &processpb.ProcessConfig{Cmd: "/bin/echo", Cwd: ptr("/tmp\x00")}},
	} {
		st, err := e.proc.Start(ctx, connect.NewRequest(req))
		if err == nil {
			for st.Receive() {
			}
			err = st.Err()
			st.Close()
		}
		if codeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("%s: got %v, want invalid_argument", name, err)
		}
	}
	st, err := e.proc.Start(ctx, asUser(connect.NewRequest(sh("true")), "nobody-here"))
	if err == nil {
		for st.Receive() {
		}
		err = st.Err()
		st.Close()
	}
	if codeOf(err) != connect.CodeUnauthenticated || !strings.Contains(err.Error(), "invalid username") {
		t.Errorf("unknown user: %v", err)
	}
	_, err = e.proc.SendSignal(ctx, connect.NewRequest(&processpb.SendSignalRequest{Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: 999999}}, Signal: processpb.Signal_SIGNAL_SIGKILL}))
	if codeOf(err) != connect.CodeNotFound {
		t.Errorf("signal unknown pid: %v", err)
	}
	_, err = e.proc.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{}))
	if codeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("no selector: %v", err)
	}
}

func ptr[T any](v T) *T { return &v }

func TestRunAsUserEnvAndCwd(t *testing.T) {
	e := newEnv(t)
	script := `echo "$(id -u) $(id -g) $(id -G)"; echo "$HOME|$USER|$PWD|$(pwd)|$SPACE_DEFAULT|$FOO"`
	r := e.run("", sh(script)) // default user is "user"
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != 2 || lines[0] != "1000 1000 1000 1500" {
		t.Fatalf("ids: %q (stderr %q)", r.stdout, r.stderr)
	}
	want := e.home() + "|user|" + e.home() + "|" + e.home() + "|yes|"
	if lines[1] != want {
		t.Fatalf("env line %q, want %q", lines[1], want)
	}
	req := sh(script)
	req.Process.Envs = map[string]string{"FOO": "bar", "SPACE_DEFAULT": "overridden"}
	req.Process.Cwd = ptr("/tmp")
	r = e.run("root", req)
	lines = strings.Split(strings.TrimSpace(r.stdout), "\n")
	if lines[0] != "0 0 0" || lines[1] != e.root+"|root|/tmp|/tmp|overridden|bar" {
		t.Fatalf("root run: %q", r.stdout)
	}
	// Relative cwd resolves against the user's home; ~ expands.
	if err := mkdirAs(e.home()+"/sub", 1000); err != nil {
		t.Fatal(err)
	}
	req = sh("pwd")
	req.Process.Cwd = ptr("sub")
	if r = e.run("user", req); strings.TrimSpace(r.stdout) != e.home()+"/sub" {
		t.Fatalf("relative cwd: %q", r.stdout)
	}
	req.Process.Cwd = ptr("~/sub")
	if r = e.run("user", req); strings.TrimSpace(r.stdout) != e.home()+"/sub" {
		t.Fatalf("~ cwd: %q", r.stdout)
	}
}

func TestStdinAndCloseStdin(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	req := sh("cat; echo done")
	req.Stdin = ptr(true)
	st, err := e.proc.Start(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if !st.Receive() {
		t.Fatal(st.Err())
	}
	pid := st.Msg().GetEvent().GetStart().GetPid()
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
	if _, err := e.proc.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel, Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("abc\n")}}})); err != nil {
		t.Fatal(err)
	}
	// Client-streaming input too.
	in := e.proc.StreamInput(ctx)
	_ = in.Send(&processpb.StreamInputRequest{Event: &processpb.StreamInputRequest_Start{Start: &processpb.StreamInputRequest_StartEvent{Process: sel}}})
	_ = in.Send(&processpb.StreamInputRequest{Event: &processpb.StreamInputRequest_Keepalive{Keepalive: &processpb.StreamInputRequest_KeepAlive{}}})
	_ = in.Send(&processpb.StreamInputRequest{Event: &processpb.StreamInputRequest_Data{Data: &processpb.StreamInputRequest_DataEvent{Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("def\n")}}}}})
	if _, err := in.CloseAndReceive(); err != nil {
		t.Fatal(err)
	}
	if _, err := e.proc.CloseStdin(ctx, connect.NewRequest(&processpb.CloseStdinRequest{Process: sel})); err != nil {
		t.Fatal(err)
	}
	r := collect(t, func() (*processpb.ProcessEvent, bool) {
		if !st.Receive() {
			return nil, false
		}
		return st.Msg().GetEvent(), true
	}, st.Err)
	if r.stdout != "abc\ndef\ndone\n" || r.end.GetExitCode() != 0 {
		t.Fatalf("stdout %q end %v", r.stdout, r.end)
	}
	// Input to an ended process: not found.
	_, err = e.proc.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel, Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("x")}}}))
	if codeOf(err) != connect.CodeNotFound {
		t.Fatalf("input after end: %v", err)
	}
}

func TestStdinNotEnabled(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	st, err := e.proc.Start(ctx, connect.NewRequest(sh("cat; echo eof")))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	r := collect(t, func() (*processpb.ProcessEvent, bool) {
		if !st.Receive() {
			return nil, false
		}
		return st.Msg().GetEvent(), true
	}, st.Err)
	if r.stdout != "eof\n" { // stdin is /dev/null
		t.Fatalf("stdout %q", r.stdout)
	}
}

func TestBackgroundConnectSignalList(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	req := sh("i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.05; done")
	req.Tag = ptr("ticker")
	startCtx, cancelStart := context.WithCancel(ctx)
	st, err := e.proc.Start(startCtx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	if !st.Receive() {
		t.Fatal(st.Err())
	}
	pid := st.Msg().GetEvent().GetStart().GetPid()
	// Drop the stream: the process keeps running.
	cancelStart()
	st.Close()

	list, err := e.proc.List(ctx, connect.NewRequest(&processpb.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Msg.GetProcesses()) != 1 || list.Msg.GetProcesses()[0].GetPid() != pid || list.Msg.GetProcesses()[0].GetTag() != "ticker" ||
		list.Msg.GetProcesses()[0].GetConfig().GetCmd() != "/bin/sh" {
		t.Fatalf("list: %v", list.Msg)
	}
	// Attach by tag, with keepalives requested.
	creq := connect.NewRequest(&processpb.ConnectRequest{Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Tag{Tag: "ticker"}}})
	creq.Header().Set("Keepalive-Ping-Interval", "1")
	cs, err := e.proc.Connect(ctx, creq)
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	if !cs.Receive() || cs.Msg().GetEvent().GetStart().GetPid() != pid {
		t.Fatalf("connect start: %v %v", cs.Msg(), cs.Err())
	}
	var out string
	for !strings.Contains(out, "tick") {
		if !cs.Receive() {
			t.Fatal(cs.Err())
		}
		out += string(cs.Msg().GetEvent().GetData().GetStdout())
	}
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
	if _, err := e.proc.SendSignal(ctx, connect.NewRequest(&processpb.SendSignalRequest{Process: sel, Signal: processpb.Signal_SIGNAL_SIGTERM})); err != nil {
		t.Fatal(err)
	}
	r := collect(t, func() (*processpb.ProcessEvent, bool) {
		if !cs.Receive() {
			return nil, false
		}
		return cs.Msg().GetEvent(), true
	}, cs.Err)
	if r.end.GetExited() || r.end.GetStatus() != "signal: terminated" || r.end.GetExitCode() != -1 {
		t.Fatalf("end: %v", r.end)
	}
	eventually(t, "process removed from list", func() bool {
		l, err := e.proc.List(ctx, connect.NewRequest(&processpb.ListRequest{}))
		return err == nil && len(l.Msg.GetProcesses()) == 0
	})
	gone, err := e.proc.Connect(ctx, connect.NewRequest(&processpb.ConnectRequest{Process: sel}))
	if err == nil {
		for gone.Receive() {
		}
		err = gone.Err()
		gone.Close()
	}
	if codeOf(err) != connect.CodeNotFound {
		t.Fatalf("connect to ended process: %v", err)
	}
}

func TestKeepalive(t *testing.T) {
	e := newEnv(t)
	req := connect.NewRequest(sh("sleep 1.3; echo hi"))
	req.Header().Set("Keepalive-Ping-Interval", "1")
	st, err := e.proc.Start(ctxT(t), req)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	keepalives := 0
	for st.Receive() {
		if st.Msg().GetEvent().GetKeepalive() != nil {
			keepalives++
		}
	}
	if st.Err() != nil || keepalives == 0 {
		t.Fatalf("keepalives %d err %v", keepalives, st.Err())
	}
}

func TestPTY(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	req := &processpb.StartRequest{
		Process: &processpb.ProcessConfig{Cmd: "/bin/sh", Envs: map[string]string{"TERM": "dumb", "PS1": "$ "}},
		Pty:     &processpb.PTY{Size: &processpb.PTY_Size{Cols: 100, Rows: 30}},
	}
	st, err := e.proc.Start(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if !st.Receive() {
		t.Fatal(st.Err())
	}
	pid := st.Msg().GetEvent().GetStart().GetPid()
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
	var out strings.Builder
	waitFor := func(s string) {
		t.Helper()
		for !strings.Contains(out.String(), s) {
			if !st.Receive() {
				t.Fatalf("stream ended before %q: %v (output %q)", s, st.Err(), out.String())
			}
			if d := st.Msg().GetEvent().GetData(); d != nil {
				if len(d.GetStdout()) > 0 {
					t.Fatal("pty output arrived as stdout")
				}
				out.Write(d.GetPty())
			}
		}
	}
	send := func(s string) {
		t.Helper()
		if _, err := e.proc.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel, Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Pty{Pty: []byte(s)}}})); err != nil {
			t.Fatal(err)
		}
	}
	send("stty size; tty; echo m$((6*7))\n")
	waitFor("m42")
	if !strings.Contains(out.String(), "30 100") || !strings.Contains(out.String(), "/dev/pts/") {
		t.Fatalf("pty output %q", out.String())
	}
	if _, err := e.proc.Update(ctx, connect.NewRequest(&processpb.UpdateRequest{Process: sel, Pty: &processpb.PTY{Size: &processpb.PTY_Size{Cols: 120, Rows: 40}}})); err != nil {
		t.Fatal(err)
	}
	send("stty size\n")
	waitFor("40 120")
	_, err = e.proc.Update(ctx, connect.NewRequest(&processpb.UpdateRequest{Process: sel, Pty: &processpb.PTY{Size: &processpb.PTY_Size{}}}))
	if codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("zero size: %v", err)
	}
	send("exit 3\n")
	r := collect(t, func() (*processpb.ProcessEvent, bool) {
		if !st.Receive() {
			return nil, false
		}
		return st.Msg().GetEvent(), true
	}, st.Err)
	if r.end.GetExitCode() != 3 {
		t.Fatalf("end %v", r.end)
	}
}

func TestCloseKillsProcesses(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	st, err := e.proc.Start(ctx, connect.NewRequest(sh("sleep 100 & sleep 100; echo never")))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if !st.Receive() {
		t.Fatal(st.Err())
	}
	pid := int(st.Msg().GetEvent().GetStart().GetPid())
	start := time.Now()
	if err := e.srv.Close(); err != nil {
		t.Fatal(err)
	}
	if time.Since(start) > 3*time.Second {
		t.Fatalf("Close took %v", time.Since(start))
	}
	if err := syscall.Kill(pid, 0); err == nil {
		t.Fatalf("process %d still alive after Close", pid)
	}
	for st.Receive() {
	}
}

// A Start request's Connect timeout (e2b's commands.run timeoutMs) bounds
// the process, not just the stream: envd kills the process when it passes.
func TestStartTimeoutKillsProcess(t *testing.T) {
	e := newEnv(t)
	ctx := ctxT(t)
	// The client sends the deadline as Connect-Timeout-Ms.
	tctx, tcancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer tcancel()
	st, err := e.proc.Start(tctx, connect.NewRequest(sh("sleep 30")))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if !st.Receive() || st.Msg().GetEvent().GetStart().GetPid() == 0 {
		t.Fatalf("start: %v", st.Err())
	}
	eventually(t, "timed-out process killed", func() bool {
		l, err := e.proc.List(ctx, connect.NewRequest(&processpb.ListRequest{}))
		return err == nil && len(l.Msg.GetProcesses()) == 0
	})
	// Without the header the process outlives a dropped stream.
	sctx, cancel := context.WithCancel(ctx)
	st2, err := e.proc.Start(sctx, connect.NewRequest(sh("sleep 30")))
	if err != nil {
		t.Fatal(err)
	}
	if !st2.Receive() {
		t.Fatal(st2.Err())
	}
	cancel()
	st2.Close()
	time.Sleep(500 * time.Millisecond)
	l, err := e.proc.List(ctx, connect.NewRequest(&processpb.ListRequest{}))
	if err != nil || len(l.Msg.GetProcesses()) != 1 {
		t.Fatalf("process without timeout: %v %v", l, err)
	}
}

// TestDefaultCwd: an image's working directory is where commands start
// when their request names none; a missing one falls back to the home.
func TestDefaultCwd(t *testing.T) {
	e := newEnv(t)
	id := e.srv.Identity()
	if err := e.srv.Reactivate(Config{Identity: id, DefaultCwd: "/tmp"}); err != nil {
		t.Fatal(err)
	}
	if r := e.run("user", sh("pwd")); strings.TrimSpace(r.stdout) != "/tmp" {
		t.Fatalf("default cwd: %q", r.stdout)
	}
	req := sh("pwd")
	req.Process.Cwd = ptr("/")
	if r := e.run("user", req); strings.TrimSpace(r.stdout) != "/" {
		t.Fatalf("a request's cwd: %q", r.stdout)
	}
	if err := e.srv.Reactivate(Config{Identity: id, DefaultCwd: "/no/such/dir"}); err != nil {
		t.Fatal(err)
	}
	if r := e.run("user", sh("pwd")); strings.TrimSpace(r.stdout) != e.home() {
		t.Fatalf("missing default cwd: %q, want the home", r.stdout)
	}
	for _, bad := range []string{"rel", "/a\x00b"} {
		if err := e.srv.Reactivate(Config{Identity: id, DefaultCwd: bad}); err == nil {
			t.Errorf("default cwd %q accepted", bad)
		}
	}
}
