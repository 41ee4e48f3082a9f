package store

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

func TestTeamsUsersMembers(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()
	now := time.Now().UTC()

	if err := s.CreateTeam(ctx, TeamRecord{ID: "a/b", Name: "x"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad team id: %v", err)
	}
	if err := s.CreateTeam(ctx, TeamRecord{ID: "t1", Name: "one", CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	if err := s.CreateTeam(ctx, TeamRecord{ID: "t1", Name: "again"}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("duplicate team: %v", err)
	}
	if got, err := s.EnsureTeam(ctx, TeamRecord{ID: "t1", Name: "ignored"}); err != nil || got.Name != "one" {
		t.Fatalf("ensure existing: %+v %v", got, err)
	}
	if _, err := s.GetTeam(ctx, "nosuch"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing team: %v", err)
	}

	if err := s.CreateUser(ctx, UserRecord{ID: "u1", Email: "Ann@Example.com", CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	if err := s.CreateUser(ctx, UserRecord{ID: "u1", Email: "bob@example.com"}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("same id: %v", err)
	}
	if err := s.CreateUser(ctx, UserRecord{ID: "u2", Email: "Ann@Example.com"}); err != nil {
		t.Fatalf("same email, another user: %v", err)
	}
	if err := s.CreateUser(ctx, UserRecord{ID: "", Email: "x@y"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("no id: %v", err)
	}
	if u, err := s.GetUser(ctx, "u1"); err != nil || u.Email != "Ann@Example.com" {
		t.Fatalf("get user: %+v %v", u, err)
	}
	if _, err := s.GetUser(ctx, "nosuch"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown user: %v", err)
	}

	if err := s.PutMember(ctx, MemberRecord{TeamID: "t1", UserID: "u1", Role: RoleEdge}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("edge role for a member: %v", err)
	}
	if err := s.PutMember(ctx, MemberRecord{TeamID: "t2", UserID: "u1", Role: RoleUser, CreatedAt: now.Add(time.Second)}); err != nil {
		t.Fatal(err)
	}
	if err := s.PutMember(ctx, MemberRecord{TeamID: "t1", UserID: "u1", Role: RoleAdmin, CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	ms, err := s.Memberships(ctx, "u1")
	if err != nil || len(ms) != 2 || ms[0].TeamID != "t1" || ms[0].Role != RoleAdmin {
		t.Fatalf("memberships (oldest first): %+v %v", ms, err)
	}
	if ms, _ := s.Members(ctx, "t1"); len(ms) != 1 || ms[0].UserID != "u1" {
		t.Fatalf("members: %+v", ms)
	}
	if err := s.DeleteMember(ctx, "t1", "u1"); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteMember(ctx, "t1", "u1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("delete again: %v", err)
	}
	if ms, _ := s.Memberships(ctx, "u1"); len(ms) != 1 || ms[0].TeamID != "t2" {
		t.Fatalf("after removal: %+v", ms)
	}
}

func TestAccessTokens(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()
	h1, h2 := HashAPIKey("sk_e2b_1"), HashAPIKey("sk_e2b_2")
	if err := s.CreateAccessToken(ctx, "nothex", AccessTokenRecord{ID: "a", UserID: "u"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad hash: %v", err)
	}
	if err := s.CreateAccessToken(ctx, h1, AccessTokenRecord{ID: "a", UserID: "u", CreatedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	if err := s.CreateAccessToken(ctx, h1, AccessTokenRecord{ID: "b", UserID: "u"}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("same hash: %v", err)
	}
	if err := s.CreateAccessToken(ctx, h2, AccessTokenRecord{ID: "b", UserID: "u", CreatedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	if rec, err := s.LookupAccessToken(ctx, h1); err != nil || rec.ID != "a" {
		t.Fatalf("lookup: %+v %v", rec, err)
	}
	if toks, _ := s.ListAccessTokens(ctx, "u"); len(toks) != 2 {
		t.Fatalf("list: %+v", toks)
	}
	if err := s.DeleteAccessToken(ctx, "other", "a"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("another user's token: %v", err)
	}
	if err := s.DeleteAccessToken(ctx, "u", "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.LookupAccessToken(ctx, h1); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("deleted token still found: %v", err)
	}
	if toks, _ := s.ListAccessTokens(ctx, "u"); len(toks) != 1 || toks[0].ID != "b" {
		t.Fatalf("after delete: %+v", toks)
	}
}

func TestAPIKeyListFindUpdateTouch(t *testing.T) {
	s := openTest(t, t.TempDir())
	defer s.Close()
	ctx := context.Background()
	h := HashAPIKey("e2b_k1")
	rec := APIKeyRecord{TeamID: "t1", KeyID: "k1", Role: RoleAdmin, Name: "one", CreatedAt: time.Now()}
	if err := s.CreateAPIKey(ctx, h, rec); err != nil {
		t.Fatal(err)
	}
	if err := s.CreateAPIKey(ctx, h, rec); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("same hash: %v", err)
	}
	if err := s.CreateAPIKey(ctx, HashAPIKey("x"), APIKeyRecord{TeamID: "t1", KeyID: "k9", Role: "root"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad role: %v", err)
	}
	if err := s.PutAPIKey(ctx, HashAPIKey("e2b_k2"), APIKeyRecord{TeamID: "t2", KeyID: "k2", Role: RoleUser}); err != nil {
		t.Fatal(err)
	}
	if ks, _ := s.ListAPIKeys(ctx, "t1"); len(ks) != 1 || ks[0].KeyID != "k1" || ks[0].Hash != h {
		t.Fatalf("list t1: %+v", ks)
	}
	if _, err := s.FindAPIKey(ctx, "t1", "k2"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("another team's key: %v", err)
	}
	e, err := s.FindAPIKey(ctx, "t1", "k1")
	if err != nil {
		t.Fatal(err)
	}
	// A touch with the revision read before a rename does not write back.
	_, rev, _ := s.LookupAPIKeyRev(ctx, h)
	if _, err := s.UpdateAPIKey(ctx, e, func(k *APIKeyRecord) { k.Name = "renamed"; k.TeamID = "t2" }); err != nil {
		t.Fatal(err)
	}
	if _, err := s.UpdateAPIKey(ctx, e, func(k *APIKeyRecord) { k.Name = "stale" }); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("stale update: %v", err)
	}
	if err := s.TouchAPIKey(ctx, h, rev, rec, time.Now()); err != nil {
		t.Fatal(err)
	}
	got, rev, _ := s.LookupAPIKeyRev(ctx, h)
	if got.Name != "renamed" || got.TeamID != "t1" || got.LastUsed != nil {
		t.Fatalf("after update and stale touch: %+v", got)
	}
	if err := s.TouchAPIKey(ctx, h, rev, got, time.Now()); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.LookupAPIKey(ctx, h); got.LastUsed == nil {
		t.Fatalf("touch not written: %+v", got)
	}
	// A touch after deletion does not bring the key back.
	_, rev, _ = s.LookupAPIKeyRev(ctx, h)
	if err := s.DeleteAPIKey(ctx, h); err != nil {
		t.Fatal(err)
	}
	if err := s.TouchAPIKey(ctx, h, rev, got, time.Now()); err != nil {
		t.Fatal(err)
	}
	if _, err := s.LookupAPIKey(ctx, h); !errors.Is(err, errdefs.ErrNotFound) || strings.Contains(err.Error(), "e2b_") {
		t.Fatalf("deleted key resurrected: %v", err)
	}
}
