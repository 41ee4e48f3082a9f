package guest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/creack/pty"
	"golang.org/x/sys/unix"
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
	// subscriberBuffer is the number of events queued per stream before
	// backpressure reaches the process's output pipes.
	subscriberBuffer = 64
	readBufferSize   = 32 << 10
	// drainBufferSize is the read buffer of a pipe drained after its
	// stream ended (drainOrphaned): small, as there may be many.
	drainBufferSize = 4 << 10
	defaultPTYCols  = 80
	defaultPTYRows  = 24
)

// proc is a process started by the agent.
type proc struct {
	pid   uint32
	tag   *string
	cfg   *processpb.ProcessConfig // as requested, for List
	cmd   *exec.Cmd
	pty   *os.File // PTY master, nil without PTY
	stdin *os.File // stdin pipe write end, nil when stdin was not requested
	// stdinClosed is set by CloseStdin.
	stdinClosed atomic.Bool
	// waited is set once the process has been reaped.
	waited atomic.Bool
	// deadline kills the process when the Start request's Connect timeout
	// (Connect-Timeout-Ms) passes, as envd does; stopped once it is reaped.
	deadline atomic.Pointer[time.Timer]

	mu   sync.Mutex
	subs map[*subscriber]struct{}
	end  *processpb.ProcessEvent // set when the process ended and output is drained
	// detached is output produced while no stream was subscribed, kept
	// for the next Connect (at most detachLimit bytes; 0: none kept).
	detachLimit   int
	detached      []*processpb.ProcessEvent
	detachedBytes int
	dropped       uint64 // bytes of detached output dropped (oldest first)
}

type subscriber struct {
	ch   chan *processpb.ProcessEvent // closed after the end event
	done chan struct{}                // closed by unsubscribe
}

// subscribe registers a new stream. If the process already ended, it returns
// the end event instead.
func (p *proc) subscribe() (*subscriber, *processpb.ProcessEvent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.end != nil {
		return nil, p.end
	}
	sub := &subscriber{ch: make(chan *processpb.ProcessEvent, subscriberBuffer), done: make(chan struct{})}
	p.subs[sub] = struct{}{}
	return sub, nil
}

// reattach is subscribe for process.Process/Connect: it also takes the
// output kept while nobody was subscribed (Config.DetachedOutputBytes),
// to be sent before anything else, and how many bytes of it were dropped.
func (p *proc) reattach() (*subscriber, *processpb.ProcessEvent, []*processpb.ProcessEvent, uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	kept, dropped := p.detached, p.dropped
	p.detached, p.detachedBytes, p.dropped = nil, 0, 0
	if p.end != nil {
		return nil, p.end, kept, dropped
	}
	sub := &subscriber{ch: make(chan *processpb.ProcessEvent, subscriberBuffer), done: make(chan struct{})}
	p.subs[sub] = struct{}{}
	return sub, nil, kept, dropped
}

func (p *proc) unsubscribe(sub *subscriber) {
	if sub == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.subs[sub]; ok {
		delete(p.subs, sub)
		close(sub.done)
		p.rescueLocked(sub)
	}
}

// rescueLocked moves what sub had queued but its stream never sent into
// the detached output, when sub was the last subscriber.
func (p *proc) rescueLocked(sub *subscriber) {
	if p.detachLimit <= 0 || len(p.subs) > 0 {
		return
	}
	for {
		select {
		case ev, ok := <-sub.ch:
			if !ok {
				return
			}
			p.keepLocked(ev)
		default:
			return
		}
	}
}

// keepLocked keeps a data event produced while nobody is subscribed,
// dropping the oldest kept output beyond Config.DetachedOutputBytes.
func (p *proc) keepLocked(ev *processpb.ProcessEvent) {
	if p.detachLimit <= 0 || ev.GetData() == nil {
		return
	}
	p.detached = append(p.detached, ev)
	p.detachedBytes += dataLen(ev)
	for p.detachedBytes > p.detachLimit && len(p.detached) > 0 {
		n := dataLen(p.detached[0])
		p.detached[0] = nil
		p.detached = p.detached[1:]
		p.detachedBytes -= n
		p.dropped += uint64(n)
	}
}

func dataLen(ev *processpb.ProcessEvent) int {
	d := ev.GetData()
	return len(d.GetStdout()) + len(d.GetStderr()) + len(d.GetPty())
}

// publish delivers ev to every current subscriber, blocking while a live
// subscriber's queue is full (backpressure), never after it unsubscribed.
// Without subscribers, data is kept for the next Connect when
// Config.DetachedOutputBytes is set, and dropped otherwise.
func (p *proc) publish(ev *processpb.ProcessEvent) {
	p.mu.Lock()
	if len(p.subs) == 0 {
		p.keepLocked(ev)
		p.mu.Unlock()
		return
	}
	subs := make([]*subscriber, 0, len(p.subs))
	for s := range p.subs {
		subs = append(subs, s)
	}
	p.mu.Unlock()
	for _, s := range subs {
		select {
		case s.ch <- ev:
			select {
			case <-s.done: // queued after the stream went away
				p.mu.Lock()
				p.rescueLocked(s)
				p.mu.Unlock()
			default:
			}
		case <-s.done:
			p.mu.Lock()
			if len(p.subs) == 0 {
				p.keepLocked(ev)
			}
			p.mu.Unlock()
		}
	}
}

// requeue puts kept output a Connect could not send back in front of the
// detached output, for the next Connect.
func (p *proc) requeue(evs []*processpb.ProcessEvent) {
	if len(evs) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	rest := p.detached
	p.detached, p.detachedBytes = nil, 0
	for _, ev := range append(append([]*processpb.ProcessEvent(nil), evs...), rest...) {
		p.keepLocked(ev)
	}
}

// finish publishes the end event and closes every subscriber queue. Called
// once, by the waiter, after all readers returned.
func (p *proc) finish(end *processpb.ProcessEvent) {
	p.publish(end)
	p.mu.Lock()
	p.end = end
	for s := range p.subs {
		close(s.ch)
	}
	p.mu.Unlock()
}

// signal sends sig to the process group of the process (the process leads
// its own group or session), falling back to the process itself.
func (p *proc) signal(sig syscall.Signal) error {
	if p.waited.Load() {
		return nil
	}
	if err := unix.Kill(-int(p.pid), sig); err == nil {
		return nil
	}
	err := p.cmd.Process.Signal(sig)
	if errors.Is(err, os.ErrProcessDone) {
		return nil
	}
	return err
}

func (p *proc) kill() { _ = p.signal(syscall.SIGKILL) }

func dataEvent(kind int, b []byte) *processpb.ProcessEvent {
	d := &processpb.ProcessEvent_DataEvent{}
	switch kind {
	case 1:
		d.Output = &processpb.ProcessEvent_DataEvent_Stdout{Stdout: b}
	case 2:
		d.Output = &processpb.ProcessEvent_DataEvent_Stderr{Stderr: b}
	default:
		d.Output = &processpb.ProcessEvent_DataEvent_Pty{Pty: b}
	}
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: d}}
}

func startEvent(pid uint32) *processpb.ProcessEvent {
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: pid}}}
}

func keepaliveEvent() *processpb.ProcessEvent {
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Keepalive{Keepalive: &processpb.ProcessEvent_KeepAlive{}}}
}

// readLoop publishes what f yields until EOF, an error, or the end of the
// process's stream (see waitProcess): a full drainGrace period without
// output after the process exited, or stop. It reports whether f may still
// have writers, i.e. it did not end at EOF or on an error.
func (p *proc) readLoop(f *os.File, kind int, stop *atomic.Bool) (open bool) {
	buf := make([]byte, readBufferSize)
	rearmed := false
	for {
		n, err := f.Read(buf)
		if n > 0 {
			rearmed = false
			p.publish(dataEvent(kind, bytes.Clone(buf[:n])))
		}
		if err != nil {
			if !errors.Is(err, os.ErrDeadlineExceeded) {
				return false
			}
			if !rearmed && !stop.Load() {
				// The deadline may have expired while we were publishing:
				// give buffered or still-arriving output one fresh period.
				rearmed = true
				if f.SetReadDeadline(time.Now().Add(drainGrace)) == nil {
					continue
				}
			}
			return true
		}
	}
}

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

// lookupProc finds a running process by selector.
func (s *Server) lookupProc(sel *processpb.ProcessSelector) (*proc, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch v := sel.GetSelector().(type) {
	case *processpb.ProcessSelector_Pid:
		if p, ok := s.procs[v.Pid]; ok {
			return p, nil
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", v.Pid))
	case *processpb.ProcessSelector_Tag:
		for _, p := range s.procs {
			if p.tag != nil && *p.tag == v.Tag {
				return p, nil
			}
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with tag %s not found", quote(v.Tag)))
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("process selector (pid or tag) is required"))
	}
}

// keepaliveInterval parses the Keepalive-Ping-Interval header (seconds).
func keepaliveInterval(h http.Header) time.Duration {
	v := strings.TrimSpace(h.Get(keepaliveHeader))
	if v == "" {
		return 0
	}
	n, err := strconv.ParseUint(v, 10, 32)
	if err != nil || n == 0 {
		return 0
	}
	return time.Duration(min(n, 3600)) * time.Second
}

// processTimeout is the Connect-Timeout-Ms of a Start request (0: none).
func processTimeout(h http.Header) time.Duration {
	n, err := strconv.ParseInt(h.Get("Connect-Timeout-Ms"), 10, 64)
	if err != nil || n <= 0 {
		return 0
	}
	return time.Duration(n) * time.Millisecond
}

// pump forwards a subscriber's events to a stream, with keepalives, until
// the end event was sent, the client went away or the server closes.
func (s *Server) pump(ctx context.Context, h http.Header, sub *subscriber, send func(*processpb.ProcessEvent) error) error {
	var tick <-chan time.Time
	if iv := keepaliveInterval(h); iv > 0 {
		t := time.NewTicker(iv)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case ev, ok := <-sub.ch:
			if !ok {
				return nil
			}
			if err := send(ev); err != nil {
				return err
			}
		case <-tick:
			if err := send(keepaliveEvent()); err != nil {
				return err
			}
		case <-ctx.Done():
			if s.ctx.Err() != nil {
				return errClosing
			}
			return connect.NewError(connect.CodeCanceled, ctx.Err())
		case <-s.ctx.Done():
			return errClosing
		}
	}
}

type processService struct{ s *Server }

func (ps *processService) Start(ctx context.Context, req *connect.Request[processpb.StartRequest], stream *connect.ServerStream[processpb.StartResponse]) error {
	p, sub, err := ps.s.startProcess(req.Header(), req.Msg)
	if err != nil {
		return err
	}
	defer p.unsubscribe(sub)
	if d := processTimeout(req.Header()); d > 0 {
		// The process outlives its stream, but not the timeout the client
		// gave it (e2b's commands.run timeoutMs): envd kills it then.
		p.deadline.Store(time.AfterFunc(d, p.kill))
	}
	send := func(ev *processpb.ProcessEvent) error { return stream.Send(&processpb.StartResponse{Event: ev}) }
	if err := send(startEvent(p.pid)); err != nil {
		return err
	}
	return ps.s.pump(ctx, req.Header(), sub, send)
}

func (ps *processService) Connect(ctx context.Context, req *connect.Request[processpb.ConnectRequest], stream *connect.ServerStream[processpb.ConnectResponse]) error {
	p, err := ps.s.lookupProc(req.Msg.GetProcess())
	if err != nil {
		return err
	}
	sub, end, kept, dropped := p.reattach()
	defer p.unsubscribe(sub)
	send := func(ev *processpb.ProcessEvent) error { return stream.Send(&processpb.ConnectResponse{Event: ev}) }
	if err := send(startEvent(p.pid)); err != nil {
		p.requeue(kept)
		return err
	}
	if dropped > 0 {
		ps.s.log.Warn("detached process output dropped", "pid", p.pid, "bytes", dropped)
	}
	for i, ev := range kept {
		if err := send(ev); err != nil {
			p.requeue(kept[i:])
			return err
		}
	}
	if end != nil {
		return send(end)
	}
	return ps.s.pump(ctx, req.Header(), sub, send)
}

func (ps *processService) List(context.Context, *connect.Request[processpb.ListRequest]) (*connect.Response[processpb.ListResponse], error) {
	ps.s.mu.Lock()
	defer ps.s.mu.Unlock()
	out := &processpb.ListResponse{}
	for _, p := range ps.s.procs {
		out.Processes = append(out.Processes, &processpb.ProcessInfo{Config: p.cfg, Pid: p.pid, Tag: p.tag})
	}
	sort.Slice(out.Processes, func(i, j int) bool { return out.Processes[i].Pid < out.Processes[j].Pid })
	return connect.NewResponse(out), nil
}

func (ps *processService) Update(_ context.Context, req *connect.Request[processpb.UpdateRequest]) (*connect.Response[processpb.UpdateResponse], error) {
	p, err := ps.s.lookupProc(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if req.Msg.GetPty() != nil {
		if p.pty == nil {
			return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("process has no pty"))
		}
		size := req.Msg.GetPty().GetSize()
		if size.GetCols() == 0 || size.GetRows() == 0 || size.GetCols() > 0xffff || size.GetRows() > 0xffff {
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("pty size must have cols and rows in 1..65535"))
		}
		if err := pty.Setsize(p.pty, &pty.Winsize{Cols: uint16(size.GetCols()), Rows: uint16(size.GetRows())}); err != nil {
			return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("error resizing pty: %w", err))
		}
	}
	return connect.NewResponse(&processpb.UpdateResponse{}), nil
}

// writeInput writes client input to the process's stdin pipe or PTY.
func writeInput(p *proc, in *processpb.ProcessInput) error {
	var (
		f    *os.File
		data []byte
	)
	switch v := in.GetInput().(type) {
	case *processpb.ProcessInput_Pty:
		if p.pty == nil {
			return connect.NewError(connect.CodeFailedPrecondition, errors.New("process has no pty"))
		}
		f, data = p.pty, v.Pty
	case *processpb.ProcessInput_Stdin:
		switch {
		case p.stdin != nil:
			f = p.stdin
		case p.pty != nil:
			f = p.pty // envd writes stdin of a PTY process to the PTY
		default:
			return connect.NewError(connect.CodeFailedPrecondition, errors.New("stdin is not enabled for this process"))
		}
		data = v.Stdin
	default:
		return connect.NewError(connect.CodeInvalidArgument, errors.New("input (stdin or pty) is required"))
	}
	if f == p.stdin && p.stdinClosed.Load() {
		return connect.NewError(connect.CodeFailedPrecondition, errors.New("stdin is closed"))
	}
	if _, err := f.Write(data); err != nil {
		if errors.Is(err, os.ErrClosed) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.EIO) {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process input is closed: %w", err))
		}
		return connect.NewError(connect.CodeInternal, fmt.Errorf("error writing input: %w", err))
	}
	return nil
}

func (ps *processService) SendInput(_ context.Context, req *connect.Request[processpb.SendInputRequest]) (*connect.Response[processpb.SendInputResponse], error) {
	p, err := ps.s.lookupProc(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := writeInput(p, req.Msg.GetInput()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.SendInputResponse{}), nil
}

func (ps *processService) StreamInput(ctx context.Context, stream *connect.ClientStream[processpb.StreamInputRequest]) (*connect.Response[processpb.StreamInputResponse], error) {
	var p *proc
	for stream.Receive() {
		switch ev := stream.Msg().GetEvent().(type) {
		case *processpb.StreamInputRequest_Start:
			if p != nil {
				return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("duplicate start event"))
			}
			var err error
			if p, err = ps.s.lookupProc(ev.Start.GetProcess()); err != nil {
				return nil, err
			}
		case *processpb.StreamInputRequest_Data:
			if p == nil {
				return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("first event must be start"))
			}
			if err := writeInput(p, ev.Data.GetInput()); err != nil {
				return nil, err
			}
		case *processpb.StreamInputRequest_Keepalive:
		default:
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("empty stream input event"))
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.StreamInputResponse{}), nil
}

func (ps *processService) SendSignal(_ context.Context, req *connect.Request[processpb.SendSignalRequest]) (*connect.Response[processpb.SendSignalResponse], error) {
	p, err := ps.s.lookupProc(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	var sig syscall.Signal
	switch req.Msg.GetSignal() {
	case processpb.Signal_SIGNAL_SIGKILL:
		sig = syscall.SIGKILL
	case processpb.Signal_SIGNAL_SIGTERM:
		sig = syscall.SIGTERM
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("unsupported signal %d", req.Msg.GetSignal()))
	}
	if err := p.signal(sig); err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("error sending signal: %w", err))
	}
	return connect.NewResponse(&processpb.SendSignalResponse{}), nil
}

func (ps *processService) CloseStdin(_ context.Context, req *connect.Request[processpb.CloseStdinRequest]) (*connect.Response[processpb.CloseStdinResponse], error) {
	p, err := ps.s.lookupProc(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if p.stdin == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("stdin is not enabled for this process"))
	}
	if p.stdinClosed.CompareAndSwap(false, true) {
		if err := p.stdin.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
			return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("error closing stdin: %w", err))
		}
	}
	return connect.NewResponse(&processpb.CloseStdinResponse{}), nil
}
