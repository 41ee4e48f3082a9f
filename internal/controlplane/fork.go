package controlplane

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
)

// Fork limits and defaults (E2B's SandboxForkRequest: count 1, timeout 15 s).
const (
	forkDefaultCount   = 1
	forkMaxCount       = 10
	forkDefaultTimeout = 15 * time.Second
)

// handleFork is E2B's POST /sandboxes/{id}/fork (Sandbox.fork): the source
// is snapshotted in place (a running source is paused only for the archive
// and resumed; its id, route and timeout stay) and count sandboxes are
// created from that snapshot, each succeeding or failing on its own. On the
// ns substrate a snapshot holds files, not memory, so forks start with the
// source's files and fresh processes. The snapshot is internal: its record
// is removed once the forks are installed (their writable layers are
// copies).
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
			Network:         src.Network, MaskRequestHost: src.MaskRequestHost, HTTPSPorts: src.HTTPSPorts,
			VolumeMounts: src.VolumeMounts,
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
