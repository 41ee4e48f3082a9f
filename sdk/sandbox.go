package sdk

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/url"
	"strings"
	"time"

	"connectrpc.com/connect"

	filesystempb "github.com/spacesbx/space/api/envd/filesystem"
	"github.com/spacesbx/space/api/envd/filesystem/filesystempbconnect"
	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/envd/process/processpbconnect"
)

// EnvdPort is the guest agent's port, named in E2b-Sandbox-Port.
const EnvdPort = 49983

// Data-plane header names (E2B's).
const (
	HeaderSandboxID   = "E2b-Sandbox-Id"
	HeaderSandboxPort = "E2b-Sandbox-Port"
	HeaderAccessToken = "X-Access-Token"
)

// Sandbox is a handle for one sandbox's data plane, reached through the
// edge (Config.SandboxURL). It is safe for concurrent use.
type Sandbox struct {
	// ID is the sandbox id.
	ID string
	// AccessToken is the sandbox's envd access token ("" when not secure).
	AccessToken string

	c    *Client
	http *http.Client
	proc processpbconnect.ProcessClient
	fs   filesystempbconnect.FilesystemClient
}

func newSandbox(c *Client, id, token string) *Sandbox {
	base := c.http.Transport
	if base == nil {
		base = http.DefaultTransport
	}
	hc := &http.Client{
		Transport:     &sandboxTransport{base: base, id: id, token: token},
		CheckRedirect: c.http.CheckRedirect,
		Jar:           c.http.Jar,
	}
	s := &Sandbox{ID: id, AccessToken: token, c: c, http: hc}
	s.proc = processpbconnect.NewProcessClient(hc, c.cfg.SandboxURL, connect.WithProtoJSON())
	s.fs = filesystempbconnect.NewFilesystemClient(hc, c.cfg.SandboxURL, connect.WithProtoJSON())
	return s
}

// Kill kills the sandbox through the control plane.
func (s *Sandbox) Kill(ctx context.Context) error { return s.c.KillSandbox(ctx, s.ID) }

// SetTimeout sets the sandbox's remaining lifetime.
func (s *Sandbox) SetTimeout(ctx context.Context, d time.Duration) error {
	return s.c.SetTimeout(ctx, s.ID, d)
}

// sandboxTransport adds the sandbox addressing and access token to every
// request and turns HTTP-level JSON errors (from the edge, before any
// Connect handler ran) into errors that keep the server's message.
type sandboxTransport struct {
	base      http.RoundTripper
	id, token string
}

func (t *sandboxTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(HeaderSandboxID, t.id)
	r.Header.Set(HeaderSandboxPort, "49983")
	if t.token != "" {
		r.Header.Set(HeaderAccessToken, t.token)
	}
	res, err := t.base.RoundTrip(r)
	if err != nil || res.StatusCode == http.StatusOK || !isRPC(r.URL.Path) {
		return res, err
	}
	// A Connect error body has a string code; a SPACE/E2B one a number.
	raw, _ := io.ReadAll(io.LimitReader(res.Body, 64<<10))
	res.Body.Close()
	var w wireError
	if json.Unmarshal(raw, &w) == nil && w.Code != 0 {
		e := &Error{Status: res.StatusCode, kind: kindFor(res.StatusCode, w.Reason), Message: w.Message, Reason: w.Reason}
		if e.Message == "" {
			e.Message = http.StatusText(res.StatusCode)
		}
		return nil, connect.NewError(connect.CodeUnknown, e)
	}
	res.Body = io.NopCloser(bytes.NewReader(raw))
	return res, nil
}

func isRPC(p string) bool {
	return strings.HasPrefix(p, "/process.Process/") || strings.HasPrefix(p, "/filesystem.Filesystem/")
}

func basicUser(user string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"))
}

// RunOptions are the options of Run and Exec.
type RunOptions struct {
	// User runs the process as this sandbox user (default: the guest's).
	User string
	// Cwd is the working directory.
	Cwd string
	// Envs are extra environment variables.
	Envs map[string]string
	// Stdout and Stderr receive the process output as it arrives; nil
	// discards it.
	Stdout, Stderr io.Writer
}

// ProcessError reports a process that did not exit normally (killed by a
// signal, or failed to start); ExitCode is -1 in that case.
type ProcessError struct {
	Status  string
	Message string
}

func (e *ProcessError) Error() string {
	if e.Message != "" {
		return fmt.Sprintf("process ended (%s): %s", e.Status, e.Message)
	}
	return "process ended: " + e.Status
}

// Run runs cmd with "/bin/bash -l -c" (as the e2b SDKs do), streams its
// output and returns its exit code.
func (s *Sandbox) Run(ctx context.Context, cmd string, o RunOptions) (int, error) {
	return s.Exec(ctx, []string{"/bin/bash", "-l", "-c", cmd}, o)
}

// Exec runs argv directly (no shell), streams its output and returns its
// exit code. A process that ends without exiting normally returns -1 and a
// *ProcessError. A stream that ends before the process (for example when
// the sandbox's execution was replaced) returns an error wrapping
// ErrUnavailable.
func (s *Sandbox) Exec(ctx context.Context, argv []string, o RunOptions) (int, error) {
	if len(argv) == 0 || argv[0] == "" {
		return -1, &Error{kind: ErrBadRequest, Message: "empty command"}
	}
	cfg := &processpb.ProcessConfig{Cmd: argv[0], Args: argv[1:], Envs: o.Envs}
	if o.Cwd != "" {
		cfg.Cwd = &o.Cwd
	}
	req := connect.NewRequest(&processpb.StartRequest{Process: cfg})
	setUser(req.Header(), o.User)
	req.Header().Set("Keepalive-Ping-Interval", "50")
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := s.proc.Start(ctx, req)
	if err != nil {
		return -1, fromConnect(err)
	}
	defer stream.Close()
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		switch e := ev.GetEvent().(type) {
		case *processpb.ProcessEvent_Data:
			switch d := e.Data.GetOutput().(type) {
			case *processpb.ProcessEvent_DataEvent_Stdout:
				if err := write(o.Stdout, d.Stdout); err != nil {
					return -1, err
				}
			case *processpb.ProcessEvent_DataEvent_Stderr:
				if err := write(o.Stderr, d.Stderr); err != nil {
					return -1, err
				}
			case *processpb.ProcessEvent_DataEvent_Pty:
				if err := write(o.Stdout, d.Pty); err != nil {
					return -1, err
				}
			}
		case *processpb.ProcessEvent_End:
			return endResult(e.End)
		}
	}
	if err := stream.Err(); err != nil {
		return -1, fromConnect(err)
	}
	return -1, &Error{kind: ErrUnavailable, Message: "process stream ended before the process exited"}
}

func endResult(end *processpb.ProcessEvent_EndEvent) (int, error) {
	if end.GetExited() {
		return int(end.GetExitCode()), nil
	}
	return -1, &ProcessError{Status: end.GetStatus(), Message: end.GetError()}
}

func write(w io.Writer, b []byte) error {
	if w == nil || len(b) == 0 {
		return nil
	}
	_, err := w.Write(b)
	return err
}

func setUser(h http.Header, user string) {
	if user != "" {
		h.Set("Authorization", basicUser(user))
	}
}

// EntryInfo describes a file in the sandbox.
type EntryInfo struct {
	Name          string    `json:"name"`
	Path          string    `json:"path"`
	Type          string    `json:"type"` // "file", "dir", "symlink"
	Size          int64     `json:"size"`
	Mode          uint32    `json:"mode"`
	Permissions   string    `json:"permissions,omitempty"`
	Owner         string    `json:"owner,omitempty"`
	Group         string    `json:"group,omitempty"`
	ModTime       time.Time `json:"modified_time,omitzero"`
	SymlinkTarget string    `json:"symlink_target,omitempty"`
}

func entryFrom(e *filesystempb.EntryInfo) EntryInfo {
	out := EntryInfo{Name: e.GetName(), Path: e.GetPath(), Size: e.GetSize(), Mode: e.GetMode(),
		Permissions: e.GetPermissions(), Owner: e.GetOwner(), Group: e.GetGroup(), SymlinkTarget: e.GetSymlinkTarget()}
	switch e.GetType() {
	case filesystempb.FileType_FILE_TYPE_FILE:
		out.Type = "file"
	case filesystempb.FileType_FILE_TYPE_DIRECTORY:
		out.Type = "dir"
	case filesystempb.FileType_FILE_TYPE_SYMLINK:
		out.Type = "symlink"
	}
	if t := e.GetModifiedTime(); t != nil {
		out.ModTime = t.AsTime()
	}
	return out
}

// FileOptions are options of file operations.
type FileOptions struct {
	// User performs the operation as this sandbox user.
	User string
}

func fileUser(o []FileOptions) string {
	if len(o) > 0 {
		return o[0].User
	}
	return ""
}

// ListDir lists the directory at path (one level).
func (s *Sandbox) ListDir(ctx context.Context, path string, o ...FileOptions) ([]EntryInfo, error) {
	req := connect.NewRequest(&filesystempb.ListDirRequest{Path: path, Depth: 1})
	setUser(req.Header(), fileUser(o))
	res, err := s.fs.ListDir(ctx, req)
	if err != nil {
		return nil, fromConnect(err)
	}
	out := make([]EntryInfo, 0, len(res.Msg.GetEntries()))
	for _, e := range res.Msg.GetEntries() {
		out = append(out, entryFrom(e))
	}
	return out, nil
}

// Stat describes the file at path.
func (s *Sandbox) Stat(ctx context.Context, path string, o ...FileOptions) (*EntryInfo, error) {
	req := connect.NewRequest(&filesystempb.StatRequest{Path: path})
	setUser(req.Header(), fileUser(o))
	res, err := s.fs.Stat(ctx, req)
	if err != nil {
		return nil, fromConnect(err)
	}
	e := entryFrom(res.Msg.GetEntry())
	return &e, nil
}

func (s *Sandbox) filesURL(path, user string) string {
	q := url.Values{"path": {path}}
	if user != "" {
		q.Set("username", user)
	}
	return s.c.cfg.SandboxURL + "/files?" + q.Encode()
}

// ReadFileTo streams the file at path into w and returns the bytes copied.
func (s *Sandbox) ReadFileTo(ctx context.Context, path string, w io.Writer, o ...FileOptions) (int64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.filesURL(path, fileUser(o)), nil)
	if err != nil {
		return 0, err
	}
	res, err := s.http.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		return 0, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return 0, errorFromResponse(res)
	}
	return io.Copy(w, res.Body)
}

// ReadFile returns the content of the file at path.
func (s *Sandbox) ReadFile(ctx context.Context, path string, o ...FileOptions) ([]byte, error) {
	var b bytes.Buffer
	if _, err := s.ReadFileTo(ctx, path, &b, o...); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// WriteFile writes data to the file at path, creating parent directories.
// The body has a known length, so the edge can resend it after a route
// repair.
func (s *Sandbox) WriteFile(ctx context.Context, path string, data []byte, o ...FileOptions) (*EntryInfo, error) {
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	part, err := mw.CreateFormFile("file", path)
	if err != nil {
		return nil, err
	}
	_, _ = part.Write(data)
	if err := mw.Close(); err != nil {
		return nil, err
	}
	return s.upload(ctx, path, fileUser(o), mw.FormDataContentType(), &buf, int64(buf.Len()))
}

// WriteFileFrom streams r into the file at path (for large files; the
// upload is not retried).
func (s *Sandbox) WriteFileFrom(ctx context.Context, path string, r io.Reader, o ...FileOptions) (*EntryInfo, error) {
	pr, pw := io.Pipe()
	mw := multipart.NewWriter(pw)
	go func() {
		part, err := mw.CreateFormFile("file", path)
		if err == nil {
			_, err = io.Copy(part, r)
		}
		if err == nil {
			err = mw.Close()
		}
		pw.CloseWithError(err)
	}()
	defer pr.Close()
	return s.upload(ctx, path, fileUser(o), mw.FormDataContentType(), pr, -1)
}

func (s *Sandbox) upload(ctx context.Context, path, user, ctype string, body io.Reader, n int64) (*EntryInfo, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.filesURL(path, user), body)
	if err != nil {
		return nil, err
	}
	req.ContentLength = n
	req.Header.Set("Content-Type", ctype)
	res, err := s.http.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return nil, errorFromResponse(res)
	}
	var infos []struct {
		Name string `json:"name"`
		Type string `json:"type"`
		Path string `json:"path"`
	}
	raw, _ := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	if err := json.Unmarshal(raw, &infos); err != nil || len(infos) == 0 {
		return &EntryInfo{Path: path, Type: "file"}, nil
	}
	return &EntryInfo{Name: infos[0].Name, Type: infos[0].Type, Path: infos[0].Path}, nil
}

var errClosed = errors.New("pty closed")
