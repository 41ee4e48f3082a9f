package sdk

import (
	"context"
	"net/http"
	"net/url"

	"github.com/spacesbx/space/api/e2bapi"
)

// Teams, API keys, members and access tokens (docs/API.md). A key or token
// is returned once, by the call that creates it.

// ListTeams returns the caller's teams: an API key's own, or an access
// token's user's.
func (c *Client) ListTeams(ctx context.Context) ([]e2bapi.Team, error) {
	var out []e2bapi.Team
	return out, c.rest(ctx, http.MethodGet, "/teams", nil, &out, nil)
}

// CreateTeam creates a team whose admin is the access token's user.
func (c *Client) CreateTeam(ctx context.Context, name string) (e2bapi.Team, error) {
	var out e2bapi.Team
	return out, c.rest(ctx, http.MethodPost, "/teams", e2bapi.NewTeam{Name: name}, &out, nil)
}

// ListAPIKeys returns the team's keys (masks only).
func (c *Client) ListAPIKeys(ctx context.Context) ([]e2bapi.TeamAPIKey, error) {
	var out []e2bapi.TeamAPIKey
	return out, c.rest(ctx, http.MethodGet, "/api-keys", nil, &out, nil)
}

// CreateAPIKey creates a key of role "admin" (role "") or "user".
func (c *Client) CreateAPIKey(ctx context.Context, name, role string) (e2bapi.CreatedTeamAPIKey, error) {
	var out e2bapi.CreatedTeamAPIKey
	return out, c.rest(ctx, http.MethodPost, "/api-keys", e2bapi.NewTeamAPIKey{Name: name, Role: role}, &out, nil)
}

// RenameAPIKey renames the key id.
func (c *Client) RenameAPIKey(ctx context.Context, id, name string) error {
	return c.rest(ctx, http.MethodPatch, "/api-keys/"+url.PathEscape(id), e2bapi.UpdateTeamAPIKey{Name: name}, nil, nil)
}

// DeleteAPIKey deletes the key id: it fails at once.
func (c *Client) DeleteAPIKey(ctx context.Context, id string) error {
	return c.rest(ctx, http.MethodDelete, "/api-keys/"+url.PathEscape(id), nil, nil, nil)
}

// ListMembers returns team's members.
func (c *Client) ListMembers(ctx context.Context, team string) ([]e2bapi.TeamMember, error) {
	var out []e2bapi.TeamMember
	return out, c.rest(ctx, http.MethodGet, "/teams/"+url.PathEscape(team)+"/users", nil, &out, nil)
}

// InviteMember creates a new user labelled email, member of team with role
// ("" is "user"); the answer carries the user's first access token.
func (c *Client) InviteMember(ctx context.Context, team, email, role string) (e2bapi.InvitedTeamMember, error) {
	var out e2bapi.InvitedTeamMember
	return out, c.rest(ctx, http.MethodPost, "/teams/"+url.PathEscape(team)+"/users", e2bapi.NewTeamMember{Email: email, Role: role}, &out, nil)
}

// AddMember adds the existing user userID to team with role, or changes
// the member's role.
func (c *Client) AddMember(ctx context.Context, team, userID, role string) (e2bapi.InvitedTeamMember, error) {
	var out e2bapi.InvitedTeamMember
	return out, c.rest(ctx, http.MethodPost, "/teams/"+url.PathEscape(team)+"/users", e2bapi.NewTeamMember{UserID: userID, Role: role}, &out, nil)
}

// RemoveMember removes the user from team.
func (c *Client) RemoveMember(ctx context.Context, team, userID string) error {
	return c.rest(ctx, http.MethodDelete, "/teams/"+url.PathEscape(team)+"/users/"+url.PathEscape(userID), nil, nil, nil)
}

// ListAccessTokens returns the access token's user's tokens (masks only).
func (c *Client) ListAccessTokens(ctx context.Context) ([]e2bapi.AccessToken, error) {
	var out []e2bapi.AccessToken
	return out, c.rest(ctx, http.MethodGet, "/access-tokens", nil, &out, nil)
}

// CreateAccessToken creates another token for the access token's user.
func (c *Client) CreateAccessToken(ctx context.Context, name string) (e2bapi.CreatedAccessToken, error) {
	var out e2bapi.CreatedAccessToken
	return out, c.rest(ctx, http.MethodPost, "/access-tokens", e2bapi.NewAccessToken{Name: name}, &out, nil)
}

// DeleteAccessToken deletes the user's token id.
func (c *Client) DeleteAccessToken(ctx context.Context, id string) error {
	return c.rest(ctx, http.MethodDelete, "/access-tokens/"+url.PathEscape(id), nil, nil, nil)
}
