package guest

// Spawning processes: the user's environment and PATH, the PTY or pipes,
// the cgroup placement, and the waiter that ends the stream once the
// process and its output are done.

import (
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/creack/pty"
	"google.golang.org/protobuf/proto"

	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/internal/guest/cgexec"
)

const (
	// drainGrace is how long output readers keep reading after the process
	// exited, while more output keeps arriving (e.g. from children that
	// outlive it). A whole grace period without output ends the stream.
	drainGrace = 100 * time.Millisecond
	// readerWait bounds how long the waiter waits for readers after the
	// grace logic, before it ends the stream without them (output that
	// never pauses); their files are drained, not closed (drainOrphaned).
	readerWait = 5 * time.Second
	// drainBufferSize is the read buffer of a pipe drained after its
	// stream ended (drainOrphaned): small, as there may be many.
	drainBufferSize = 4 << 10
	defaultPTYCols  = 80
	defaultPTYRows  = 24
)

// startProcess validates the request, starts the process and registers it.
// The returned subscriber was registered before any output was read.
func (s *Server) startProcess(h http.Header, req *processpb.StartRequest) (*proc, *subscriber, error) {
	acct, _, err := s.userFromAuth(h)
	if err != nil {
		return nil, nil, err
	}
	pc := req.GetProcess()
	if pc == nil || pc.GetCmd() == "" {
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, errors.New("process.cmd is required"))
	}
	for _, a := range append([]string{pc.GetCmd()}, pc.GetArgs()...) {
		if strings.IndexByte(a, 0) >= 0 {
			return nil, nil, connect.NewError(connect.CodeInvalidArgument, errors.New("command and arguments must not contain NUL bytes"))
		}
	}
	cwd := acct.Home
	if d := s.act.Load().DefaultCwd; d != "" {
		if st, err := os.Stat(d); err == nil && st.IsDir() {
			cwd = d
		}
	}
	if pc.Cwd != nil && pc.GetCwd() != "" {
		cwd, err = ResolvePath(pc.GetCwd(), acct.Home)
		if err != nil {
			return nil, nil, connect.NewError(connect.CodeInvalidArgument, err)
		}
		if st, err := os.Stat(cwd); err != nil || !st.IsDir() {
			return nil, nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("cwd %s does not exist or is not a directory", quote(cwd)))
		}
	} else if st, err := os.Stat(cwd); err != nil || !st.IsDir() {
		cwd = "/"
	}
	env, err := s.processEnv(acct, cwd, pc.GetEnvs())
	if err != nil {
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	path, err := lookPath(pc.GetCmd(), cwd, env)
	if err != nil {
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	cmd := &exec.Cmd{
		Path: path,
		Args: append([]string{pc.GetCmd()}, pc.GetArgs()...),
		Env:  env,
		Dir:  cwd,
	}
	attrs := &syscall.SysProcAttr{
		Credential: &syscall.Credential{Uid: acct.UID, Gid: acct.GID, Groups: acct.Groups},
	}
	if os.Getuid() != 0 && uint32(os.Getuid()) == acct.UID {
		attrs.Credential = nil // unprivileged agent running as that user (tests, dev)
	}

	p := &proc{
		tag:  req.Tag,
		cfg:  proto.Clone(pc).(*processpb.ProcessConfig),
		cmd:  cmd,
		subs: make(map[*subscriber]struct{}),

		detachLimit: s.cfg.DetachedOutputBytes,
	}
	sub, _ := p.subscribe()

	var readers []*os.File
	var kinds []int
	var childEnds []*os.File
	closeAll := func(fs []*os.File) {
		for _, f := range fs {
			_ = f.Close()
		}
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, nil, errClosing
	}
	if req.GetPty() != nil {
		size := req.GetPty().GetSize()
		ws := &pty.Winsize{Cols: defaultPTYCols, Rows: defaultPTYRows}
		if size.GetCols() > 0 && size.GetRows() > 0 {
			ws = &pty.Winsize{Cols: uint16(min(size.GetCols(), 0xffff)), Rows: uint16(min(size.GetRows(), 0xffff))}
		}
		attrs.Setsid = true
		attrs.Setctty = true
		h, err := s.prepareStart(cmd)
		if err != nil {
			return nil, nil, err
		}
		master, err := pty.StartWithAttrs(cmd, ws, attrs)
		if err != nil {
			return nil, nil, startError(h.abort(err))
		}
		if err := h.place(cmd); err != nil {
			_ = master.Close()
			return nil, nil, startError(err)
		}
		p.pty = master
		readers, kinds = []*os.File{master}, []int{3}
	} else {
		attrs.Setpgid = true
		cmd.SysProcAttr = attrs
		outR, outW, err := os.Pipe()
		if err != nil {
			return nil, nil, connect.NewError(connect.CodeInternal, err)
		}
		errR, errW, err := os.Pipe()
		if err != nil {
			closeAll([]*os.File{outR, outW})
			return nil, nil, connect.NewError(connect.CodeInternal, err)
		}
		readers, kinds = []*os.File{outR, errR}, []int{1, 2}
		childEnds = []*os.File{outW, errW}
		cmd.Stdout, cmd.Stderr = outW, errW
		if req.GetStdin() {
			inR, inW, err := os.Pipe()
			if err != nil {
				closeAll(append(readers, childEnds...))
				return nil, nil, connect.NewError(connect.CodeInternal, err)
			}
			cmd.Stdin = inR
			childEnds = append(childEnds, inR)
			p.stdin = inW
		}
		h, err := s.prepareStart(cmd)
		if err == nil {
			if err = cmd.Start(); err != nil {
				err = h.abort(err)
			} else {
				err = h.place(cmd)
			}
		}
		closeAll(childEnds)
		if err != nil {
			closeAll(readers)
			if p.stdin != nil {
				_ = p.stdin.Close()
			}
			return nil, nil, startError(err)
		}
	}
	p.pid = uint32(cmd.Process.Pid)
	s.procs[p.pid] = p
	// s.closed is false and s.mu is held: register the goroutines directly.
	var readersWG sync.WaitGroup
	stop := new(atomic.Bool)
	open := make([]bool, len(readers)) // each reader's result, read after readersWG.Wait
	for i, f := range readers {
		readersWG.Add(1)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer readersWG.Done()
			open[i] = p.readLoop(f, kinds[i], stop)
		}()
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.waitProcess(p, readers, &readersWG, stop, open)
	}()
	s.log.Info("process started", "pid", p.pid, "cmd", pc.GetCmd(), "user", acct.Name, "pty", p.pty != nil)
	return p, sub, nil
}

// userStart is a start through the cgexec wrapper (nil: a direct start).
type userStart struct {
	h    *cgexec.Handoff
	path string
	cg   *os.File
}

// prepareStart makes cmd start through the cgexec wrapper when the agent
// has the user cgroup (Config.UserCgroupProcs); otherwise it returns nil
// and cmd starts directly.
func (s *Server) prepareStart(cmd *exec.Cmd) (*userStart, error) {
	if s.cfg.UserCgroupProcs == nil {
		return nil, nil
	}
	path := cmd.Path
	h, err := cgexec.Prepare(cmd)
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("error starting process: %w", err))
	}
	return &userStart{h: h, path: path, cg: s.cfg.UserCgroupProcs}, nil
}

// abort releases u after a failed Start and names the real command in
// err instead of the wrapper.
func (u *userStart) abort(err error) error {
	if u == nil {
		return err
	}
	u.h.Close()
	var pe *os.PathError
	if errors.As(err, &pe) {
		pe.Path = u.path
	}
	return err
}

// place moves the started wrapper into the user cgroup and lets it exec
// the command. On error the process was killed and is reaped here.
func (u *userStart) place(cmd *exec.Cmd) error {
	if u == nil {
		return nil
	}
	if err := u.h.Place(cmd.Process.Pid, u.cg); err != nil {
		_ = cmd.Wait()
		return err
	}
	return nil
}

func startError(err error) error {
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, fs.ErrPermission) || errors.Is(err, exec.ErrNotFound) {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("error starting process: %w", err))
	}
	return connect.NewError(connect.CodeInternal, fmt.Errorf("error starting process: %w", err))
}

// waitProcess reaps the process, drains its output, publishes the end event
// and unregisters it. Output pipes (or the terminal) that children of the
// process still hold when its stream ends are not closed but drained (see
// drainOrphaned).
func (s *Server) waitProcess(p *proc, readers []*os.File, readersWG *sync.WaitGroup, stop *atomic.Bool, open []bool) {
	werr := p.cmd.Wait()
	p.waited.Store(true)
	if t := p.deadline.Load(); t != nil {
		t.Stop()
	}
	for _, f := range readers {
		if f.SetReadDeadline(time.Now().Add(drainGrace)) != nil {
			// Not pollable: closing is the only way to stop the reader.
			_ = f.Close()
		}
	}
	done := make(chan struct{})
	go func() { readersWG.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(readerWait):
		// Output keeps arriving (a child left behind writes without
		// pause): end the stream anyway, without closing the files.
		stop.Store(true)
		for _, f := range readers {
			_ = f.SetReadDeadline(time.Now())
		}
		<-done
	}
	for i, f := range readers {
		if open[i] {
			s.drainOrphaned(f)
		} else {
			_ = f.Close()
		}
	}
	if p.stdin != nil {
		_ = p.stdin.Close()
	}
	end := &processpb.ProcessEvent_EndEvent{}
	if st := p.cmd.ProcessState; st != nil {
		end.ExitCode = int32(st.ExitCode())
		end.Exited = st.Exited()
		end.Status = st.String()
	}
	if werr != nil {
		msg := werr.Error()
		end.Error = &msg
	}
	p.finish(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_End{End: end}})
	s.mu.Lock()
	if s.procs[p.pid] == p {
		delete(s.procs, p.pid)
	}
	s.mu.Unlock()
	s.log.Info("process ended", "pid", p.pid, "status", end.Status)
}

// drainOrphaned reads and discards what f, an output pipe or terminal of a
// process whose stream has ended, still yields, until its last writer is
// gone or the server closes. A process's children can outlive it with its
// stdout, stderr or terminal (`server &`): a closed read end would hit
// them with SIGPIPE, EPIPE or EIO at their next write, and one nobody
// reads would block them once its buffer is full.
func (s *Server) drainOrphaned(f *os.File) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = f.Close()
		return
	}
	s.drains[f] = struct{}{}
	// s.closed is false and s.mu is held: register the goroutine directly.
	s.wg.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.wg.Done()
		defer func() {
			s.mu.Lock()
			delete(s.drains, f)
			s.mu.Unlock()
			_ = f.Close()
		}()
		if f.SetReadDeadline(time.Time{}) != nil {
			return
		}
		buf := make([]byte, drainBufferSize)
		for {
			if _, err := f.Read(buf); err != nil {
				return // EOF (no writer left), or closed by Close
			}
		}
	}()
}

// processEnv builds the environment: PATH default, Config.Env, the user's
// HOME/USER/LOGNAME, PWD, then the request's envs (which win).
func (s *Server) processEnv(acct *account, cwd string, reqEnv map[string]string) ([]string, error) {
	m := map[string]string{"PATH": DefaultPath}
	for k, v := range s.act.Load().Env {
		m[k] = v
	}
	m["HOME"] = acct.Home
	m["USER"] = acct.Name
	m["LOGNAME"] = acct.Name
	m["PWD"] = cwd
	for k, v := range reqEnv {
		if k == "" || strings.ContainsAny(k, "=\x00") || strings.IndexByte(v, 0) >= 0 {
			return nil, fmt.Errorf("invalid environment variable %q", k)
		}
		m[k] = v
	}
	env := make([]string, 0, len(m))
	for k, v := range m {
		env = append(env, k+"="+v)
	}
	sort.Strings(env)
	return env, nil
}

// lookPath resolves cmd like a shell would for the child: names with a slash
// are used as is (relative to cwd), bare names are searched in the child's
// PATH.
func lookPath(cmd, cwd string, env []string) (string, error) {
	if strings.Contains(cmd, "/") {
		return cmd, nil
	}
	pathVar := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			pathVar = v
		}
	}
	for _, dir := range filepath.SplitList(pathVar) {
		if dir == "" {
			dir = "."
		}
		if !filepath.IsAbs(dir) {
			dir = filepath.Join(cwd, dir)
		}
		cand := filepath.Join(dir, cmd)
		if st, err := os.Stat(cand); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return cand, nil
		}
	}
	return "", fmt.Errorf("executable %s not found in $PATH", quote(cmd))
}
