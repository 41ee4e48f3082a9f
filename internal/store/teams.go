package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/internal/errdefs"
)

// Teams, users and memberships. A membership is written twice in one
// transaction, under the team (who is in it) and under the user (which
// teams they are in), so both questions are one prefix read.
const (
	teamsPrefix       = prefix + "teams/"
	usersPrefix       = prefix + "users/"
	membersPrefix     = prefix + "members/"     // members/<team>/<user> -> MemberRecord
	membershipsPrefix = prefix + "memberships/" // memberships/<user>/<team> -> MemberRecord
)

// TeamRecord is a team: the owner of sandboxes, templates, snapshots,
// volumes, secrets and API keys.
type TeamRecord struct {
	ID        string    `json:"id"`
	Name      string    `json:"name"`
	CreatedAt time.Time `json:"created_at"`
}

// UserRecord is a person (or robot) holding access tokens, member of teams.
type UserRecord struct {
	ID        string    `json:"id"`
	Email     string    `json:"email"`
	CreatedAt time.Time `json:"created_at"`
}

// MemberRecord is one user's membership of one team.
type MemberRecord struct {
	TeamID    string    `json:"team_id"`
	UserID    string    `json:"user_id"`
	Role      string    `json:"role"`
	CreatedAt time.Time `json:"created_at"`
	// Added: an admin of the team added an existing user by id, without
	// the user's say. Such a membership is never the user's default team
	// (a token without X-Team-ID must not start acting on a team someone
	// else chose for it).
	Added bool `json:"added,omitempty"`
}

func validIDPart(s string) bool {
	return s != "" && len(s) <= 128 && !strings.ContainsAny(s, "/\x00")
}

// EnsureTeam creates team rec unless a team of that id exists; it returns
// the stored team either way.
func (s *Store) EnsureTeam(ctx context.Context, rec TeamRecord) (TeamRecord, error) {
	err := s.CreateTeam(ctx, rec)
	if err == nil {
		return rec, nil
	}
	if !errors.Is(err, errdefs.ErrConflict) {
		return TeamRecord{}, err
	}
	return s.GetTeam(ctx, rec.ID)
}

// CreateTeam writes a new team (errdefs.ErrConflict if the id is taken).
func (s *Store) CreateTeam(ctx context.Context, rec TeamRecord) error {
	if !validIDPart(rec.ID) {
		return fmt.Errorf("store: create team: %w: bad id", errdefs.ErrInvalid)
	}
	return s.create(ctx, "create team", teamsPrefix+rec.ID, rec)
}

// GetTeam returns team id (errdefs.ErrNotFound).
func (s *Store) GetTeam(ctx context.Context, id string) (TeamRecord, error) {
	var rec TeamRecord
	if !validIDPart(id) {
		return rec, fmt.Errorf("store: team: %w", errdefs.ErrNotFound)
	}
	_, err := s.getJSON(ctx, "team", teamsPrefix+id, &rec)
	return rec, err
}

// CreateUser writes a new user (errdefs.ErrConflict if the id is taken).
// The email is a label, not an identity: two users may share one, so that
// an invitation never hands anyone an account someone else was invited to.
func (s *Store) CreateUser(ctx context.Context, rec UserRecord) error {
	if !validIDPart(rec.ID) || !validIDPart(rec.Email) {
		return fmt.Errorf("store: create user: %w: bad id or email", errdefs.ErrInvalid)
	}
	return s.create(ctx, "create user", usersPrefix+rec.ID, rec)
}

// GetUser returns user id (errdefs.ErrNotFound).
func (s *Store) GetUser(ctx context.Context, id string) (UserRecord, error) {
	var rec UserRecord
	if !validIDPart(id) {
		return rec, fmt.Errorf("store: user: %w", errdefs.ErrNotFound)
	}
	_, err := s.getJSON(ctx, "user", usersPrefix+id, &rec)
	return rec, err
}

// PutMember adds user to team with role, or changes their role.
func (s *Store) PutMember(ctx context.Context, m MemberRecord) error {
	if !validIDPart(m.TeamID) || !validIDPart(m.UserID) || !ValidMemberRole(m.Role) {
		return fmt.Errorf("store: put member: %w: bad team, user or role", errdefs.ErrInvalid)
	}
	b, _ := json.Marshal(m)
	if _, err := s.cli.Txn(ctx).Then(
		clientv3.OpPut(membersPrefix+m.TeamID+"/"+m.UserID, string(b)),
		clientv3.OpPut(membershipsPrefix+m.UserID+"/"+m.TeamID, string(b)),
	).Commit(); err != nil {
		return wrapErr("put member", err)
	}
	return nil
}

// DeleteMember removes user from team (errdefs.ErrNotFound if not a member).
func (s *Store) DeleteMember(ctx context.Context, team, user string) error {
	if !validIDPart(team) || !validIDPart(user) {
		return fmt.Errorf("store: member: %w", errdefs.ErrNotFound)
	}
	resp, err := s.cli.Txn(ctx).Then(
		clientv3.OpDelete(membersPrefix+team+"/"+user),
		clientv3.OpDelete(membershipsPrefix+user+"/"+team),
	).Commit()
	if err != nil {
		return wrapErr("delete member", err)
	}
	if resp.Responses[0].GetResponseDeleteRange().Deleted == 0 {
		return fmt.Errorf("store: member: %w", errdefs.ErrNotFound)
	}
	return nil
}

// Members lists team's members, oldest first.
func (s *Store) Members(ctx context.Context, team string) ([]MemberRecord, error) {
	if !validIDPart(team) {
		return nil, nil
	}
	return s.listMembers(ctx, membersPrefix+team+"/")
}

// Memberships lists user's teams, oldest membership first (the first is the
// user's default team).
func (s *Store) Memberships(ctx context.Context, user string) ([]MemberRecord, error) {
	if !validIDPart(user) {
		return nil, nil
	}
	return s.listMembers(ctx, membershipsPrefix+user+"/")
}

func (s *Store) listMembers(ctx context.Context, p string) ([]MemberRecord, error) {
	resp, err := s.cli.Get(ctx, p, clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list members", err)
	}
	out := make([]MemberRecord, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var m MemberRecord
		if err := json.Unmarshal(kv.Value, &m); err != nil {
			return nil, fmt.Errorf("store: decode member: %w", err)
		}
		out = append(out, m)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

// create writes v under k unless k exists (errdefs.ErrConflict).
func (s *Store) create(ctx context.Context, op, k string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("store: %s: %w", op, err)
	}
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).Then(clientv3.OpPut(k, string(b))).Commit()
	if err != nil {
		return wrapErr(op, err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: %s: %w: exists", op, errdefs.ErrConflict)
	}
	return nil
}
