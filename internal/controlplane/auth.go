package controlplane

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// Credentials (docs/API.md "Authentication"):
//
//   - X-API-Key: e2b_<40 hex>, a team's API key, with the key's role;
//   - Authorization: Bearer sk_e2b_<40 hex>, a user's access token, acting
//     on the user's default team (their oldest membership) or the team named
//     by X-Team-ID, with the user's role in that team.
//
// Both are stored only as SHA-256 and looked up in etcd on every request:
// a deleted key or token fails at once on every control plane (there is no
// cache to invalidate).
const (
	accessTokenPrefix = "sk_e2b_"
	apiKeyPrefix      = "e2b_"
	// HeaderTeamID selects among an access token's teams.
	HeaderTeamID = "X-Team-ID"
	// lastUsedEvery bounds how often a key's lastUsed is written.
	lastUsedEvery = time.Minute
)

// caller is an authenticated API key or access token holder.
type caller struct {
	// TeamID scopes everything the caller touches; "" only for the edge
	// and for an access token whose user belongs to no team (withUser).
	TeamID string
	// KeyID is the API key's id, or the access token's.
	KeyID string
	Role  string
	// UserID is set for access tokens (and keys a user created: no).
	UserID string
	// Operator: an admin of the bootstrap team, who may act on the
	// platform itself (workers, signing keys). Other teams' admins may not.
	Operator bool
}

func (c caller) edge() bool     { return c.Role == store.RoleEdge }
func (c caller) operator() bool { return c.Operator }
func (c caller) token() bool    { return c.UserID != "" }

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
	// The lookup by hash is the compare: etcd finds the record by the
	// digest, never by comparing the key byte by byte.
	h := store.HashAPIKey(key)
	rec, rev, err := s.st.LookupAPIKeyRev(ctx, h)
	if errors.Is(err, errdefs.ErrNotFound) {
		return caller{}, fmt.Errorf("%w: invalid API key", errdefs.ErrUnauthenticated)
	}
	if err != nil {
		return caller{}, fmt.Errorf("%w: key lookup failed: %v", errdefs.ErrUnavailable, err)
	}
	if now := s.now(); rec.Role != store.RoleEdge && (rec.LastUsed == nil || now.Sub(*rec.LastUsed) > lastUsedEvery) {
		if err := s.st.TouchAPIKey(ctx, h, rev, rec, now); err != nil {
			s.log.Debug("api key last use not recorded", "key_id", rec.KeyID, "err", err)
		}
	}
	return caller{TeamID: rec.TeamID, KeyID: rec.KeyID, Role: rec.Role,
		Operator: rec.Role == store.RoleAdmin && rec.TeamID == s.cfg.BootstrapTeamID}, nil
}

// authenticateToken resolves an access token and the team it acts on:
// team (X-Team-ID) or the user's default team. A token of a user in no
// team gets a caller with no team (only withUser routes take it).
func (s *Server) authenticateToken(ctx context.Context, token, team string) (caller, error) {
	if len(token) > 256 || !strings.HasPrefix(token, accessTokenPrefix) {
		return caller{}, fmt.Errorf("%w: invalid access token", errdefs.ErrUnauthenticated)
	}
	rec, err := s.st.LookupAccessToken(ctx, store.HashAPIKey(token))
	if errors.Is(err, errdefs.ErrNotFound) {
		return caller{}, fmt.Errorf("%w: invalid access token", errdefs.ErrUnauthenticated)
	}
	if err != nil {
		return caller{}, fmt.Errorf("%w: token lookup failed: %v", errdefs.ErrUnavailable, err)
	}
	ms, err := s.st.Memberships(ctx, rec.UserID)
	if err != nil {
		return caller{}, fmt.Errorf("%w: membership lookup failed: %v", errdefs.ErrUnavailable, err)
	}
	c := caller{KeyID: rec.ID, UserID: rec.UserID}
	if team == "" {
		if i := defaultMembership(ms); i >= 0 {
			c.TeamID, c.Role = ms[i].TeamID, ms[i].Role
		}
	}
	for _, m := range ms {
		if team != "" && m.TeamID == team {
			c.TeamID, c.Role = m.TeamID, m.Role
			break
		}
	}
	if team != "" && c.TeamID == "" {
		// The same answer whether or not the team exists.
		return caller{}, fmt.Errorf("%w: not a member of team %q", errdefs.ErrDenied, truncate(team, 64))
	}
	c.Operator = c.Role == store.RoleAdmin && c.TeamID == s.cfg.BootstrapTeamID
	return c, nil
}

// defaultMembership is the index in ms (oldest first) of the user's
// default team: their oldest membership they did not merely get added to
// by another team's admin (-1: none; the user names a team by X-Team-ID).
func defaultMembership(ms []store.MemberRecord) int {
	for i, m := range ms {
		if !m.Added {
			return i
		}
	}
	return -1
}

// authenticateRequest reads the request's credential: X-API-Key, else an
// Authorization bearer access token.
func (s *Server) authenticateRequest(r *http.Request) (caller, error) {
	team := r.Header.Get(HeaderTeamID)
	if key := r.Header.Get(spacev1.HeaderAPIKey); key != "" {
		c, err := s.authenticate(r.Context(), key)
		if err == nil && team != "" && !c.edge() && team != c.TeamID {
			return caller{}, fmt.Errorf("%w: an API key acts on its own team only (%s names another)", errdefs.ErrDenied, HeaderTeamID)
		}
		return c, err
	}
	if tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok && strings.HasPrefix(tok, accessTokenPrefix) {
		return s.authenticateToken(r.Context(), tok, team)
	}
	return caller{}, fmt.Errorf("%w: missing %s header (or Authorization: Bearer %s... access token)",
		errdefs.ErrUnauthenticated, spacev1.HeaderAPIKey, accessTokenPrefix)
}

// authFailed answers a failed authentication, logging it without the
// credential (its kind, and where it came from).
func (s *Server) authFailed(w http.ResponseWriter, r *http.Request, err error) {
	if errors.Is(err, errdefs.ErrUnauthenticated) || errors.Is(err, errdefs.ErrDenied) {
		kind := "none"
		switch {
		case r.Header.Get(spacev1.HeaderAPIKey) != "":
			kind = "api_key"
		case r.Header.Get("Authorization") != "":
			kind = "bearer"
		}
		if ok, suppressed := s.authLog.allow(s.now()); ok {
			s.log.Warn("authentication failed", "method", r.Method, "path", r.URL.Path, "remote", r.RemoteAddr,
				"credential", kind, "err", errdefs.PublicMessage(err), "suppressed_before", suppressed)
		}
	}
	s.writeError(w, r, err)
}

// logLimiter lets through at most logBurst lines a second, counting the
// rest, so that a flood of bad credentials cannot flood the log.
type logLimiter struct {
	mu         sync.Mutex
	window     time.Time
	n          int
	suppressed int
}

const logBurst = 20

// allow reports whether to log now, and how many lines were suppressed
// since the last one logged.
func (l *logLimiter) allow(now time.Time) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Sub(l.window) >= time.Second || now.Before(l.window) {
		l.window, l.n = now, 0
	}
	l.n++
	if l.n > logBurst {
		l.suppressed++
		return false, 0
	}
	s := l.suppressed
	l.suppressed = 0
	return true, s
}

// withKey authenticates a team's route: a team's API key, or an access
// token acting on one of its user's teams (not the edge's key).
func (s *Server) withKey(h func(http.ResponseWriter, *http.Request, caller)) http.HandlerFunc {
	return s.withUser(func(w http.ResponseWriter, r *http.Request, c caller) {
		if c.TeamID == "" {
			s.authFailed(w, r, fmt.Errorf("%w: the user has no default team: create one (POST /teams), be invited, or name one with X-Team-ID", errdefs.ErrDenied))
			return
		}
		h(w, r, c)
	})
}

// withUser is withKey for the routes that also serve an access token whose
// user belongs to no team yet (their teams and their tokens).
func (s *Server) withUser(h func(http.ResponseWriter, *http.Request, caller)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		c, err := s.authenticateRequest(r)
		if err != nil {
			s.authFailed(w, r, err)
			return
		}
		if c.edge() {
			s.writeError(w, r, fmt.Errorf("%w: the edge service key cannot manage sandboxes", errdefs.ErrDenied))
			return
		}
		h(w, r, c)
	}
}

// requireAdmin refuses a member (role user) an admin operation.
func requireAdmin(c caller, what string) error {
	if c.Role != store.RoleAdmin {
		return fmt.Errorf("%w: %s needs the team's admin role", errdefs.ErrDenied, what)
	}
	return nil
}
