// Package sdktest is an in-memory fake of SPACE's public surface for tests
// of the SDK and its users (the CLI): an E2B-compatible control plane and a
// data-plane endpoint (what space-edge exposes) that serves envd's process
// and filesystem Connect services and /files from an in-memory file tree.
//
// The fake process runner understands a tiny command language:
//
//	echo ARGS...      prints ARGS to stdout, exits 0
//	fail N MSG...     prints MSG to stderr, exits N
//	env NAME          prints the value of NAME
//	pwd               prints the working directory
//	whoami            prints the user (from the Authorization header)
//	signal            ends without exiting (killed)
//
// "/bin/bash -l -c SCRIPT" runs SCRIPT split on spaces. A PTY echoes its
// input back and exits when it receives "exit".
package sdktest

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"path"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/spacesbx/space/api/e2bapi"
	filesystempb "github.com/spacesbx/space/api/envd/filesystem"
	"github.com/spacesbx/space/api/envd/filesystem/filesystempbconnect"
	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/envd/process/processpbconnect"
)

// APIKey is the key the fake control plane accepts.
const APIKey = "test-api-key"

// Sandbox is the fake's state for one sandbox.
type Sandbox struct {
	ID       string
	Template string
	Token    string // "" when not secure
	Metadata map[string]string
	EnvVars  map[string]string
	Timeout  int32
	Files    map[string][]byte
	// Resizes records PTY resizes as "rows x cols".
	Resizes []string
}

// Server is the fake. API and Edge are the control-plane and data-plane
// base URLs.
type Server struct {
	API  *httptest.Server
	Edge *httptest.Server

	mu        sync.Mutex
	sandboxes map[string]*Sandbox
	n         int
	ptys      map[uint32]chan []byte
	pid       uint32
}

// New starts a fake. Close it when done.
func New() *Server {
	s := &Server{sandboxes: map[string]*Sandbox{}, ptys: map[uint32]chan []byte{}}
	s.API = httptest.NewServer(http.HandlerFunc(s.serveAPI))
	mux := http.NewServeMux()
	mux.Handle(processpbconnect.NewProcessHandler(&proc{s: s}))
	mux.Handle(filesystempbconnect.NewFilesystemHandler(&fsys{s: s}))
	mux.HandleFunc("/files", s.serveFiles)
	s.Edge = httptest.NewServer(s.edgeAuth(mux))
	return s
}

// Close stops both servers.
func (s *Server) Close() {
	s.Edge.CloseClientConnections()
	s.Edge.Close()
	s.API.Close()
}

// Get returns a copy of a sandbox's state.
func (s *Server) Get(id string) (Sandbox, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sb, ok := s.sandboxes[id]
	if !ok {
		return Sandbox{}, false
	}
	c := *sb
	c.Files = map[string][]byte{}
	for k, v := range sb.Files {
		c.Files[k] = append([]byte(nil), v...)
	}
	c.Resizes = append([]string(nil), sb.Resizes...)
	return c, true
}

// PutFile stores a file in a sandbox.
func (s *Server) PutFile(id, p string, data []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sb, ok := s.sandboxes[id]; ok {
		sb.Files[path.Clean(p)] = data
	}
}

func writeErr(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(e2bapi.Error{Code: code, Message: msg})
}

func (s *Server) serveAPI(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get(e2bapi.HeaderAPIKey) != APIKey {
		writeErr(w, 401, "invalid API key")
		return
	}
	p := r.URL.Path
	switch {
	case r.Method == http.MethodPost && (p == "/v2/sandboxes" || p == "/sandboxes"):
		var ns e2bapi.NewSandbox
		if err := json.NewDecoder(r.Body).Decode(&ns); err != nil || ns.TemplateID == "" {
			writeErr(w, 400, "invalid body")
			return
		}
		if ns.TemplateID != "base" {
			writeErr(w, 404, "template "+ns.TemplateID+" not found")
			return
		}
		s.mu.Lock()
		s.n++
		sb := &Sandbox{ID: fmt.Sprintf("sbx%d", s.n), Template: ns.TemplateID, Metadata: ns.Metadata,
			EnvVars: ns.EnvVars, Files: map[string][]byte{}, Timeout: 300}
		if ns.Timeout != nil {
			sb.Timeout = *ns.Timeout
		}
		if p == "/v2/sandboxes" || (ns.Secure != nil && *ns.Secure) {
			sb.Token = "tok-" + sb.ID
		}
		s.sandboxes[sb.ID] = sb
		s.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(201)
		_ = json.NewEncoder(w).Encode(e2bapi.Sandbox{SandboxID: sb.ID, TemplateID: sb.Template, EnvdVersion: "0.5.0", EnvdAccessToken: sb.Token})
	case r.Method == http.MethodGet && p == "/v2/sandboxes":
		s.mu.Lock()
		ids := make([]string, 0, len(s.sandboxes))
		for id := range s.sandboxes {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		// Pages of 2 to exercise pagination.
		start := 0
		if t := r.URL.Query().Get("nextToken"); t != "" {
			start, _ = strconv.Atoi(t)
		}
		var out []e2bapi.ListedSandbox
		for i := start; i < len(ids) && i < start+2; i++ {
			sb := s.sandboxes[ids[i]]
			out = append(out, e2bapi.ListedSandbox{SandboxID: sb.ID, TemplateID: sb.Template, State: e2bapi.StateRunning,
				Metadata: sb.Metadata, StartedAt: time.Unix(0, 0).UTC()})
		}
		if start+2 < len(ids) {
			w.Header().Set(e2bapi.HeaderNextToken, strconv.Itoa(start+2))
		}
		s.mu.Unlock()
		if out == nil {
			out = []e2bapi.ListedSandbox{}
		}
		_ = json.NewEncoder(w).Encode(out)
	case strings.HasPrefix(p, "/sandboxes/"):
		rest := strings.TrimPrefix(p, "/sandboxes/")
		id, action, _ := strings.Cut(rest, "/")
		s.mu.Lock()
		sb, ok := s.sandboxes[id]
		s.mu.Unlock()
		if !ok {
			writeErr(w, 404, "sandbox "+id+" not found")
			return
		}
		switch {
		case r.Method == http.MethodGet && action == "":
			_ = json.NewEncoder(w).Encode(e2bapi.SandboxDetail{SandboxID: sb.ID, TemplateID: sb.Template,
				State: e2bapi.StateRunning, Metadata: sb.Metadata, EnvdAccessToken: sb.Token, EnvdVersion: "0.5.0"})
		case r.Method == http.MethodDelete && action == "":
			s.mu.Lock()
			delete(s.sandboxes, id)
			s.mu.Unlock()
			w.WriteHeader(204)
		case r.Method == http.MethodPost && action == "timeout":
			var tr e2bapi.TimeoutRequest
			if err := json.NewDecoder(r.Body).Decode(&tr); err != nil {
				writeErr(w, 400, "invalid body")
				return
			}
			s.mu.Lock()
			sb.Timeout = tr.Timeout
			s.mu.Unlock()
			w.WriteHeader(204)
		default:
			writeErr(w, 404, "not found")
		}
	default:
		writeErr(w, 404, "not found")
	}
}

type ctxKey struct{}

// edgeAuth checks sandbox addressing and the access token as space-edge
// and the control plane would, answering JSON {code, message} errors.
func (s *Server) edgeAuth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get("E2b-Sandbox-Id")
		if id == "" || r.Header.Get("E2b-Sandbox-Port") != "49983" {
			writeErr(w, 400, "sandbox id and port headers required")
			return
		}
		s.mu.Lock()
		sb, ok := s.sandboxes[id]
		s.mu.Unlock()
		if !ok {
			writeErr(w, 404, "sandbox "+id+" not found")
			return
		}
		if sb.Token != "" && r.Header.Get("X-Access-Token") != sb.Token {
			writeErr(w, 401, "invalid access token")
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), ctxKey{}, sb)))
	})
}

func sandboxOf(ctx context.Context) *Sandbox { return ctx.Value(ctxKey{}).(*Sandbox) }

func userOf(h http.Header) string {
	a := h.Get("Authorization")
	if !strings.HasPrefix(a, "Basic ") {
		return "user"
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(a, "Basic "))
	if err != nil {
		return "user"
	}
	u, _, _ := strings.Cut(string(raw), ":")
	return u
}

func (s *Server) serveFiles(w http.ResponseWriter, r *http.Request) {
	sb := sandboxOf(r.Context())
	p := r.URL.Query().Get("path")
	if p == "" {
		writeErr(w, 400, "path required")
		return
	}
	p = path.Clean(p)
	switch r.Method {
	case http.MethodGet:
		s.mu.Lock()
		data, ok := sb.Files[p]
		s.mu.Unlock()
		if !ok {
			writeErr(w, 404, "file "+p+" not found")
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		_, _ = w.Write(data)
	case http.MethodPost:
		_, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
		if err != nil || params["boundary"] == "" {
			writeErr(w, 400, "multipart body required")
			return
		}
		mr := multipart.NewReader(r.Body, params["boundary"])
		part, err := mr.NextPart()
		if err != nil || part.FormName() != "file" {
			writeErr(w, 400, "file part required")
			return
		}
		data, err := io.ReadAll(part)
		if err != nil {
			writeErr(w, 400, "reading upload")
			return
		}
		s.mu.Lock()
		sb.Files[p] = data
		s.mu.Unlock()
		_ = json.NewEncoder(w).Encode([]map[string]string{{"name": path.Base(p), "type": "file", "path": p}})
	default:
		writeErr(w, 405, "method not allowed")
	}
}

type fsys struct {
	filesystempbconnect.UnimplementedFilesystemHandler
	s *Server
}

func (f *fsys) ListDir(ctx context.Context, req *connect.Request[filesystempb.ListDirRequest]) (*connect.Response[filesystempb.ListDirResponse], error) {
	sb := sandboxOf(ctx)
	dir := path.Clean(req.Msg.GetPath())
	f.s.mu.Lock()
	defer f.s.mu.Unlock()
	seen := map[string]bool{}
	var out []*filesystempb.EntryInfo
	for p, data := range sb.Files {
		rel, ok := strings.CutPrefix(p, strings.TrimSuffix(dir, "/")+"/")
		if !ok {
			continue
		}
		name, sub, nested := strings.Cut(rel, "/")
		_ = sub
		if seen[name] {
			continue
		}
		seen[name] = true
		e := &filesystempb.EntryInfo{Name: name, Path: path.Join(dir, name), Type: filesystempb.FileType_FILE_TYPE_FILE,
			Size: int64(len(data)), Permissions: "-rw-r--r--", ModifiedTime: timestamppb.New(time.Unix(0, 0))}
		if nested {
			e.Type, e.Size, e.Permissions = filesystempb.FileType_FILE_TYPE_DIRECTORY, 0, "drwxr-xr-x"
		}
		out = append(out, e)
	}
	if len(out) == 0 && dir != "/" {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("directory %s not found", dir))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return connect.NewResponse(&filesystempb.ListDirResponse{Entries: out}), nil
}

type proc struct {
	processpbconnect.UnimplementedProcessHandler
	s *Server
}

func data(stdout, stderr string) *processpb.StartResponse {
	d := &processpb.ProcessEvent_DataEvent{}
	if stdout != "" {
		d.Output = &processpb.ProcessEvent_DataEvent_Stdout{Stdout: []byte(stdout)}
	} else {
		d.Output = &processpb.ProcessEvent_DataEvent_Stderr{Stderr: []byte(stderr)}
	}
	return &processpb.StartResponse{Event: &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: d}}}
}

func end(code int32, exited bool, status string) *processpb.StartResponse {
	return &processpb.StartResponse{Event: &processpb.ProcessEvent{Event: &processpb.ProcessEvent_End{
		End: &processpb.ProcessEvent_EndEvent{ExitCode: code, Exited: exited, Status: status}}}}
}

func (p *proc) Start(ctx context.Context, req *connect.Request[processpb.StartRequest], st *connect.ServerStream[processpb.StartResponse]) error {
	sb := sandboxOf(ctx)
	cfg := req.Msg.GetProcess()
	p.s.mu.Lock()
	p.s.pid++
	pid := p.s.pid
	var in chan []byte
	if req.Msg.GetPty() != nil {
		in = make(chan []byte, 16)
		p.s.ptys[pid] = in
	}
	p.s.mu.Unlock()
	if err := st.Send(&processpb.StartResponse{Event: &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{
		Start: &processpb.ProcessEvent_StartEvent{Pid: pid}}}}); err != nil {
		return err
	}
	if in != nil {
		defer func() {
			p.s.mu.Lock()
			delete(p.s.ptys, pid)
			p.s.mu.Unlock()
		}()
		for {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case b := <-in:
				if err := st.Send(&processpb.StartResponse{Event: &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{
					Data: &processpb.ProcessEvent_DataEvent{Output: &processpb.ProcessEvent_DataEvent_Pty{Pty: b}}}}}); err != nil {
					return err
				}
				if strings.Contains(string(b), "exit") {
					return st.Send(end(0, true, "exit status 0"))
				}
			}
		}
	}
	argv := append([]string{cfg.GetCmd()}, cfg.GetArgs()...)
	if len(argv) == 4 && argv[0] == "/bin/bash" && argv[1] == "-l" && argv[2] == "-c" {
		argv = strings.Fields(argv[3])
	}
	if len(argv) == 0 {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("empty command"))
	}
	send := func(r *processpb.StartResponse) error { return st.Send(r) }
	switch argv[0] {
	case "echo":
		if err := send(data(strings.Join(argv[1:], " ")+"\n", "")); err != nil {
			return err
		}
		return send(end(0, true, "exit status 0"))
	case "fail":
		code, _ := strconv.Atoi(argv[1])
		if err := send(data("", strings.Join(argv[2:], " ")+"\n")); err != nil {
			return err
		}
		return send(end(int32(code), true, fmt.Sprintf("exit status %d", code)))
	case "env":
		v := cfg.GetEnvs()[argv[1]]
		if v == "" {
			v = sb.EnvVars[argv[1]]
		}
		_ = send(data(v+"\n", ""))
		return send(end(0, true, "exit status 0"))
	case "pwd":
		_ = send(data(cfg.GetCwd()+"\n", ""))
		return send(end(0, true, "exit status 0"))
	case "whoami":
		_ = send(data(userOf(req.Header())+"\n", ""))
		return send(end(0, true, "exit status 0"))
	case "signal":
		return send(end(-1, false, "signal: killed"))
	}
	return send(end(127, true, "exit status 127"))
}

func (p *proc) SendInput(ctx context.Context, req *connect.Request[processpb.SendInputRequest]) (*connect.Response[processpb.SendInputResponse], error) {
	p.s.mu.Lock()
	in, ok := p.s.ptys[req.Msg.GetProcess().GetPid()]
	p.s.mu.Unlock()
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process not found"))
	}
	select {
	case in <- append([]byte(nil), req.Msg.GetInput().GetPty()...):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return connect.NewResponse(&processpb.SendInputResponse{}), nil
}

func (p *proc) Update(ctx context.Context, req *connect.Request[processpb.UpdateRequest]) (*connect.Response[processpb.UpdateResponse], error) {
	sb := sandboxOf(ctx)
	sz := req.Msg.GetPty().GetSize()
	p.s.mu.Lock()
	sb.Resizes = append(sb.Resizes, fmt.Sprintf("%dx%d", sz.GetRows(), sz.GetCols()))
	p.s.mu.Unlock()
	return connect.NewResponse(&processpb.UpdateResponse{}), nil
}

func (p *proc) SendSignal(ctx context.Context, req *connect.Request[processpb.SendSignalRequest]) (*connect.Response[processpb.SendSignalResponse], error) {
	return connect.NewResponse(&processpb.SendSignalResponse{}), nil
}
