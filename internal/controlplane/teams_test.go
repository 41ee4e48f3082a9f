package controlplane

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/store"
)

// etcdDump returns every value in the store, to look for secrets at rest.
func etcdDump(t *testing.T, st *store.Store) string {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: st.Endpoints(), DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	resp, err := cli.Get(context.Background(), "", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, kv := range resp.Kvs {
		b.Write(kv.Key)
		b.WriteByte(' ')
		b.Write(kv.Value)
		b.WriteByte('\n')
	}
	return b.String()
}

func TestTeamsKeysTokens(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	admin := map[string]string{"X-API-Key": e.key}

	// The bootstrap key: admin of the bootstrap team, listed by its mask.
	r := e.do("GET", "/teams", admin, nil)
	var teams []e2bapi.Team
	r.decode(t, &teams)
	if r.Code != 200 || len(teams) != 1 || teams[0].TeamID != DefaultTeamID || !teams[0].IsDefault || teams[0].APIKey != "" {
		t.Fatalf("teams: %d %s", r.Code, r.Body)
	}
	var keys []e2bapi.TeamAPIKey
	e.do("GET", "/api-keys", admin, nil).decode(t, &keys)
	if len(keys) != 1 || keys[0].Mask.Prefix != "e2b_" || keys[0].Mask.ValueLength != 40 ||
		keys[0].Mask.MaskedValueSuffix != e.key[len(e.key)-4:] || keys[0].Name != "bootstrap" {
		t.Fatalf("keys: %+v", keys)
	}
	// Its last use is recorded (at most once a minute).
	e.do("GET", "/api-keys", admin, nil).decode(t, &keys)
	if keys[0].LastUsed == nil {
		t.Fatalf("lastUsed not recorded: %+v", keys[0])
	}

	// A member key: shown once, hashed at rest, may not manage keys.
	var mk e2bapi.CreatedTeamAPIKey
	r = e.do("POST", "/api-keys", admin, map[string]any{"name": "ci", "role": "user"})
	r.decode(t, &mk)
	if r.Code != 201 || !apiKeyRE.MatchString(mk.Key) || mk.Role != "user" || mk.Mask.MaskedValuePrefix != mk.Key[4:6] {
		t.Fatalf("create key: %d %s", r.Code, r.Body)
	}
	member := map[string]string{"X-API-Key": mk.Key}
	expectError(t, e.do("POST", "/api-keys", member, map[string]any{"name": "x"}), 403)
	expectError(t, e.do("DELETE", "/api-keys/"+mk.ID, member, nil), 403)
	expectError(t, e.do("PATCH", "/api-keys/"+mk.ID, member, map[string]any{"name": "y"}), 403)
	expectError(t, e.do("POST", "/teams/default/users", member, map[string]any{"email": "a@b.c"}), 403)
	expectError(t, e.do("POST", "/space/v1/keys/rotate", member, nil), 403)
	expectError(t, e.do("GET", "/space/v1/workers", member, nil), 403)
	if r := e.do("GET", "/api-keys", member, nil); r.Code != 200 || strings.Contains(string(r.Body), mk.Key) {
		t.Fatalf("member lists keys: %d %s", r.Code, r.Body)
	}
	if r := e.do("GET", "/sandboxes", member, nil); r.Code != 200 {
		t.Fatalf("member key: %d %s", r.Code, r.Body)
	}
	// Bad input.
	expectError(t, e.do("POST", "/api-keys", admin, map[string]any{"name": ""}), 400)
	expectError(t, e.do("POST", "/api-keys", admin, map[string]any{"name": "x", "role": "edge"}), 400)
	expectError(t, e.do("PATCH", "/api-keys/nosuch", admin, map[string]any{"name": "y"}), 404)
	expectError(t, e.do("DELETE", "/api-keys/nosuch", admin, nil), 404)
	expectError(t, e.do("GET", "/access-tokens", admin, nil), 403)
	expectError(t, e.do("POST", "/teams", admin, map[string]any{"name": "t"}), 403)
	expectError(t, e.do("GET", "/api-keys", map[string]string{"X-API-Key": e.key, HeaderTeamID: "other"}, nil), 403)

	// Rename, then delete: the key fails at once.
	if r := e.do("PATCH", "/api-keys/"+mk.ID, admin, map[string]any{"name": "ci-renamed"}); r.Code != 200 || !strings.Contains(string(r.Body), "ci-renamed") {
		t.Fatalf("rename: %d %s", r.Code, r.Body)
	}
	if r := e.do("DELETE", "/api-keys/"+mk.ID, admin, nil); r.Code != 204 {
		t.Fatalf("delete key: %d %s", r.Code, r.Body)
	}
	expectError(t, e.do("GET", "/sandboxes", member, nil), 401)

	// A user, invited: their first token is shown once; they create a team
	// and act on it with X-Team-ID.
	var inv e2bapi.InvitedTeamMember
	r = e.do("POST", "/teams/default/users", admin, map[string]any{"email": "Ann@example.com"})
	r.decode(t, &inv)
	if r.Code != 201 || inv.Role != "user" || inv.AccessToken == nil || !strings.HasPrefix(inv.AccessToken.Token, "sk_e2b_") || len(inv.AccessToken.Token) != 47 {
		t.Fatalf("invite: %d %s", r.Code, r.Body)
	}
	expectError(t, e.do("POST", "/teams/default/users", admin, map[string]any{"email": "not-an-address"}), 400)
	expectError(t, e.do("POST", "/teams/default/users", admin, map[string]any{"email": "x@example.com", "userID": inv.ID}), 400)
	expectError(t, e.do("POST", "/teams/default/users", admin, map[string]any{}), 400)
	expectError(t, e.do("POST", "/teams/default/users", admin, map[string]any{"userID": "nosuch"}), 404)
	expectError(t, e.do("POST", "/teams/other/users", admin, map[string]any{"email": "b@example.com"}), 404)
	ann := map[string]string{"Authorization": "Bearer " + inv.AccessToken.Token}
	expectError(t, e.do("POST", "/api-keys", ann, map[string]any{"name": "x"}), 403) // a member of default
	var team e2bapi.Team
	e.clock.Advance(time.Second) // the default team is the oldest membership
	r = e.do("POST", "/teams", ann, map[string]any{"name": "ann's"})
	r.decode(t, &team)
	if r.Code != 201 || team.TeamID == "" || team.Name != "ann's" {
		t.Fatalf("create team: %d %s", r.Code, r.Body)
	}
	e.do("GET", "/teams", ann, nil).decode(t, &teams)
	if len(teams) != 2 || teams[0].TeamID != DefaultTeamID || !teams[0].IsDefault || teams[1].TeamID != team.TeamID {
		t.Fatalf("ann's teams: %+v", teams)
	}
	annOwn := map[string]string{"Authorization": ann["Authorization"], HeaderTeamID: team.TeamID}
	// Ann is her team's only admin, and it has no admin key: she can
	// neither leave nor step down while nobody else could manage it.
	expectError(t, e.do("DELETE", "/teams/"+team.TeamID+"/users/"+inv.ID, annOwn, nil), 409)
	expectError(t, e.do("POST", "/teams/"+team.TeamID+"/users", annOwn, map[string]any{"userID": inv.ID, "role": "user"}), 409)
	var ak e2bapi.CreatedTeamAPIKey
	if r := e.do("POST", "/api-keys", annOwn, map[string]any{"name": "mine"}); r.Code != 201 {
		t.Fatalf("admin of own team: %d %s", r.Code, r.Body)
	} else {
		r.decode(t, &ak)
	}
	if ak.CreatedBy == nil || ak.CreatedBy.ID != inv.ID || ak.CreatedBy.Email == nil || *ak.CreatedBy.Email != "Ann@example.com" {
		t.Fatalf("createdBy: %+v", ak.CreatedBy)
	}
	// An admin of another team is no operator.
	expectError(t, e.do("POST", "/space/v1/keys/rotate", annOwn, nil), 403)
	expectError(t, e.do("GET", "/api-keys", map[string]string{"Authorization": ann["Authorization"], HeaderTeamID: "nosuchteam"}, nil), 403)
	// The new team's key sees the new team only.
	e.do("GET", "/teams", map[string]string{"X-API-Key": ak.Key}, nil).decode(t, &teams)
	if len(teams) != 1 || teams[0].TeamID != team.TeamID {
		t.Fatalf("new key's teams: %+v", teams)
	}
	e.do("GET", "/api-keys", map[string]string{"X-API-Key": ak.Key}, nil).decode(t, &keys)
	if len(keys) != 1 || keys[0].ID != ak.ID {
		t.Fatalf("new team's keys: %+v", keys)
	}
	// Another team's key, by id: not found.
	expectError(t, e.do("DELETE", "/api-keys/"+ak.ID, admin, nil), 404)

	// Access tokens: create, list (masks), delete; a deleted token fails.
	var at e2bapi.CreatedAccessToken
	r = e.do("POST", "/access-tokens", ann, map[string]any{"name": "laptop"})
	r.decode(t, &at)
	if r.Code != 201 || at.Mask.Prefix != "sk_e2b_" || at.Mask.MaskedValueSuffix != at.Token[len(at.Token)-4:] {
		t.Fatalf("create token: %d %s", r.Code, r.Body)
	}
	var toks []e2bapi.AccessToken
	e.do("GET", "/access-tokens", ann, nil).decode(t, &toks)
	if len(toks) != 2 {
		t.Fatalf("tokens: %+v", toks)
	}
	laptop := map[string]string{"Authorization": "Bearer " + at.Token}
	if r := e.do("DELETE", "/access-tokens/"+at.ID, laptop, nil); r.Code != 204 {
		t.Fatalf("delete token: %d %s", r.Code, r.Body)
	}
	expectError(t, e.do("GET", "/teams", laptop, nil), 401)
	expectError(t, e.do("DELETE", "/access-tokens/"+at.ID, ann, nil), 404)
	expectError(t, e.do("GET", "/teams", map[string]string{"Authorization": "Bearer sk_e2b_" + strings.Repeat("0", 40)}, nil), 401)
	expectError(t, e.do("GET", "/teams", map[string]string{"Authorization": "Bearer e2b_" + strings.Repeat("0", 40)}, nil), 401)

	// Removed from the team: the token no longer reaches it.
	if r := e.do("DELETE", "/teams/default/users/"+inv.ID, admin, nil); r.Code != 204 {
		t.Fatalf("remove member: %d %s", r.Code, r.Body)
	}
	expectError(t, e.do("GET", "/sandboxes", map[string]string{"Authorization": ann["Authorization"], HeaderTeamID: DefaultTeamID}, nil), 403)

	// Nothing secret at rest: no key or token, only their hashes.
	dump := etcdDump(t, st)
	for _, secret := range []string{e.key, mk.Key, ak.Key, inv.AccessToken.Token, at.Token} {
		if strings.Contains(dump, secret) || strings.Contains(dump, secret[len(secret)-20:]) {
			t.Fatalf("a secret is stored in etcd")
		}
	}
	if !strings.Contains(dump, store.HashAPIKey(ak.Key)) || !strings.Contains(dump, store.HashAPIKey(inv.AccessToken.Token)) {
		t.Fatalf("hashes not stored")
	}
}

// Deletion is seen at once by a second control plane on the same etcd.
func TestRevokedKeyFailsOnEveryControlPlane(t *testing.T) {
	st := openStore(t)
	a := newEnv(t, st, nil)
	b := newEnv(t, st, func(c *Config) { c.BootstrapAPIKey = a.key })
	var k e2bapi.CreatedTeamAPIKey
	a.do("POST", "/api-keys", map[string]string{"X-API-Key": a.key}, map[string]any{"name": "k"}).decode(t, &k)
	if r := b.do("GET", "/sandboxes", map[string]string{"X-API-Key": k.Key}, nil); r.Code != 200 {
		t.Fatalf("key on b: %d", r.Code)
	}
	if r := a.do("DELETE", "/api-keys/"+k.ID, map[string]string{"X-API-Key": a.key}, nil); r.Code != 204 {
		t.Fatalf("delete on a: %d", r.Code)
	}
	expectError(t, b.do("GET", "/sandboxes", map[string]string{"X-API-Key": k.Key}, nil), 401)
}

func TestMaskAndUUID(t *testing.T) {
	m := maskOf("e2b_0123456789abcdef0123456789abcdef01234567", apiKeyPrefix)
	if m != (store.Mask{Prefix: "e2b_", ValueLength: 40, MaskedValuePrefix: "01", MaskedValueSuffix: "4567"}) {
		t.Fatalf("mask %+v", m)
	}
	if m := maskOf("e2b_short", apiKeyPrefix); m.MaskedValuePrefix != "" || m.MaskedValueSuffix != "" {
		t.Fatalf("a short value is not shown at all: %+v", m)
	}
	u := newUUID()
	if len(u) != 36 || u[14] != '4' || !strings.ContainsAny(u[19:20], "89ab") {
		t.Fatalf("uuid %s", u)
	}
}

func FuzzAuthenticateRequest(f *testing.F) {
	f.Add("X-API-Key", "e2b_0000", "")
	f.Add("Authorization", "Bearer sk_e2b_00", "team")
	st := openStoreF(f)
	e := &env{st: st, dir: f.TempDir(), clock: &fakeClock{t: time.Now()}}
	srv, err := New(Config{DataDir: e.dir, EdgeKey: edgeKey}, Deps{Store: st, Logger: quiet()})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { srv.Close() })
	key, _ := srv.BootstrapAPIKey()
	f.Fuzz(func(t *testing.T, header, value, team string) {
		r := httptestRequest(header, value, team)
		c, err := srv.authenticateRequest(r)
		if err == nil && !(value == key || value == edgeKey) {
			t.Fatalf("authenticated %q=%q as %+v", header, value, c)
		}
	})
}

func openStoreF(f *testing.F) *store.Store {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st, err := store.Open(ctx, store.Config{DataDir: f.TempDir(), Logger: quiet()})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { st.Close() })
	return st
}

func httptestRequest(header, value, team string) *http.Request {
	r := httptest.NewRequest("GET", "/teams", nil)
	r.Header[http.CanonicalHeaderKey(header)] = []string{value}
	if team != "" {
		r.Header.Set(HeaderTeamID, team)
	}
	return r
}

func TestAuthLogLimiter(t *testing.T) {
	var l logLimiter
	now := time.Unix(1000, 0)
	for i := range logBurst {
		if ok, _ := l.allow(now); !ok {
			t.Fatalf("line %d suppressed", i)
		}
	}
	for range 5 {
		if ok, _ := l.allow(now.Add(500 * time.Millisecond)); ok {
			t.Fatal("over the burst, logged")
		}
	}
	if ok, n := l.allow(now.Add(time.Second)); !ok || n != 5 {
		t.Fatalf("next second: %v, suppressed %d", ok, n)
	}
}

// An email is no identity: an admin who invites an address gets a new user
// with its own token, never the account another team's admin created
// under that address (and holds the first token of).
func TestInviteByEmailNeverReachesAnotherAccount(t *testing.T) {
	e := newEnv(t, openStore(t), nil)
	admin := map[string]string{"X-API-Key": e.key}
	// Mallory, a user, makes a team and "invites" Alice into it: she now
	// holds that Alice's token.
	var mal e2bapi.InvitedTeamMember
	e.do("POST", "/teams/default/users", admin, map[string]any{"email": "mallory@example.com"}).decode(t, &mal)
	malTok := map[string]string{"Authorization": "Bearer " + mal.AccessToken.Token}
	var mteam e2bapi.Team
	e.clock.Advance(time.Second)
	e.do("POST", "/teams", malTok, map[string]any{"name": "m"}).decode(t, &mteam)
	var squat e2bapi.InvitedTeamMember
	r := e.do("POST", "/teams/"+mteam.TeamID+"/users", map[string]string{"Authorization": malTok["Authorization"], HeaderTeamID: mteam.TeamID},
		map[string]any{"email": "alice@example.com"})
	r.decode(t, &squat)
	if r.Code != 201 || squat.AccessToken == nil {
		t.Fatalf("squat: %d %s", r.Code, r.Body)
	}
	// The bootstrap team's admin invites the real Alice: a new user.
	var alice e2bapi.InvitedTeamMember
	e.do("POST", "/teams/default/users", admin, map[string]any{"email": "alice@example.com", "role": "admin"}).decode(t, &alice)
	if alice.ID == squat.ID || alice.AccessToken == nil {
		t.Fatalf("the invitation reached the squatted account: %+v", alice)
	}
	// The squatted token does not reach the bootstrap team.
	expectError(t, e.do("GET", "/sandboxes", map[string]string{"Authorization": "Bearer " + squat.AccessToken.Token, HeaderTeamID: DefaultTeamID}, nil), 403)
}

// One tenant must not grow etcd without bound (nor every team's key
// listing, which reads every team's keys): a team's API keys and members,
// a user's access tokens and teams are bounded, the next one 400.
func TestTenantCreationsBounded(t *testing.T) {
	e := newEnv(t, openStore(t), nil)
	admin := map[string]string{"X-API-Key": e.key}
	fill := func(what string, limit int, create func(i int) resp) {
		t.Helper()
		for i := range limit + 50 {
			r := create(i)
			if r.Code == 201 {
				continue
			}
			if r.Code != 400 || i == 0 {
				t.Fatalf("%s %d: %d %s", what, i, r.Code, r.Body)
			}
			return
		}
		t.Fatalf("%s: %d created, no bound", what, limit+50)
	}
	fill("api key", maxAPIKeysPerTeam, func(i int) resp {
		return e.do("POST", "/api-keys", admin, map[string]any{"name": fmt.Sprintf("k%d", i), "role": "user"})
	})
	var keys []e2bapi.TeamAPIKey
	e.do("GET", "/api-keys", admin, nil).decode(t, &keys)
	if len(keys) != maxAPIKeysPerTeam {
		t.Fatalf("%d keys (bound %d)", len(keys), maxAPIKeysPerTeam)
	}

	var u e2bapi.InvitedTeamMember
	e.do("POST", "/teams/default/users", admin, map[string]any{"email": "u@example.com"}).decode(t, &u)
	tok := map[string]string{"Authorization": "Bearer " + u.AccessToken.Token}
	fill("access token", maxAccessTokensPerUser, func(i int) resp {
		return e.do("POST", "/access-tokens", tok, map[string]any{"name": fmt.Sprintf("t%d", i)})
	})
	fill("team", maxTeamsPerUser, func(i int) resp {
		return e.do("POST", "/teams", tok, map[string]any{"name": fmt.Sprintf("t%d", i)})
	})
	fill("member", maxMembersPerTeam, func(i int) resp {
		return e.do("POST", "/teams/default/users", admin, map[string]any{"email": fmt.Sprintf("m%d@example.com", i)})
	})
	// A member's role change is not a new member.
	if r := e.do("POST", "/teams/default/users", admin, map[string]any{"userID": u.ID, "role": "admin"}); r.Code != 201 {
		t.Fatalf("role change at the bound: %d %s", r.Code, r.Body)
	}
}

// An admin of one team can add any existing user by id. That must not
// make the team the user's default: Mallory adds Victor (who is in no
// team any more) to her team, and Victor's token, used without
// X-Team-ID, would otherwise create his sandboxes (his code, files and
// secrets) in Mallory's team.
func TestAddedByIDNeverBecomesDefaultTeam(t *testing.T) {
	e := newEnv(t, openStore(t), nil)
	admin := map[string]string{"X-API-Key": e.key}
	var mal, vic e2bapi.InvitedTeamMember
	e.do("POST", "/teams/default/users", admin, map[string]any{"email": "mallory@example.com"}).decode(t, &mal)
	e.do("POST", "/teams/default/users", admin, map[string]any{"email": "victor@example.com"}).decode(t, &vic)
	malTok := "Bearer " + mal.AccessToken.Token
	e.clock.Advance(time.Second)
	var m e2bapi.Team
	e.do("POST", "/teams", map[string]string{"Authorization": malTok}, map[string]any{"name": "m"}).decode(t, &m)
	if r := e.do("DELETE", "/teams/default/users/"+vic.ID, admin, nil); r.Code != 204 {
		t.Fatalf("remove victor: %d %s", r.Code, r.Body)
	}
	if r := e.do("POST", "/teams/"+m.TeamID+"/users", map[string]string{"Authorization": malTok, HeaderTeamID: m.TeamID},
		map[string]any{"userID": vic.ID}); r.Code != 201 {
		t.Fatalf("mallory adds victor: %d %s", r.Code, r.Body)
	}
	victor := map[string]string{"Authorization": "Bearer " + vic.AccessToken.Token}
	expectError(t, e.do("GET", "/sandboxes", victor, nil), 403)
	expectError(t, e.do("POST", "/events/webhooks", victor, map[string]any{"name": "x", "url": "https://example.com/",
		"events": []string{e2bapi.EventCreated}, "signatureSecret": "0123456789"}), 403)
	var teams []e2bapi.Team
	e.do("GET", "/teams", victor, nil).decode(t, &teams)
	if len(teams) != 1 || teams[0].TeamID != m.TeamID || teams[0].IsDefault {
		t.Fatalf("victor's teams: %+v", teams)
	}
	// Victor may still act on it on purpose.
	if r := e.do("GET", "/sandboxes", map[string]string{"Authorization": victor["Authorization"], HeaderTeamID: m.TeamID}, nil); r.Code != 200 {
		t.Fatalf("victor naming the team: %d %s", r.Code, r.Body)
	}
	// A team Victor creates is his default.
	e.clock.Advance(time.Second)
	var own e2bapi.Team
	e.do("POST", "/teams", victor, map[string]any{"name": "v"}).decode(t, &own)
	if !own.IsDefault {
		t.Fatalf("victor's own team: %+v", own)
	}
	if r := e.do("GET", "/sandboxes", victor, nil); r.Code != 200 {
		t.Fatalf("victor's default: %d %s", r.Code, r.Body)
	}
}
