package guest

// The process.Process Connect service (envd's process API): it starts and
// finds processes, pumps their events to streams and passes input and
// signals.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/creack/pty"

	processpb "github.com/spacesbx/space/api/envd/process"
)

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
