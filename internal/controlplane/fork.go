package controlplane

// The E2B calls built on snapshots and the network policy:
//
//   - POST /sandboxes/{id}/fork (Sandbox.fork): the source is snapshotted in
//     place (a running source is paused only for the archive and resumed;
//     its id, route and timeout stay) and count sandboxes are created from
//     that snapshot, each succeeding or failing on its own. On the ns
//     substrate a snapshot holds files, not memory, so forks start with the
//     source's files and fresh processes. The snapshot is internal: its
//     record is removed once the forks are installed (their writable layers
//     are copies).
//   - DELETE /templates/{id} (Sandbox.deleteSnapshot): removes a snapshot
//     record of the caller's team, then its archive unless a paused
//     sandbox still resumes from it.
//   - PUT /sandboxes/{id}/network (Sandbox.updateNetwork): sandboxes have
//     loopback-only networking and no egress path exists, so a policy that
//     would open egress is refused as invalid; one that keeps egress closed
//     is accepted (it is what the sandbox already enforces).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// Fork limits and defaults (E2B's SandboxForkRequest: count 1, timeout 15 s).
const (
	forkDefaultCount   = 1
	forkMaxCount       = 10
	forkDefaultTimeout = 15 * time.Second
)

func (s *Server) snapshotExtraRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /sandboxes/{id}/fork", s.withKey(s.handleFork))
	mux.HandleFunc("DELETE /templates/{id}", s.withKey(s.handleDeleteSnapshot))
	mux.HandleFunc("PUT /sandboxes/{id}/network", s.withKey(s.handleUpdateNetwork))
}

func (s *Server) handleFork(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req struct {
		Count   *int `json:"count"`
		Timeout *int `json:"timeout"`
	}
	if err := decodeOptionalJSON(w, r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	count := forkDefaultCount
	if req.Count != nil {
		count = *req.Count
	}
	if count < 1 || count > forkMaxCount {
		s.writeError(w, r, fmt.Errorf("%w: count must be 1..%d", errdefs.ErrInvalid, forkMaxCount))
		return
	}
	timeout := forkDefaultTimeout
	if req.Timeout != nil {
		if *req.Timeout < 0 || time.Duration(*req.Timeout)*time.Second > s.cfg.MaxTimeout {
			s.writeError(w, r, fmt.Errorf("%w: timeout must be 0..%d seconds", errdefs.ErrInvalid, int(s.cfg.MaxTimeout/time.Second)))
			return
		}
		if *req.Timeout > 0 {
			timeout = time.Duration(*req.Timeout) * time.Second
		}
	}
	src, err := s.getSandbox(r.Context(), c, id)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	spec, ok := s.cfg.Templates[src.TemplateID]
	if !ok {
		s.writeError(w, r, fmt.Errorf("%w: template %q of sandbox %s no longer exists", errdefs.ErrConflict, truncate(src.TemplateID, 64), id))
		return
	}
	snap, err := s.snapshotSandbox(r.Context(), id, c.TeamID, "")
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	ctx := context.WithoutCancel(r.Context())
	results := make([]e2bapi.SandboxForkResult, count)
	for i := range results {
		p := createParams{
			Template: src.TemplateID, Spec: spec, Timeout: timeout,
			Metadata: src.Metadata, EnvVars: src.EnvVars,
			Secure: src.AccessToken != "", PrivateTraffic: src.TrafficAccessToken != "",
			RestoreSnapshot: snap.ID,
		}
		rec, err := s.createSandbox(ctx, c, p)
		if err != nil {
			code, msg := status(err)
			results[i].Error = &e2bapi.Error{Code: code, Message: msg}
			continue
		}
		results[i].Sandbox = s.created(rec)
	}
	// The forks hold copies; the snapshot was only the means.
	if err := s.dropSnapshot(ctx, snap); err != nil {
		s.log.Warn("fork: dropping the internal snapshot failed", "sandbox", id, "snapshot", snap.ID, "err", err)
	}
	s.log.Info("sandbox forked", "sandbox", id, "forks", count)
	writeJSON(w, http.StatusCreated, results)
}

// created is the E2B create response for rec.
func (s *Server) created(rec store.SandboxRecord) *e2bapi.Sandbox {
	var traffic *string
	if rec.TrafficAccessToken != "" {
		traffic = &rec.TrafficAccessToken
	}
	return &e2bapi.Sandbox{
		SandboxID: rec.ID, TemplateID: rec.TemplateID, ClientID: clientID,
		EnvdVersion: rec.EnvdVersion, EnvdAccessToken: rec.AccessToken, Domain: s.domain(),
		TrafficAccessToken: traffic,
	}
}

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

func (s *Server) handleUpdateNetwork(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req struct {
		AllowInternetAccess *bool           `json:"allow_internet_access"`
		AllowOut            []string        `json:"allowOut"`
		DenyOut             []string        `json:"denyOut"`
		EgressProxy         json.RawMessage `json:"egressProxy"`
		Rules               json.RawMessage `json:"rules"`
	}
	if err := decodeJSON(w, r, &req, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	if _, err := s.getSandbox(r.Context(), c, id); err != nil {
		s.writeError(w, r, err)
		return
	}
	switch {
	case req.AllowInternetAccess != nil && *req.AllowInternetAccess,
		len(req.AllowOut) > 0,
		len(req.EgressProxy) > 0 && string(req.EgressProxy) != "null":
		s.writeError(w, r, fmt.Errorf("%w: sandboxes have loopback-only networking; egress (allow_internet_access, allowOut, egressProxy) cannot be opened", errdefs.ErrInvalid))
		return
	}
	// Deny rules and transform rules describe traffic that cannot leave.
	w.WriteHeader(http.StatusNoContent)
}
