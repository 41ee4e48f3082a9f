package controlplane

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strconv"
	"strings"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

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

func newSnapshotID() string { return "snap-" + randHex(12) }

// handleCreateSnapshot is E2B's POST /sandboxes/{id}/snapshots
// (createSnapshot), optionally naming the snapshot.
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

// snapshotSandbox archives the sandbox's writable layer into a persistent
// snapshot (E2B's createSnapshot). A running sandbox is paused for the
// archive and thawed after (same execution); a paused one stays paused.
func (s *Server) snapshotSandbox(ctx context.Context, id, team, name string) (store.SnapshotRecord, error) {
	ctx = context.WithoutCancel(ctx)
	rec, op, err := s.beginOp(ctx, id, team, opSnapshot, store.StateSnapshotting, "", func(r store.SandboxRecord) error {
		if r.State != store.StateRunning && r.State != store.StatePaused {
			return fmt.Errorf("%w: sandbox %s is %s", errdefs.ErrConflict, id, r.State)
		}
		return nil
	})
	if err != nil {
		return store.SnapshotRecord{}, err
	}
	log := s.log.With("sandbox", id, "generation", rec.Route.Generation, "worker", rec.Route.WorkerID)
	nodeURL, alive := s.liveWorker(ctx, rec.Route.WorkerID)
	if !alive {
		s.abortOp(ctx, id, op, op.From)
		return store.SnapshotRecord{}, fmt.Errorf("%w: worker %s of sandbox %s is not registered", errdefs.ErrUnavailable, rec.Route.WorkerID, id)
	}
	wasRunning := op.From == store.StateRunning
	if wasRunning {
		if err := s.node.pause(ctx, nodeURL, rec.Route); err != nil {
			s.abortOp(ctx, id, op, store.StateRunning)
			return store.SnapshotRecord{}, fmt.Errorf("snapshot sandbox %s: %w", id, err)
		}
	}
	snapID := newSnapshotID()
	sresp, serr := s.node.snapshot(ctx, nodeURL, rec.Route, snapID)
	crashpoint.Hit(crashpoint.SnapshotArchived)
	back := op.From
	if wasRunning {
		if err := s.node.resume(ctx, nodeURL, rec.Route); err != nil {
			log.Warn("thaw after snapshot failed; the sandbox stays paused", "err", err)
			back = store.StatePaused
		}
	}
	now := s.now().UTC()
	if _, err := s.finishOp(ctx, id, op, func(r *store.SandboxRecord) {
		r.State = back
		if back == store.StatePaused {
			setExec(r, r.Route, execPaused, now)
			if serr == nil {
				r.PausedSnapshot = snapID
			}
			if wasRunning {
				r.EndAt = now.Add(s.cfg.MaxTimeout)
			}
		}
	}); err != nil && serr == nil {
		serr = err
	}
	if serr != nil {
		return store.SnapshotRecord{}, fmt.Errorf("snapshot sandbox %s: %w", id, serr)
	}
	snap := store.SnapshotRecord{
		ID: snapID, TeamID: rec.TeamID, SandboxID: id, TemplateID: rec.TemplateID, Generation: rec.Route.Generation,
		EnvVars: rec.EnvVars, CPUCount: rec.CPUCount, MemoryMB: rec.MemoryMB, DiskSizeMB: rec.DiskSizeMB,
		SizeBytes: sresp.SizeBytes, CreatedAt: now,
	}
	if name != "" {
		snap.Names = []string{rec.TeamID + "/" + name}
	}
	if err := s.st.CreateSnapshot(ctx, snap); err != nil {
		return store.SnapshotRecord{}, fmt.Errorf("%w: recording snapshot %s: %v", errdefs.ErrUnavailable, snapID, err)
	}
	log.Info("snapshot created", "snapshot", snapID, "size_bytes", sresp.SizeBytes)
	return snap, nil
}

// handleListSnapshots is E2B's GET /snapshots: the team's snapshots by
// id, filtered by sandbox or name, paginated by snapshot id.
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

// handleDeleteSnapshot is E2B's DELETE /templates/{id}
// (Sandbox.deleteSnapshot): it removes a snapshot record of the caller's
// team, then its archive unless a paused sandbox still resumes from it.
func (s *Server) handleDeleteSnapshot(w http.ResponseWriter, r *http.Request, c caller) {
	ref := r.PathValue("id")
	if ref == "" || len(ref) > 256 {
		s.writeError(w, r, fmt.Errorf("%w: bad template id", errdefs.ErrInvalid))
		return
	}
	if _, ok := s.cfg.Templates[ref]; ok {
		s.writeError(w, r, fmt.Errorf("%w: %s is a built-in template, not a snapshot", errdefs.ErrInvalid, ref))
		return
	}
	snap, err := s.findSnapshot(r.Context(), c.TeamID, ref)
	if errors.Is(err, errdefs.ErrNotFound) {
		s.writeError(w, r, fmt.Errorf("%w: snapshot %s", errdefs.ErrNotFound, truncate(ref, 64)))
		return
	}
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: snapshot lookup: %v", errdefs.ErrUnavailable, err))
		return
	}
	if err := s.dropSnapshot(r.Context(), snap); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// dropSnapshot removes snap's record and then its archive, unless a
// paused sandbox's resume still needs the archive (its PausedSnapshot).
// A failure to remove the archive leaves an unreferenced object (logged):
// the record, which makes it usable, is gone either way.
func (s *Server) dropSnapshot(ctx context.Context, snap store.SnapshotRecord) error {
	if err := s.st.DeleteSnapshot(ctx, snap.ID); err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return fmt.Errorf("%w: snapshot %s", errdefs.ErrNotFound, snap.ID)
		}
		return fmt.Errorf("%w: delete snapshot %s: %v", errdefs.ErrUnavailable, snap.ID, err)
	}
	log := s.log.With("snapshot", snap.ID)
	if s.snaps == nil {
		log.Info("snapshot record deleted; no snapshot store here, the archive stays")
		return nil
	}
	recs, err := s.st.ListSandboxes(ctx)
	if err != nil {
		log.Warn("snapshot record deleted; archive kept, sandboxes could not be listed", "err", err)
		return nil
	}
	for _, e := range recs {
		if rec := e.Record; rec.PausedSnapshot == snap.ID && rec.State != store.StateKilled {
			log.Info("snapshot record deleted; archive kept for a paused sandbox's resume", "sandbox", e.Record.ID)
			return nil
		}
	}
	if err := s.snaps.Delete(ctx, snap.ID); err != nil {
		log.Warn("snapshot record deleted; removing the archive failed", "err", err)
		return nil
	}
	log.Info("snapshot deleted")
	return nil
}
