package controlplane

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// caller is an authenticated API key holder.
type caller struct {
	TeamID string
	KeyID  string
	Role   string
}

func (c caller) edge() bool { return c.Role == store.RoleEdge }

// authenticate resolves an API key: the edge's service key, or a stored key.
func (s *Server) authenticate(ctx context.Context, key string) (caller, error) {
	if key == "" {
		return caller{}, fmt.Errorf("%w: missing %s header", errdefs.ErrUnauthenticated, spacev1.HeaderAPIKey)
	}
	if s.cfg.EdgeKey != "" && equalSecret(key, s.cfg.EdgeKey) {
		return caller{TeamID: "", KeyID: "edge", Role: store.RoleEdge}, nil
	}
	if len(key) > 256 {
		return caller{}, fmt.Errorf("%w: invalid API key", errdefs.ErrUnauthenticated)
	}
	h := store.HashAPIKey(key)
	rec, err := s.st.LookupAPIKey(ctx, h)
	if errors.Is(err, errdefs.ErrNotFound) {
		return caller{}, fmt.Errorf("%w: invalid API key", errdefs.ErrUnauthenticated)
	}
	if err != nil {
		return caller{}, fmt.Errorf("%w: key lookup failed: %v", errdefs.ErrUnavailable, err)
	}
	return caller{TeamID: rec.TeamID, KeyID: rec.KeyID, Role: rec.Role}, nil
}

// withKey authenticates an E2B route: a team's API key (not the edge's).
func (s *Server) withKey(h func(http.ResponseWriter, *http.Request, caller)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		c, err := s.authenticate(r.Context(), r.Header.Get(spacev1.HeaderAPIKey))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		if c.edge() {
			s.writeError(w, r, fmt.Errorf("%w: the edge service key cannot manage sandboxes", errdefs.ErrDenied))
			return
		}
		h(w, r, c)
	}
}
