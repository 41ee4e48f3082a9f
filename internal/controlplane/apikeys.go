package controlplane

import (
	"context"
	"fmt"
	"net/http"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// A team's API keys: any member lists them (masks only), an admin creates,
// renames and deletes them. A deleted key fails at once on every control
// plane: authentication reads etcd on every request.

func (s *Server) apiKeyBody(e store.APIKeyRecord) e2bapi.TeamAPIKey {
	k := e2bapi.TeamAPIKey{ID: e.KeyID, Name: e.Name, Mask: maskBody(e.Mask), CreatedAt: e.CreatedAt, LastUsed: e.LastUsed, Role: e.Role}
	if e.CreatedBy != "" {
		k.CreatedBy = &e2bapi.TeamUser{ID: e.CreatedBy}
		if u, err := s.st.GetUser(context.Background(), e.CreatedBy); err == nil {
			k.CreatedBy.Email = &u.Email
		}
	}
	return k
}

func (s *Server) handleListAPIKeys(w http.ResponseWriter, r *http.Request, c caller) {
	keys, err := s.st.ListAPIKeys(r.Context(), c.TeamID)
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	out := make([]e2bapi.TeamAPIKey, 0, len(keys))
	for _, k := range keys {
		out = append(out, s.apiKeyBody(k.APIKeyRecord))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) handleCreateAPIKey(w http.ResponseWriter, r *http.Request, c caller) {
	if err := requireAdmin(c, "creating API keys"); err != nil {
		s.writeError(w, r, err)
		return
	}
	var req e2bapi.NewTeamAPIKey
	if err := decodeJSON(w, r, &req, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := validName("API key", req.Name); err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.Role == "" {
		req.Role = store.RoleAdmin
	}
	if !store.ValidMemberRole(req.Role) {
		s.writeError(w, r, fmt.Errorf("%w: role must be %q or %q", errdefs.ErrInvalid, store.RoleAdmin, store.RoleUser))
		return
	}
	if keys, err := s.st.ListAPIKeys(r.Context(), c.TeamID); err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	} else if len(keys) >= maxAPIKeysPerTeam {
		s.writeError(w, r, fmt.Errorf("%w: the team has %d API keys (at most %d)", errdefs.ErrInvalid, len(keys), maxAPIKeysPerTeam))
		return
	}
	key := newAPIKey()
	rec := store.APIKeyRecord{TeamID: c.TeamID, KeyID: newUUID(), Role: req.Role, Name: req.Name,
		CreatedAt: s.now().UTC(), Mask: maskOf(key, apiKeyPrefix), CreatedBy: c.UserID}
	if err := s.st.CreateAPIKey(context.WithoutCancel(r.Context()), store.HashAPIKey(key), rec); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.log.Info("api key created", "team", c.TeamID, "key_id", rec.KeyID, "role", rec.Role, "by", c.KeyID)
	b := s.apiKeyBody(rec)
	writeJSON(w, http.StatusCreated, e2bapi.CreatedTeamAPIKey{ID: b.ID, Key: key, Name: b.Name, Mask: b.Mask,
		CreatedAt: b.CreatedAt, CreatedBy: b.CreatedBy, LastUsed: b.LastUsed, Role: b.Role})
}

func (s *Server) handleUpdateAPIKey(w http.ResponseWriter, r *http.Request, c caller) {
	if err := requireAdmin(c, "renaming API keys"); err != nil {
		s.writeError(w, r, err)
		return
	}
	var req e2bapi.UpdateTeamAPIKey
	if err := decodeJSON(w, r, &req, true); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := validName("API key", req.Name); err != nil {
		s.writeError(w, r, err)
		return
	}
	ctx := context.WithoutCancel(r.Context())
	e, err := s.st.FindAPIKey(ctx, c.TeamID, r.PathValue("apiKeyID"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	rec, err := s.st.UpdateAPIKey(ctx, e, func(k *store.APIKeyRecord) { k.Name = req.Name })
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, s.apiKeyBody(rec))
}

func (s *Server) handleDeleteAPIKey(w http.ResponseWriter, r *http.Request, c caller) {
	if err := requireAdmin(c, "deleting API keys"); err != nil {
		s.writeError(w, r, err)
		return
	}
	ctx := context.WithoutCancel(r.Context())
	e, err := s.st.FindAPIKey(ctx, c.TeamID, r.PathValue("apiKeyID"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.st.DeleteAPIKey(ctx, e.Hash); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.log.Info("api key deleted", "team", c.TeamID, "key_id", e.KeyID, "by", c.KeyID)
	w.WriteHeader(http.StatusNoContent)
}
