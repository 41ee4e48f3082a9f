package sdk

import (
	"context"
	"io"
	"sync"
	"time"

	"connectrpc.com/connect"

	processpb "github.com/spacesbx/space/api/envd/process"
)

// PTYOptions are the options of Sandbox.PTY.
type PTYOptions struct {
	// Cmd and Args default to an interactive login bash ("/bin/bash -i -l").
	Cmd  string
	Args []string
	User string
	Cwd  string
	// Envs are added to TERM=xterm-256color, LANG=C.UTF-8, LC_ALL=C.UTF-8.
	Envs map[string]string
}

// PTY is an interactive terminal in a sandbox. Read returns its output,
// Write sends input; Resize changes its size. It is an io.ReadWriteCloser.
type PTY struct {
	// PID is the process id inside the sandbox.
	PID uint32

	s      *Sandbox
	ctx    context.Context
	cancel context.CancelFunc
	out    *io.PipeReader
	done   chan struct{}

	mu       sync.Mutex
	exitCode int
	err      error
	once     sync.Once
}

// PTY starts a terminal of rows x cols. The terminal lives until its
// process exits, Close is called or ctx is done.
func (s *Sandbox) PTY(ctx context.Context, rows, cols uint32, opts ...PTYOptions) (*PTY, error) {
	var o PTYOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	if o.Cmd == "" {
		o.Cmd, o.Args = "/bin/bash", []string{"-i", "-l"}
	}
	envs := map[string]string{"TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
	for k, v := range o.Envs {
		envs[k] = v
	}
	cfg := &processpb.ProcessConfig{Cmd: o.Cmd, Args: o.Args, Envs: envs}
	if o.Cwd != "" {
		cfg.Cwd = &o.Cwd
	}
	req := connect.NewRequest(&processpb.StartRequest{
		Process: cfg,
		Pty:     &processpb.PTY{Size: &processpb.PTY_Size{Rows: rows, Cols: cols}},
	})
	setUser(req.Header(), o.User)
	req.Header().Set("Keepalive-Ping-Interval", "50")
	sctx, cancel := context.WithCancel(ctx)
	stream, err := s.proc.Start(sctx, req)
	if err != nil {
		cancel()
		return nil, fromConnect(err)
	}
	// The first event names the process.
	var pid uint32
	for pid == 0 {
		if !stream.Receive() {
			err := stream.Err()
			stream.Close()
			cancel()
			if err == nil {
				return nil, &Error{kind: ErrUnavailable, Message: "terminal stream ended before the process started"}
			}
			return nil, fromConnect(err)
		}
		if st := stream.Msg().GetEvent().GetStart(); st != nil {
			pid = st.GetPid()
		}
	}
	pr, pw := io.Pipe()
	p := &PTY{PID: pid, s: s, ctx: sctx, cancel: cancel, out: pr, done: make(chan struct{}), exitCode: -1}
	go func() {
		defer close(p.done)
		defer stream.Close()
		var end error = &Error{kind: ErrUnavailable, Message: "terminal stream ended before the process exited"}
		for stream.Receive() {
			ev := stream.Msg().GetEvent()
			if d := ev.GetData(); d != nil {
				b := d.GetPty()
				if b == nil {
					b = d.GetStdout()
				}
				if len(b) > 0 {
					if _, err := pw.Write(b); err != nil {
						end = err
						break
					}
				}
			}
			if e := ev.GetEnd(); e != nil {
				code, err := endResult(e)
				p.mu.Lock()
				p.exitCode = code
				p.mu.Unlock()
				end = err
				pw.Close()
				p.setErr(err)
				return
			}
		}
		if err := stream.Err(); err != nil {
			end = fromConnect(err)
		}
		p.setErr(end)
		pw.CloseWithError(end)
	}()
	return p, nil
}

func (p *PTY) setErr(err error) {
	p.mu.Lock()
	p.err = err
	p.mu.Unlock()
}

// Read reads terminal output. It returns io.EOF once the process exited.
func (p *PTY) Read(b []byte) (int, error) { return p.out.Read(b) }

// Write sends input to the terminal.
func (p *PTY) Write(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	select {
	case <-p.done:
		return 0, errClosed
	default:
	}
	in := append([]byte(nil), b...)
	_, err := p.s.proc.SendInput(p.ctx, connect.NewRequest(&processpb.SendInputRequest{
		Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: p.PID}},
		Input:   &processpb.ProcessInput{Input: &processpb.ProcessInput_Pty{Pty: in}},
	}))
	if err != nil {
		return 0, fromConnect(err)
	}
	return len(b), nil
}

// Resize changes the terminal size.
func (p *PTY) Resize(ctx context.Context, rows, cols uint32) error {
	_, err := p.s.proc.Update(ctx, connect.NewRequest(&processpb.UpdateRequest{
		Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: p.PID}},
		Pty:     &processpb.PTY{Size: &processpb.PTY_Size{Rows: rows, Cols: cols}},
	}))
	return fromConnect(err)
}

// Done is closed when the terminal's output stream has ended.
func (p *PTY) Done() <-chan struct{} { return p.done }

// Wait blocks until the process exits (or the stream ends) and returns its
// exit code.
func (p *PTY) Wait() (int, error) {
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exitCode, p.err
}

// Close kills the terminal's process (if still running) and ends the
// stream.
func (p *PTY) Close() error {
	p.once.Do(func() {
		select {
		case <-p.done:
		default:
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, _ = p.s.proc.SendSignal(ctx, connect.NewRequest(&processpb.SendSignalRequest{
				Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: p.PID}},
				Signal:  processpb.Signal_SIGNAL_SIGKILL,
			}))
			cancel()
		}
		p.cancel()
		_ = p.out.Close()
		<-p.done
	})
	return nil
}
