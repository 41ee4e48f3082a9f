package controlplane

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// Teams, their API keys, their members and the members' access tokens
// (docs/API.md "Teams, keys and tokens").
//
// Roles, per team: an admin manages the team's keys and members; a user
// (member) uses everything else of the team. Only an admin of the bootstrap
// team is the platform's operator (workers, signing keys).
func (s *Server) teamRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET /teams", s.withUser(s.handleListTeams))
	mux.HandleFunc("POST /teams", s.withUser(s.handleCreateTeam))
	mux.HandleFunc("GET /teams/{teamID}/users", s.withKey(s.handleListMembers))
	mux.HandleFunc("POST /teams/{teamID}/users", s.withKey(s.handleInviteMember))
	mux.HandleFunc("DELETE /teams/{teamID}/users/{userID}", s.withKey(s.handleRemoveMember))

	mux.HandleFunc("GET /api-keys", s.withKey(s.handleListAPIKeys))
	mux.HandleFunc("POST /api-keys", s.withKey(s.handleCreateAPIKey))
	mux.HandleFunc("PATCH /api-keys/{apiKeyID}", s.withKey(s.handleUpdateAPIKey))
	mux.HandleFunc("DELETE /api-keys/{apiKeyID}", s.withKey(s.handleDeleteAPIKey))

	mux.HandleFunc("GET /access-tokens", s.withUser(s.handleListAccessTokens))
	mux.HandleFunc("POST /access-tokens", s.withUser(s.handleCreateAccessToken))
	mux.HandleFunc("DELETE /access-tokens/{accessTokenID}", s.withUser(s.handleDeleteAccessToken))

	mux.HandleFunc("GET /openapi.yaml", s.handleOpenAPIYAML)
	mux.HandleFunc("GET /openapi.json", s.handleOpenAPIJSON)
}

// Bounds of what one tenant may create: each is a record in etcd, and
// listing a team's keys reads every key of every team.
const (
	maxAPIKeysPerTeam      = 100
	maxAccessTokensPerUser = 100
	maxTeamsPerUser        = 100 // POST /teams refuses a user in as many
	maxMembersPerTeam      = 500
)

// bootstrapTeam makes sure the bootstrap team exists (the bootstrap key is
// its admin), so that GET /teams names it.
func (s *Server) bootstrapTeam(ctx context.Context) error {
	_, err := s.st.EnsureTeam(ctx, store.TeamRecord{ID: s.cfg.BootstrapTeamID, Name: s.cfg.BootstrapTeamID, CreatedAt: s.now().UTC()})
	return err
}

// validName checks a team, key or token name: 1..128 printable characters.
func validName(what, name string) error {
	if name == "" || len(name) > 128 || strings.IndexFunc(name, func(r rune) bool { return r < 0x20 || r == 0x7f }) >= 0 {
		return fmt.Errorf("%w: %s name must be 1..128 printable characters", errdefs.ErrInvalid, what)
	}
	return nil
}

// sameTeam refuses a path naming another team than the caller's: 404, as
// if it did not exist.
func sameTeam(c caller, team string) error {
	if team != c.TeamID {
		return fmt.Errorf("%w: team %s", errdefs.ErrNotFound, truncate(team, 64))
	}
	return nil
}

func (s *Server) handleListTeams(w http.ResponseWriter, r *http.Request, c caller) {
	ctx := r.Context()
	out := []e2bapi.Team{}
	if !c.token() {
		t, err := s.st.GetTeam(ctx, c.TeamID)
		if errors.Is(err, errdefs.ErrNotFound) {
			t = store.TeamRecord{ID: c.TeamID, Name: c.TeamID} // a key of a team stored before teams were
		} else if err != nil {
			s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
			return
		}
		writeJSON(w, http.StatusOK, append(out, e2bapi.Team{TeamID: t.ID, Name: t.Name, IsDefault: true}))
		return
	}
	ms, err := s.st.Memberships(ctx, c.UserID)
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	def := defaultMembership(ms)
	for i, m := range ms {
		t, err := s.st.GetTeam(ctx, m.TeamID)
		if err != nil {
			continue
		}
		out = append(out, e2bapi.Team{TeamID: t.ID, Name: t.Name, IsDefault: i == def})
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) handleCreateTeam(w http.ResponseWriter, r *http.Request, c caller) {
	if !c.token() {
		s.writeError(w, r, fmt.Errorf("%w: teams are created by users: use an access token (Authorization: Bearer sk_e2b_...)", errdefs.ErrDenied))
		return
	}
	var req e2bapi.NewTeam
	if err := decodeJSON(w, r, &req, true); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := validName("team", req.Name); err != nil {
		s.writeError(w, r, err)
		return
	}
	if ms, err := s.st.Memberships(r.Context(), c.UserID); err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	} else if len(ms) >= maxTeamsPerUser {
		s.writeError(w, r, fmt.Errorf("%w: the user is in %d teams (at most %d)", errdefs.ErrInvalid, len(ms), maxTeamsPerUser))
		return
	}
	now := s.now().UTC()
	t := store.TeamRecord{ID: newUUID(), Name: req.Name, CreatedAt: now}
	ctx := context.WithoutCancel(r.Context())
	if err := s.st.CreateTeam(ctx, t); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.st.PutMember(ctx, store.MemberRecord{TeamID: t.ID, UserID: c.UserID, Role: store.RoleAdmin, CreatedAt: now}); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.log.Info("team created", "team", t.ID, "user", c.UserID)
	ms, _ := s.st.Memberships(ctx, c.UserID)
	def := defaultMembership(ms)
	writeJSON(w, http.StatusCreated, e2bapi.Team{TeamID: t.ID, Name: t.Name, IsDefault: def >= 0 && ms[def].TeamID == t.ID})
}

func (s *Server) handleListMembers(w http.ResponseWriter, r *http.Request, c caller) {
	if err := sameTeam(c, r.PathValue("teamID")); err != nil {
		s.writeError(w, r, err)
		return
	}
	ms, err := s.st.Members(r.Context(), c.TeamID)
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	out := []e2bapi.TeamMember{}
	for _, m := range ms {
		u, err := s.st.GetUser(r.Context(), m.UserID)
		if err != nil {
			continue
		}
		out = append(out, e2bapi.TeamMember{ID: u.ID, Email: u.Email, Role: m.Role})
	}
	writeJSON(w, http.StatusOK, out)
}

// handleInviteMember adds a member to the caller's team: a new user,
// labelled by email, created with a first access token returned this once
// for the admin to hand over; or an existing user, by id (or a member's
// role changed). An email never finds an existing account: whoever holds a
// user's first token holds the user, so an admin of one team inviting
// "ann@..." must not reach an Ann another team's admin created.
func (s *Server) handleInviteMember(w http.ResponseWriter, r *http.Request, c caller) {
	if err := sameTeam(c, r.PathValue("teamID")); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := requireAdmin(c, "inviting members"); err != nil {
		s.writeError(w, r, err)
		return
	}
	var req e2bapi.NewTeamMember
	if err := decodeJSON(w, r, &req, true); err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.Role == "" {
		req.Role = store.RoleUser
	}
	if !store.ValidMemberRole(req.Role) {
		s.writeError(w, r, fmt.Errorf("%w: role must be %q or %q", errdefs.ErrInvalid, store.RoleAdmin, store.RoleUser))
		return
	}
	if (req.Email == "") == (req.UserID == "") {
		s.writeError(w, r, fmt.Errorf("%w: give email (a new user) or userID (an existing one)", errdefs.ErrInvalid))
		return
	}
	ctx := context.WithoutCancel(r.Context())
	now := s.now().UTC()
	out := e2bapi.InvitedTeamMember{}
	var u store.UserRecord
	ms, err := s.st.Members(ctx, c.TeamID)
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	if req.Email != "" && len(ms) >= maxMembersPerTeam {
		s.writeError(w, r, fmt.Errorf("%w: the team has %d members (at most %d)", errdefs.ErrInvalid, len(ms), maxMembersPerTeam))
		return
	}
	if req.Email != "" {
		if len(req.Email) > 254 || !strings.Contains(req.Email, "@") || strings.ContainsAny(req.Email, "/ \x00") {
			s.writeError(w, r, fmt.Errorf("%w: email must be an address", errdefs.ErrInvalid))
			return
		}
		u = store.UserRecord{ID: newUUID(), Email: req.Email, CreatedAt: now}
		if err := s.st.CreateUser(ctx, u); err != nil {
			s.writeError(w, r, err)
			return
		}
		tok, err := s.createAccessToken(ctx, u.ID, "invitation to "+c.TeamID)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		out.AccessToken = &tok
	} else {
		var err error
		if u, err = s.st.GetUser(ctx, req.UserID); err != nil {
			s.writeError(w, r, fmt.Errorf("%w: user %s", errdefs.ErrNotFound, truncate(req.UserID, 64)))
			return
		}
	}
	// An existing user added by id did not choose this team: it is never
	// their default (an email invitation's new user has no other team).
	m := store.MemberRecord{TeamID: c.TeamID, UserID: u.ID, Role: req.Role, CreatedAt: now, Added: req.UserID != ""}
	member := false
	for _, old := range ms {
		if old.UserID == u.ID {
			m.CreatedAt, m.Added, member = old.CreatedAt, old.Added, true // a role change keeps the user's default team
		}
	}
	if !member && len(ms) >= maxMembersPerTeam {
		s.writeError(w, r, fmt.Errorf("%w: the team has %d members (at most %d)", errdefs.ErrInvalid, len(ms), maxMembersPerTeam))
		return
	}
	if req.Role != store.RoleAdmin {
		if err := s.keepAnAdmin(ctx, c.TeamID, u.ID); err != nil {
			s.writeError(w, r, err)
			return
		}
	}
	if err := s.st.PutMember(ctx, m); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.log.Info("team member added", "team", c.TeamID, "user", u.ID, "role", req.Role, "by", c.KeyID)
	out.TeamMember = e2bapi.TeamMember{ID: u.ID, Email: u.Email, Role: req.Role}
	writeJSON(w, http.StatusCreated, out)
}

func (s *Server) handleRemoveMember(w http.ResponseWriter, r *http.Request, c caller) {
	if err := sameTeam(c, r.PathValue("teamID")); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := requireAdmin(c, "removing members"); err != nil {
		s.writeError(w, r, err)
		return
	}
	ctx := context.WithoutCancel(r.Context())
	if err := s.keepAnAdmin(ctx, c.TeamID, r.PathValue("userID")); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.st.DeleteMember(ctx, c.TeamID, r.PathValue("userID")); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// keepAnAdmin refuses to remove (or demote) user when the team would be
// left without an admin: no other admin member and no admin API key, so
// that nobody could manage it any more.
func (s *Server) keepAnAdmin(ctx context.Context, team, user string) error {
	ms, err := s.st.Members(ctx, team)
	if err != nil {
		return fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
	}
	target := false
	for _, m := range ms {
		if m.Role != store.RoleAdmin {
			continue
		}
		if m.UserID != user {
			return nil
		}
		target = true
	}
	if !target {
		return nil // not an admin: nothing lost
	}
	keys, err := s.st.ListAPIKeys(ctx, team)
	if err != nil {
		return fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
	}
	for _, k := range keys {
		if k.Role == store.RoleAdmin {
			return nil
		}
	}
	return fmt.Errorf("%w: the team's last admin: make another member admin (or create an admin key) first", errdefs.ErrConflict)
}

// newUUID returns a random (version 4) UUID, E2B's id form for teams,
// users, keys and tokens.
func newUUID() string {
	b := []byte(randHex(16))
	b[12] = '4'
	b[16] = "89ab"[b[16]%4]
	return fmt.Sprintf("%s-%s-%s-%s-%s", b[0:8], b[8:12], b[12:16], b[16:20], b[20:32])
}

// maskOf is what listings show of a secret: its prefix, the length of its
// random part, and that part's first 2 and last 4 characters (24 of its 160
// bits).
func maskOf(secret, prefix string) store.Mask {
	v := strings.TrimPrefix(secret, prefix)
	if len(v) < 12 {
		return store.Mask{Prefix: prefix, ValueLength: len(v)}
	}
	return store.Mask{Prefix: prefix, ValueLength: len(v), MaskedValuePrefix: v[:2], MaskedValueSuffix: v[len(v)-4:]}
}

func maskBody(m store.Mask) e2bapi.IdentifierMaskingDetails {
	return e2bapi.IdentifierMaskingDetails(m)
}
