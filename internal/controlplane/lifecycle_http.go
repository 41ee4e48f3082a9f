package controlplane

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// lifecycleRoutes mounts the lifecycle, snapshot and key-rotation routes.
func (s *Server) lifecycleRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /sandboxes/{id}/pause", s.withKey(s.handlePause))
	mux.HandleFunc("POST /sandboxes/{id}/resume", s.withKey(s.handleResume))
	mux.HandleFunc("POST /sandboxes/{id}/connect", s.withKey(func(w http.ResponseWriter, r *http.Request, c caller) { s.handleConnect(w, r, c, false) }))
	mux.HandleFunc("POST /v2/sandboxes/{id}/connect", s.withKey(func(w http.ResponseWriter, r *http.Request, c caller) { s.handleConnect(w, r, c, true) }))
	mux.HandleFunc("POST /sandboxes/{id}/snapshots", s.withKey(s.handleCreateSnapshot))
	mux.HandleFunc("GET /snapshots", s.withKey(s.handleListSnapshots))
	mux.HandleFunc("POST /space/v1/sandboxes/{id}/migrate", s.withKey(s.handleMigrate))
	mux.HandleFunc("POST /space/v1/keys/rotate", s.withKey(s.handleRotate))
}

// E2B defaults for the resume timeouts (seconds).
const (
	resumeDefaultTimeout = 15 // POST /sandboxes/{id}/resume (ResumedSandbox.timeout)
	// connect v2's default is the server's DefaultTimeout (300 s).
	// connectJoinWait bounds how long a connect waits for an operation in
	// flight to end before answering 409.
	connectJoinWait = 2 * time.Minute
)

// decodeOptionalJSON decodes a body that may be absent or empty.
func decodeOptionalJSON(w http.ResponseWriter, r *http.Request, v any) error {
	body := http.MaxBytesReader(w, r.Body, MaxBodyBytes)
	defer body.Close()
	data, err := io.ReadAll(body)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return fmt.Errorf("request body %w: body exceeds %d bytes", errdefs.ErrTooLarge, mbe.Limit)
		}
		return fmt.Errorf("%w: reading body: %v", errdefs.ErrInvalid, err)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return nil
	}
	return decodeReader(bytes.NewReader(data), v, false)
}

// ttl validates a timeout in seconds (nil: def).
func (s *Server) ttl(secs *int32, def time.Duration) (time.Duration, error) {
	if secs == nil {
		return def, nil
	}
	d := time.Duration(*secs) * time.Second
	if *secs <= 0 || d > s.cfg.MaxTimeout {
		return 0, fmt.Errorf("%w: timeout must be 1..%d seconds", errdefs.ErrInvalid, int64(s.cfg.MaxTimeout/time.Second))
	}
	return d, nil
}

// e2bState is the state E2B clients see: a record in a transitional state
// shows the stable state its operation started from.
func e2bState(rec store.SandboxRecord) string {
	if rec.Op != nil {
		return string(rec.Op.From)
	}
	return string(rec.State)
}

// sandboxBody is the E2B Sandbox answer for an existing sandbox.
func (s *Server) sandboxBody(rec store.SandboxRecord) e2bapi.Sandbox {
	var traffic *string
	if rec.TrafficAccessToken != "" {
		traffic = &rec.TrafficAccessToken
	}
	return e2bapi.Sandbox{
		SandboxID: rec.ID, TemplateID: rec.TemplateID, Alias: rec.Alias, ClientID: clientID,
		EnvdVersion: rec.EnvdVersion, EnvdAccessToken: rec.AccessToken, Domain: s.domain(),
		TrafficAccessToken: traffic,
	}
}

func (s *Server) handlePause(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	// memory:false asks for a filesystem-only pause; the ns substrate's
	// freezer keeps the processes anyway, which is more than asked.
	var req struct {
		Memory *bool `json:"memory"`
	}
	if err := decodeOptionalJSON(w, r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.pauseSandbox(r.Context(), id, c.TeamID, nil); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// handleResume is E2B's deprecated POST /sandboxes/{id}/resume: 201 with
// the sandbox, 409 when it is not paused.
func (s *Server) handleResume(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req struct {
		Timeout   *int32 `json:"timeout"`
		AutoPause *bool  `json:"autoPause"`
		Memory    *bool  `json:"memory"`
	}
	if err := decodeOptionalJSON(w, r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	d, err := s.ttl(req.Timeout, resumeDefaultTimeout*time.Second)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if _, err := s.getSandbox(r.Context(), c, id); err != nil {
		s.writeError(w, r, err)
		return
	}
	rec, _, err := s.resumeSandbox(r.Context(), id, c.TeamID, resumeOpts{
		Timeout: d, Restart: req.Memory != nil && !*req.Memory, AutoPause: req.AutoPause,
	})
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, s.sandboxBody(rec))
}

// handleConnect is E2B's connect (v1 and v2): a running sandbox gets its
// timeout extended (never shortened) and 200; a paused one is resumed and
// answers 201. A connect that meets another lifecycle operation joins it:
// it waits for the operation to end and acts on the outcome.
func (s *Server) handleConnect(w http.ResponseWriter, r *http.Request, c caller, v2 bool) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req struct {
		Timeout *int32 `json:"timeout"`
		Memory  *bool  `json:"memory"`
	}
	if err := decodeOptionalJSON(w, r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if !v2 && req.Timeout == nil {
		s.writeError(w, r, fmt.Errorf("%w: timeout is required", errdefs.ErrInvalid))
		return
	}
	d, err := s.ttl(req.Timeout, s.cfg.DefaultTimeout)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	rec, resumed, err := s.connectSandbox(r.Context(), c, id, d, req.Memory != nil && !*req.Memory)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	code := http.StatusOK
	if resumed {
		code = http.StatusCreated
	}
	writeJSON(w, code, s.sandboxBody(rec))
}

func (s *Server) connectSandbox(ctx context.Context, c caller, id string, d time.Duration, restart bool) (store.SandboxRecord, bool, error) {
	deadline := time.Now().Add(connectJoinWait)
	for {
		rec, err := s.getSandbox(ctx, c, id)
		if err != nil {
			return rec, false, err
		}
		switch {
		case rec.State.Transitional():
			if time.Now().After(deadline) {
				return rec, false, fmt.Errorf("%w: sandbox %s: a %s operation is still in progress", errBusy, id, rec.Op.Kind)
			}
			if _, err := s.waitSettled(ctx, id, time.Until(deadline)); err != nil {
				return rec, false, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
			}
			continue
		case rec.State == store.StateRunning:
			end := s.now().UTC().Add(d)
			rec, _, err = s.st.MutateSandbox(ctx, id, func(r *store.SandboxRecord) error {
				if !visible(*r, c.TeamID) {
					return fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
				}
				if r.State != store.StateRunning {
					return fmt.Errorf("%w: sandbox %s is %s", errBusy, id, r.State)
				}
				if end.After(r.EndAt) {
					r.EndAt = end
				}
				return nil
			})
			if errors.Is(err, errBusy) && time.Now().Before(deadline) {
				continue
			}
			if errors.Is(err, errdefs.ErrNotFound) {
				err = fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
			}
			return rec, false, err
		case rec.State == store.StatePaused:
			rec, _, err = s.resumeSandbox(ctx, id, c.TeamID, resumeOpts{Timeout: d, Restart: restart})
			if errors.Is(err, errdefs.ErrConflict) && time.Now().Before(deadline) {
				// Another operation (or a resume) got in first: join it.
				continue
			}
			return rec, err == nil, err
		default:
			return rec, false, fmt.Errorf("%w: sandbox %s is %s", errdefs.ErrConflict, id, rec.State)
		}
	}
}

func (s *Server) handleMigrate(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req spacev1.MigrateRequest
	if err := decodeOptionalJSON(w, r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if _, err := s.getSandbox(r.Context(), c, id); err != nil {
		s.writeError(w, r, err)
		return
	}
	_, out, err := s.migrateSandbox(r.Context(), id, c.TeamID, req.TargetWorker)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// ---- snapshots ----

// SnapshotInfo is E2B's SnapshotInfo.
type SnapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

var snapshotNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)

func snapshotInfo(r store.SnapshotRecord) SnapshotInfo {
	names := r.Names
	if names == nil {
		names = []string{}
	}
	return SnapshotInfo{SnapshotID: r.ID, Names: names}
}

func (s *Server) handleCreateSnapshot(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req struct {
		Name string `json:"name"`
	}
	if err := decodeOptionalJSON(w, r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.Name != "" && !snapshotNameRE.MatchString(req.Name) {
		s.writeError(w, r, fmt.Errorf("%w: snapshot name must be 1..63 lowercase letters, digits, '.', '_' or '-'", errdefs.ErrInvalid))
		return
	}
	if req.Name != "" {
		if _, err := s.findSnapshot(r.Context(), c.TeamID, req.Name); err == nil {
			s.writeError(w, r, fmt.Errorf("%w: a snapshot named %q exists", errdefs.ErrConflict, req.Name))
			return
		}
	}
	if _, err := s.getSandbox(r.Context(), c, id); err != nil {
		s.writeError(w, r, err)
		return
	}
	snap, err := s.snapshotSandbox(r.Context(), id, c.TeamID, req.Name)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, snapshotInfo(snap))
}

// findSnapshot resolves a template reference to one of team's snapshots: a
// snapshot id or name, optionally "team/"-qualified and ":default"-tagged.
func (s *Server) findSnapshot(ctx context.Context, team, ref string) (store.SnapshotRecord, error) {
	ref = strings.TrimSuffix(ref, ":default")
	name := ref
	if i := strings.IndexByte(ref, '/'); i >= 0 {
		if ref[:i] != team {
			return store.SnapshotRecord{}, errdefs.ErrNotFound
		}
		name = ref[i+1:]
	}
	if store.ValidSnapshotID(name) {
		if rec, err := s.st.GetSnapshot(ctx, name); err == nil && rec.TeamID == team {
			return rec, nil
		} else if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			return store.SnapshotRecord{}, err
		}
	}
	all, err := s.st.ListSnapshots(ctx)
	if err != nil {
		return store.SnapshotRecord{}, err
	}
	for _, rec := range all {
		if rec.TeamID != team {
			continue
		}
		for _, n := range rec.Names {
			if n == team+"/"+name {
				return rec, nil
			}
		}
	}
	return store.SnapshotRecord{}, errdefs.ErrNotFound
}

// resolveSnapshotTemplate turns a create request naming one of the team's
// snapshots into a create of the snapshot's template with its files
// restored. It returns the snapshot id ("" when req names a template).
func (s *Server) resolveSnapshotTemplate(ctx context.Context, c caller, req *e2bapi.NewSandbox) (string, error) {
	if req.TemplateID == "" || len(req.TemplateID) > 256 {
		return "", nil
	}
	if _, ok := s.cfg.Templates[req.TemplateID]; ok {
		return "", nil
	}
	snap, err := s.findSnapshot(ctx, c.TeamID, req.TemplateID)
	if errors.Is(err, errdefs.ErrNotFound) {
		return "", nil // validateCreate reports the unknown template
	}
	if err != nil {
		return "", fmt.Errorf("%w: snapshot lookup: %v", errdefs.ErrUnavailable, err)
	}
	req.TemplateID = snap.TemplateID
	if len(snap.EnvVars) > 0 {
		env := make(map[string]string, len(snap.EnvVars)+len(req.EnvVars))
		for k, v := range snap.EnvVars {
			env[k] = v
		}
		for k, v := range req.EnvVars {
			env[k] = v
		}
		req.EnvVars = env
	}
	return snap.ID, nil
}

func (s *Server) handleListSnapshots(w http.ResponseWriter, r *http.Request, c caller) {
	q := r.URL.Query()
	limit := e2bapi.DefaultLimit
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > e2bapi.MaxLimit {
			s.writeError(w, r, fmt.Errorf("%w: limit must be 1..%d", errdefs.ErrInvalid, e2bapi.MaxLimit))
			return
		}
		limit = n
	}
	next := q.Get("nextToken")
	if next != "" && !store.ValidSnapshotID(next) {
		s.writeError(w, r, fmt.Errorf("%w: bad nextToken", errdefs.ErrInvalid))
		return
	}
	sandboxID := q.Get("sandboxID")
	name := strings.TrimSuffix(q.Get("name"), ":default")
	all, err := s.st.ListSnapshots(r.Context())
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	out := []SnapshotInfo{}
	more := false
	for _, rec := range all {
		if rec.TeamID != c.TeamID || (next != "" && rec.ID <= next) || (sandboxID != "" && rec.SandboxID != sandboxID) {
			continue
		}
		if name != "" && !snapshotMatches(rec, c.TeamID, name) {
			continue
		}
		if len(out) == limit {
			more = true
			break
		}
		out = append(out, snapshotInfo(rec))
	}
	if more {
		w.Header().Set(e2bapi.HeaderNextToken, out[len(out)-1].SnapshotID)
	}
	writeJSON(w, http.StatusOK, out)
}

func snapshotMatches(rec store.SnapshotRecord, team, name string) bool {
	if rec.ID == name {
		return true
	}
	for _, n := range rec.Names {
		if n == name || n == team+"/"+name {
			return true
		}
	}
	return false
}
