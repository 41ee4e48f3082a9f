package controlplane

import (
	"context"
	"fmt"
	"net/http"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// A user's access tokens: only the user (through one of their tokens)
// lists, creates and deletes them. An API key has no user: 403.

// newAccessToken returns a fresh E2B-style access token.
func newAccessToken() string { return accessTokenPrefix + randHex(20) }

func needUser(c caller) error {
	if !c.token() {
		return fmt.Errorf("%w: access tokens belong to users: use an access token (Authorization: Bearer %s...)", errdefs.ErrDenied, accessTokenPrefix)
	}
	return nil
}

func (s *Server) createAccessToken(ctx context.Context, user, name string) (e2bapi.CreatedAccessToken, error) {
	tok := newAccessToken()
	rec := store.AccessTokenRecord{ID: newUUID(), UserID: user, Name: name, Mask: maskOf(tok, accessTokenPrefix), CreatedAt: s.now().UTC()}
	if err := s.st.CreateAccessToken(ctx, store.HashAPIKey(tok), rec); err != nil {
		return e2bapi.CreatedAccessToken{}, err
	}
	s.log.Info("access token created", "user", user, "token_id", rec.ID)
	return e2bapi.CreatedAccessToken{ID: rec.ID, Name: rec.Name, Token: tok, Mask: maskBody(rec.Mask), CreatedAt: rec.CreatedAt}, nil
}

func (s *Server) handleListAccessTokens(w http.ResponseWriter, r *http.Request, c caller) {
	if err := needUser(c); err != nil {
		s.writeError(w, r, err)
		return
	}
	toks, err := s.st.ListAccessTokens(r.Context(), c.UserID)
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	out := make([]e2bapi.AccessToken, 0, len(toks))
	for _, t := range toks {
		out = append(out, e2bapi.AccessToken{ID: t.ID, Name: t.Name, Mask: maskBody(t.Mask), CreatedAt: t.CreatedAt})
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) handleCreateAccessToken(w http.ResponseWriter, r *http.Request, c caller) {
	if err := needUser(c); err != nil {
		s.writeError(w, r, err)
		return
	}
	var req e2bapi.NewAccessToken
	if err := decodeJSON(w, r, &req, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := validName("access token", req.Name); err != nil {
		s.writeError(w, r, err)
		return
	}
	if toks, err := s.st.ListAccessTokens(r.Context(), c.UserID); err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	} else if len(toks) >= maxAccessTokensPerUser {
		s.writeError(w, r, fmt.Errorf("%w: the user has %d access tokens (at most %d)", errdefs.ErrInvalid, len(toks), maxAccessTokensPerUser))
		return
	}
	out, err := s.createAccessToken(context.WithoutCancel(r.Context()), c.UserID, req.Name)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, out)
}

func (s *Server) handleDeleteAccessToken(w http.ResponseWriter, r *http.Request, c caller) {
	if err := needUser(c); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.st.DeleteAccessToken(context.WithoutCancel(r.Context()), c.UserID, r.PathValue("accessTokenID")); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
