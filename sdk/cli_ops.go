package sdk

// Lifecycle, observation and process-control calls the `space` CLI uses
// (and any Go client may): pause, resume/connect, snapshot, fork, migrate,
// metrics over time, sandbox logs, and a process handle with stdin and
// signals.

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/spacesbx/space/api/e2bapi"
	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/spacev1"
)

func sandboxPath(id string, sub string) (string, error) {
	if err := checkID(id); err != nil {
		return "", err
	}
	return "/sandboxes/" + url.PathEscape(id) + sub, nil
}

func seconds(d time.Duration) *int32 {
	if d <= 0 {
		return nil
	}
	s := int32((d + time.Second - 1) / time.Second)
	return &s
}

// PauseSandbox pauses a running sandbox (POST /sandboxes/{id}/pause). A
// sandbox that is not running is ErrConflict.
func (c *Client) PauseSandbox(ctx context.Context, id string) error {
	p, err := sandboxPath(id, "/pause")
	if err != nil {
		return err
	}
	return c.rest(ctx, http.MethodPost, p, struct{}{}, nil, nil)
}

// ResumeSandbox resumes a paused sandbox for timeout (zero: the server's
// default) with POST /sandboxes/{id}/resume. A sandbox that is not paused
// is ErrConflict.
func (c *Client) ResumeSandbox(ctx context.Context, id string, timeout time.Duration) (*Sandbox, error) {
	p, err := sandboxPath(id, "/resume")
	if err != nil {
		return nil, err
	}
	var out e2bapi.Sandbox
	if err := c.rest(ctx, http.MethodPost, p, struct {
		Timeout *int32 `json:"timeout,omitempty"`
	}{seconds(timeout)}, &out, nil); err != nil {
		return nil, err
	}
	return c.Attach(id, out.EnvdAccessToken), nil
}

// ConnectSandbox is E2B's connect (POST /v2/sandboxes/{id}/connect): a
// running sandbox's timeout is extended to timeout (zero: the server's
// default), a paused one is resumed first. resumed reports the latter.
func (c *Client) ConnectSandbox(ctx context.Context, id string, timeout time.Duration) (sbx *Sandbox, resumed bool, err error) {
	if err := checkID(id); err != nil {
		return nil, false, err
	}
	var out e2bapi.Sandbox
	status := 0
	if err := c.restStatus(ctx, http.MethodPost, "/v2/sandboxes/"+url.PathEscape(id)+"/connect", struct {
		Timeout *int32 `json:"timeout,omitempty"`
	}{seconds(timeout)}, &out, nil, &status); err != nil {
		return nil, false, err
	}
	return c.Attach(id, out.EnvdAccessToken), status == http.StatusCreated, nil
}

// restStatus is rest that also reports the success status (connect
// answers 201 when it resumed, 200 otherwise), recorded by a transport
// around the client's.
func (c *Client) restStatus(ctx context.Context, method, path string, in, out any, hdr *http.Header, status *int) error {
	rt := c.http.Transport
	if rt == nil {
		rt = http.DefaultTransport
	}
	hc := *c.http
	hc.Transport = statusRecorder{rt, status}
	return (&Client{cfg: c.cfg, http: &hc, apis: c.apis}).rest(ctx, method, path, in, out, hdr)
}

type statusRecorder struct {
	base   http.RoundTripper
	status *int
}

func (s statusRecorder) RoundTrip(r *http.Request) (*http.Response, error) {
	res, err := s.base.RoundTrip(r)
	if err == nil {
		*s.status = res.StatusCode
	}
	return res, err
}

// SnapshotInfo names a persistent snapshot (E2B's SnapshotInfo).
type SnapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

// CreateSnapshot archives the sandbox's state into a persistent snapshot
// (POST /sandboxes/{id}/snapshots); name may be empty.
func (c *Client) CreateSnapshot(ctx context.Context, id, name string) (*SnapshotInfo, error) {
	p, err := sandboxPath(id, "/snapshots")
	if err != nil {
		return nil, err
	}
	var out SnapshotInfo
	if err := c.rest(ctx, http.MethodPost, p, struct {
		Name string `json:"name,omitempty"`
	}{name}, &out, nil); err != nil {
		return nil, err
	}
	return &out, nil
}

// ForkResult is one fork: exactly one of Sandbox (the new sandbox) and
// Error is set.
type ForkResult struct {
	Sandbox *e2bapi.Sandbox `json:"sandbox,omitempty"`
	Error   *e2bapi.Error   `json:"error,omitempty"`
}

// ForkSandbox creates count sandboxes from the sandbox's current state
// (POST /sandboxes/{id}/fork), each living timeout (zero: the server's
// default).
func (c *Client) ForkSandbox(ctx context.Context, id string, count int, timeout time.Duration) ([]ForkResult, error) {
	p, err := sandboxPath(id, "/fork")
	if err != nil {
		return nil, err
	}
	body := struct {
		Count   *int   `json:"count,omitempty"`
		Timeout *int32 `json:"timeout,omitempty"`
	}{Timeout: seconds(timeout)}
	if count > 0 {
		body.Count = &count
	}
	var out []ForkResult
	if err := c.rest(ctx, http.MethodPost, p, body, &out, nil); err != nil {
		return nil, err
	}
	return out, nil
}

// MigrateSandbox moves a sandbox to another worker (SPACE's POST
// /space/v1/sandboxes/{id}/migrate); target "" lets the scheduler pick.
func (c *Client) MigrateSandbox(ctx context.Context, id, target string) (*spacev1.MigrateResponse, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	var out spacev1.MigrateResponse
	if err := c.rest(ctx, http.MethodPost, "/space/v1/sandboxes/"+url.PathEscape(id)+"/migrate",
		spacev1.MigrateRequest{TargetWorker: target}, &out, nil); err != nil {
		return nil, err
	}
	return &out, nil
}

// SandboxMetrics returns the sandbox's metric samples between start and
// end (zero: open), oldest first (GET /sandboxes/{id}/metrics).
func (c *Client) SandboxMetrics(ctx context.Context, id string, start, end time.Time) ([]e2bapi.SandboxMetric, error) {
	p, err := sandboxPath(id, "/metrics")
	if err != nil {
		return nil, err
	}
	q := url.Values{}
	if !start.IsZero() {
		q.Set("start", strconv.FormatInt(start.Unix(), 10))
	}
	if !end.IsZero() {
		q.Set("end", strconv.FormatInt(end.Unix(), 10))
	}
	if len(q) > 0 {
		p += "?" + q.Encode()
	}
	out := []e2bapi.SandboxMetric{}
	if err := c.rest(ctx, http.MethodGet, p, nil, &out, nil); err != nil {
		return nil, err
	}
	return out, nil
}

// LogEntry is E2B's SandboxLogEntry.
type LogEntry struct {
	Timestamp time.Time         `json:"timestamp"`
	Level     string            `json:"level"`
	Message   string            `json:"message"`
	Fields    map[string]string `json:"fields"`
}

// LogsQuery selects sandbox log lines (E2B's /v2/sandboxes/{id}/logs
// query).
type LogsQuery struct {
	// Cursor is the timestamp to start from (zero: the beginning, or the
	// end for Backward).
	Cursor time.Time
	// Limit bounds the number of lines (zero: the server's default).
	Limit int
	// Backward returns lines older than Cursor, newest first.
	Backward bool
	// Level is the minimum level ("debug", "info", "warn", "error").
	Level string
	// Search is a case-sensitive substring of the message.
	Search string
}

// ErrNoLogsAPI means the server has no sandbox logs route at all (an older
// SPACE), as opposed to an unknown sandbox.
var ErrNoLogsAPI = errors.New("this server has no sandbox logs API")

// SandboxLogs returns sandbox log lines (GET /v2/sandboxes/{id}/logs).
func (c *Client) SandboxLogs(ctx context.Context, id string, q LogsQuery) ([]LogEntry, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	v := url.Values{}
	if !q.Cursor.IsZero() {
		v.Set("cursor", strconv.FormatInt(q.Cursor.UnixMilli(), 10))
	}
	if q.Limit > 0 {
		v.Set("limit", strconv.Itoa(q.Limit))
	}
	if q.Backward {
		v.Set("direction", "backward")
	} else {
		v.Set("direction", "forward")
	}
	if q.Level != "" {
		v.Set("level", q.Level)
	}
	if q.Search != "" {
		v.Set("search", q.Search)
	}
	var out struct {
		Logs []LogEntry `json:"logs"`
	}
	err := c.rest(ctx, http.MethodGet, "/v2/sandboxes/"+url.PathEscape(id)+"/logs?"+v.Encode(), nil, &out, nil)
	var se *Error
	if errors.As(err, &se) && se.Status == http.StatusNotFound && isNoRoute(se.Message) {
		return nil, ErrNoLogsAPI
	}
	if err != nil {
		return nil, err
	}
	if out.Logs == nil {
		out.Logs = []LogEntry{}
	}
	return out.Logs, nil
}

// isNoRoute recognises the control plane's answer for a path it has no
// handler for (its catch-all route), as opposed to an unknown object.
func isNoRoute(msg string) bool {
	return strings.Contains(msg, "no route for ") || strings.Contains(msg, "404 page not found")
}

// Signal is a signal the guest agent delivers (envd supports these two).
type Signal int

// Signals SendSignal knows.
const (
	SIGTERM Signal = 15
	SIGKILL Signal = 9
)

// Process is a command started with Start: its output streams to the
// RunOptions writers while it runs; input and signals go to it by pid.
type Process struct {
	// PID is the process id inside the sandbox.
	PID uint32

	s      *Sandbox
	cancel context.CancelFunc
	done   chan struct{}

	mu   sync.Mutex
	code int
	err  error
}

// StartOptions are Start's options: RunOptions plus Stdin, which gives
// the process a stdin pipe fed by SendStdin (E2B's stdin: true).
type StartOptions struct {
	RunOptions
	Stdin bool
}

// Start starts argv (no shell) and returns once the process runs. Its
// output is written to o.Stdout/o.Stderr from a goroutine owned by the
// Process (Wait waits for it). The process stream is not bound to ctx
// after Start returns, so a caller can still signal the process and read
// its end after ctx is done; Close ends the stream.
func (s *Sandbox) Start(ctx context.Context, argv []string, o StartOptions) (*Process, error) {
	if len(argv) == 0 || argv[0] == "" {
		return nil, &Error{kind: ErrBadRequest, Message: "empty command"}
	}
	cfg := &processpb.ProcessConfig{Cmd: argv[0], Args: argv[1:], Envs: o.Envs}
	if o.Cwd != "" {
		cfg.Cwd = &o.Cwd
	}
	req := connect.NewRequest(&processpb.StartRequest{Process: cfg})
	if o.Stdin {
		req.Msg.Stdin = &o.Stdin
	}
	setUser(req.Header(), o.User)
	req.Header().Set("Keepalive-Ping-Interval", "50")
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancel) // only until started
	stream, err := s.proc.Start(sctx, req)
	if err != nil {
		stop()
		cancel()
		return nil, fromConnect(err)
	}
	var pid uint32
	for pid == 0 {
		if !stream.Receive() {
			err := stream.Err()
			stream.Close()
			stop()
			cancel()
			if err == nil {
				return nil, &Error{kind: ErrUnavailable, Message: "process stream ended before the process started"}
			}
			return nil, fromConnect(err)
		}
		if st := stream.Msg().GetEvent().GetStart(); st != nil {
			pid = st.GetPid()
		}
	}
	if !stop() {
		stream.Close()
		cancel()
		return nil, ctx.Err()
	}
	p := &Process{PID: pid, s: s, cancel: cancel, done: make(chan struct{}), code: -1}
	go func() {
		defer close(p.done)
		defer stream.Close()
		var end error = &Error{kind: ErrUnavailable, Message: "process stream ended before the process exited"}
		code, ended := -1, false
	loop:
		for stream.Receive() {
			ev := stream.Msg().GetEvent()
			switch e := ev.GetEvent().(type) {
			case *processpb.ProcessEvent_Data:
				switch d := e.Data.GetOutput().(type) {
				case *processpb.ProcessEvent_DataEvent_Stdout:
					_ = write(o.Stdout, d.Stdout)
				case *processpb.ProcessEvent_DataEvent_Stderr:
					_ = write(o.Stderr, d.Stderr)
				case *processpb.ProcessEvent_DataEvent_Pty:
					_ = write(o.Stdout, d.Pty)
				}
			case *processpb.ProcessEvent_End:
				code, end = endResult(e.End)
				ended = true
				break loop
			}
		}
		if !ended {
			if err := stream.Err(); err != nil {
				end = fromConnect(err)
			}
		}
		p.mu.Lock()
		p.code, p.err = code, end
		p.mu.Unlock()
	}()
	return p, nil
}

func (p *Process) selector() *processpb.ProcessSelector {
	return &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: p.PID}}
}

// SendStdin writes b to the process's stdin (Start with Stdin).
func (p *Process) SendStdin(ctx context.Context, b []byte) error {
	if len(b) == 0 {
		return nil
	}
	_, err := p.s.proc.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{
		Process: p.selector(),
		Input:   &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: append([]byte(nil), b...)}},
	}))
	return fromConnect(err)
}

// CloseStdin closes the process's stdin: it reads end of file.
func (p *Process) CloseStdin(ctx context.Context) error {
	_, err := p.s.proc.CloseStdin(ctx, connect.NewRequest(&processpb.CloseStdinRequest{Process: p.selector()}))
	return fromConnect(err)
}

// Signal sends sig to the process.
func (p *Process) Signal(ctx context.Context, sig Signal) error {
	s := processpb.Signal_SIGNAL_SIGTERM
	if sig == SIGKILL {
		s = processpb.Signal_SIGNAL_SIGKILL
	}
	_, err := p.s.proc.SendSignal(ctx, connect.NewRequest(&processpb.SendSignalRequest{Process: p.selector(), Signal: s}))
	return fromConnect(err)
}

// Done is closed once the process's stream has ended.
func (p *Process) Done() <-chan struct{} { return p.done }

// Wait waits for the process to end and returns its exit code; a process
// that did not exit normally returns -1 and a *ProcessError.
func (p *Process) Wait() (int, error) {
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.code, p.err
}

// Close ends the process stream (not the process) and waits for the
// output goroutine.
func (p *Process) Close() error {
	p.cancel()
	<-p.done
	return nil
}
