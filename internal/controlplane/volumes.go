package controlplane

// Team volumes (E2B's /volumes and a create's volumeMounts). A volume
// belongs to the team of the API key that created it: every lookup is by
// team, so another team's id or name is simply not found. Its files live
// on the workers (internal/volume), which the install request names by id.
//
// Delete against create: a delete first marks the volume deleting, then
// looks for a sandbox that mounts it (409 and the mark removed if one
// does), then deletes; a create writes its record (naming the volume ids)
// before it checks that each volume still exists unmarked. Whichever
// comes second in etcd's order sees the other, so a volume is never
// deleted under a sandbox created with it.

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/volume"
)

// maxVolumesPerTeam bounds a team's volumes.
const maxVolumesPerTeam = 1000

// volumeInfo is E2B's Volume (create, get) and VolumeInfo (list: ID and
// name only).
type volumeInfo struct {
	VolumeID string `json:"volumeID"`
	Name     string `json:"name"`
	Token    string `json:"token,omitempty"`
	Domain   string `json:"domain,omitempty"`
}

func (s *Server) volumeBody(rec store.VolumeRecord) volumeInfo {
	return volumeInfo{VolumeID: rec.ID, Name: rec.Name, Token: rec.Token, Domain: s.cfg.Domain}
}

// handleCreateVolume is E2B's POST /volumes (Volume.create).
func (s *Server) handleCreateVolume(w http.ResponseWriter, r *http.Request, c caller) {
	var req struct {
		Name string `json:"name"`
	}
	if err := decodeJSON(w, r, &req, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := volume.ValidateName(req.Name); err != nil {
		s.writeError(w, r, err)
		return
	}
	existing, err := s.st.ListVolumes(r.Context(), c.TeamID)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if len(existing) >= maxVolumesPerTeam {
		s.writeError(w, r, fmt.Errorf("%w: a team has at most %d volumes", errdefs.ErrInvalid, maxVolumesPerTeam))
		return
	}
	rec := store.VolumeRecord{ID: volume.NewID(), TeamID: c.TeamID, Name: req.Name, Token: randHex(32), CreatedAt: s.now().UTC()}
	if err := s.st.CreateVolume(r.Context(), rec); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.log.Info("volume created", "team", c.TeamID, "volume", rec.ID, "name", rec.Name)
	writeJSON(w, http.StatusCreated, s.volumeBody(rec))
}

// handleListVolumes is E2B's GET /volumes.
func (s *Server) handleListVolumes(w http.ResponseWriter, r *http.Request, c caller) {
	all, err := s.st.ListVolumes(r.Context(), c.TeamID)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	out := make([]volumeInfo, 0, len(all))
	for _, rec := range all {
		if !rec.Deleting {
			out = append(out, volumeInfo{VolumeID: rec.ID, Name: rec.Name})
		}
	}
	writeJSON(w, http.StatusOK, out)
}

// getVolume is a team's volume by id or name (404 for anything else,
// another team's included).
func (s *Server) getVolume(ctx context.Context, team, idOrName string) (store.VolumeRecord, int64, error) {
	rec, rev, err := s.st.GetVolume(ctx, team, idOrName)
	if errors.Is(err, errdefs.ErrNotFound) || (err == nil && rec.Deleting) {
		return store.VolumeRecord{}, 0, fmt.Errorf("%w: volume %s", errdefs.ErrNotFound, truncate(idOrName, 64))
	}
	return rec, rev, err
}

// handleGetVolume is E2B's GET /volumes/{volumeID}.
func (s *Server) handleGetVolume(w http.ResponseWriter, r *http.Request, c caller) {
	rec, _, err := s.getVolume(r.Context(), c.TeamID, r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, s.volumeBody(rec))
}

// handleDeleteVolume is E2B's DELETE /volumes/{volumeID}: 409 while a
// sandbox of the team (running, paused or in a lifecycle operation)
// mounts it.
func (s *Server) handleDeleteVolume(w http.ResponseWriter, r *http.Request, c caller) {
	ctx := r.Context()
	// A volume left marked by a delete that never finished (its control
	// plane died) is deleted by the next one.
	rec, rev, err := s.st.GetVolume(ctx, c.TeamID, r.PathValue("id"))
	if errors.Is(err, errdefs.ErrNotFound) {
		err = fmt.Errorf("%w: volume %s", errdefs.ErrNotFound, truncate(r.PathValue("id"), 64))
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	rec.Deleting = true
	if rev, err = s.st.UpdateVolume(ctx, rev, rec); err != nil {
		s.writeError(w, r, err)
		return
	}
	user, err := s.volumeUser(ctx, rec)
	if err == nil && user != "" {
		err = fmt.Errorf("%w: volume %s is mounted by sandbox %s", errdefs.ErrConflict, rec.Name, user)
	}
	if err == nil {
		err = s.st.DeleteVolume(ctx, rec, rev)
	}
	if err != nil {
		rec.Deleting = false
		if _, uerr := s.st.UpdateVolume(context.WithoutCancel(ctx), rev, rec); uerr != nil {
			s.log.Warn("volume delete: clearing the deleting mark failed", "volume", rec.ID, "err", uerr)
		}
		s.writeError(w, r, err)
		return
	}
	s.log.Info("volume deleted", "team", c.TeamID, "volume", rec.ID, "name", rec.Name)
	w.WriteHeader(http.StatusNoContent)
}

// volumeUser is a live sandbox of the volume's team that mounts it, or "".
func (s *Server) volumeUser(ctx context.Context, v store.VolumeRecord) (string, error) {
	all, err := s.st.ListSandboxes(ctx)
	if err != nil {
		return "", err
	}
	for _, e := range all {
		if e.Record.TeamID != v.TeamID || e.Record.State.Terminal() {
			continue
		}
		for _, m := range e.Record.VolumeMounts {
			if m.ID == v.ID {
				return e.Record.ID, nil
			}
		}
	}
	return "", nil
}

// resolveVolumeMounts turns a create's volumeMounts (names, paths) into the
// team's volumes (404 for a name the team does not have).
func (s *Server) resolveVolumeMounts(ctx context.Context, team string, req []e2bapi.SandboxVolumeMount) ([]spacev1.VolumeMount, error) {
	if len(req) == 0 {
		return nil, nil
	}
	paths := make([]string, len(req))
	for i, m := range req {
		paths[i] = m.Path
	}
	if err := volume.ValidatePaths(paths); err != nil {
		return nil, err
	}
	out := make([]spacev1.VolumeMount, 0, len(req))
	for _, m := range req {
		if err := volume.ValidateName(m.Name); err != nil {
			return nil, err
		}
		rec, _, err := s.getVolume(ctx, team, m.Name)
		if err != nil {
			return nil, err
		}
		out = append(out, spacev1.VolumeMount{ID: rec.ID, Name: rec.Name, Path: m.Path})
	}
	return out, nil
}

// checkVolumesLive fails when a volume rec mounts was deleted (or is being
// deleted) since the create resolved it; called after the record naming
// them is written.
func (s *Server) checkVolumesLive(ctx context.Context, rec store.SandboxRecord) error {
	for _, m := range rec.VolumeMounts {
		v, _, err := s.st.GetVolume(ctx, rec.TeamID, m.ID)
		if errors.Is(err, errdefs.ErrNotFound) || (err == nil && v.Deleting) {
			return fmt.Errorf("%w: volume %s was deleted", errdefs.ErrNotFound, m.Name)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// volumeMountsOf is the E2B view of a sandbox's mounts.
func volumeMountsOf(rec store.SandboxRecord) []e2bapi.SandboxVolumeMount {
	out := make([]e2bapi.SandboxVolumeMount, 0, len(rec.VolumeMounts))
	for _, m := range rec.VolumeMounts {
		out = append(out, e2bapi.SandboxVolumeMount{Name: m.Name, Path: m.Path})
	}
	return out
}
