package isolation

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/openapi3"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/openapi"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

type client struct {
	t    *testing.T
	base string
	hc   *http.Client
}

type answer struct {
	code int
	body []byte
}

func (c *client) do(method, path string, hdr map[string]string, body any) answer {
	c.t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, c.base+path, rd)
	if err != nil {
		c.t.Fatal(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, b}
}

// must is do, failing t unless the answer has status want; it decodes the
// body into out.
func (c *client) must(method, path string, hdr map[string]string, body any, want int, out any) {
	c.t.Helper()
	a := c.do(method, path, hdr, body)
	if a.code != want {
		c.t.Fatalf("%s %s: %d, want %d: %.400s", method, path, a.code, want, a.body)
	}
	if out != nil {
		if err := json.Unmarshal(a.body, out); err != nil {
			c.t.Fatalf("%s %s: decode %.200s: %v", method, path, a.body, err)
		}
	}
}

func key(k string) map[string]string { return map[string]string{"X-API-Key": k} }
func bearer(tok, team string) map[string]string {
	h := map[string]string{"Authorization": "Bearer " + tok}
	if team != "" {
		h["X-Team-ID"] = team
	}
	return h
}

// victim is team A's objects: the ids the walk addresses, and markers
// that appear only in A's data (never in a request), which no answer to
// another credential may contain.
type victim struct {
	params  map[string]string // path parameter -> A's object
	markers []string
}

type created struct {
	ID    string `json:"id"`
	Key   string `json:"key"`
	Token string `json:"token"`
}

func TestTeamIsolation(t *testing.T) {
	// Private webhook URLs allowed: the walker registers a real webhook
	// (on loopback) so that its routes are walked with a real id.
	p := testenv.StartPlatform(t, testenv.PlatformOptions{Args: []string{"--webhook-allow-private"}})
	c := &client{t: t, base: p.APIURL, hc: &http.Client{Timeout: 2 * time.Minute}}
	adminA := key(p.APIKey)
	const teamA = "default"
	mark := "mk" + randHex(6)
	v := victim{params: map[string]string{"teamID": teamA, "team": teamA}}

	// Team A: the bootstrap team, with one object of every kind.
	var sb struct {
		SandboxID string `json:"sandboxID"`
	}
	c.must("POST", "/v2/sandboxes", adminA, map[string]any{"templateID": "base", "timeout": 600,
		"metadata": map[string]string{"owner": mark + "-meta"}}, 201, &sb)
	v.params["sandboxID"] = sb.SandboxID
	v.markers = append(v.markers, mark+"-meta")
	var snap struct {
		SnapshotID string `json:"snapshotID"`
	}
	c.must("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", adminA, map[string]any{"name": mark + "-snap"}, 201, &snap)
	v.markers = append(v.markers, mark+"-snap")
	var tpl struct {
		TemplateID string `json:"templateID"`
		BuildID    string `json:"buildID"`
	}
	c.must("POST", "/v3/templates", adminA, map[string]any{"name": mark + "-tpl"}, 202, &tpl)
	v.params["templateID"], v.params["buildID"], v.params["alias"] = tpl.TemplateID, tpl.BuildID, mark+"-tpl"
	var vol struct {
		VolumeID string `json:"volumeID"`
		Token    string `json:"token"`
	}
	c.must("POST", "/volumes", adminA, map[string]any{"name": mark + "-vol"}, 201, &vol)
	v.params["volumeID"] = vol.VolumeID
	v.markers = append(v.markers, mark+"-vol", vol.Token)
	var sec struct {
		SecretID string `json:"secretID"`
	}
	c.must("POST", "/secrets", adminA, map[string]any{"name": mark + "-sec", "value": "v-" + mark}, 201, &sec)
	v.params["secretID"] = sec.SecretID
	v.markers = append(v.markers, mark+"-sec", "v-"+mark)
	var keyA2, memberA created
	c.must("POST", "/api-keys", adminA, map[string]any{"name": mark + "-key"}, 201, &keyA2)
	c.must("POST", "/api-keys", adminA, map[string]any{"name": mark + "-member", "role": "user"}, 201, &memberA)
	v.params["apiKeyID"] = keyA2.ID
	v.markers = append(v.markers, mark+"-key", keyA2.Key, memberA.Key)
	var userA struct {
		ID          string  `json:"id"`
		AccessToken created `json:"accessToken"`
	}
	c.must("POST", "/teams/"+teamA+"/users", adminA, map[string]any{"email": mark + "-a@example.com"}, 201, &userA)
	v.params["userID"], v.params["accessTokenID"] = userA.ID, userA.AccessToken.ID
	v.markers = append(v.markers, mark+"-a@example.com", userA.AccessToken.Token)
	v.params["webhookID"] = "wh-" + randHex(8) // replaced by a real one once webhooks exist
	var wh struct {
		ID string `json:"id"`
	}
	if a := c.do("POST", "/events/webhooks", adminA, map[string]any{"name": mark + "-wh", "url": "http://127.0.0.1:9/hook",
		"enabled": false, "events": []string{"sandbox.lifecycle.created"}, "signatureSecret": mark + "-whsecret"}); a.code == 201 {
		_ = json.Unmarshal(a.body, &wh)
		v.params["webhookID"] = wh.ID
		v.markers = append(v.markers, mark+"-wh", mark+"-whsecret")
	} else {
		t.Logf("webhooks not there yet (%d): the walker addresses a made-up webhook id", a.code)
	}
	v.params["hash"] = strings.Repeat("ab", 32)

	// Team B: a user invited into A as a plain member creates team B and
	// its keys; B's member key, B's volume token, and a revoked key of B.
	var userB struct {
		ID          string  `json:"id"`
		AccessToken created `json:"accessToken"`
	}
	c.must("POST", "/teams/"+teamA+"/users", adminA, map[string]any{"email": mark + "-b@example.com"}, 201, &userB)
	var teamB struct {
		TeamID string `json:"teamID"`
	}
	c.must("POST", "/teams", bearer(userB.AccessToken.Token, ""), map[string]any{"name": "team-b"}, 201, &teamB)
	// B leaves A: from now on B's token reaches team B only.
	c.must("DELETE", "/teams/"+teamA+"/users/"+userB.ID, adminA, nil, 204, nil)
	tokB := bearer(userB.AccessToken.Token, teamB.TeamID)
	var adminB, memberB, revokedB created
	c.must("POST", "/api-keys", tokB, map[string]any{"name": "b-admin"}, 201, &adminB)
	c.must("POST", "/api-keys", tokB, map[string]any{"name": "b-member", "role": "user"}, 201, &memberB)
	c.must("POST", "/api-keys", tokB, map[string]any{"name": "b-revoked"}, 201, &revokedB)
	c.must("DELETE", "/api-keys/"+revokedB.ID, tokB, nil, 204, nil)
	var volB struct {
		Token string `json:"token"`
	}
	c.must("POST", "/volumes", key(adminB.Key), map[string]any{"name": "vol-b"}, 201, &volB)
	var sbB struct {
		SandboxID string `json:"sandboxID"`
	}
	c.must("POST", "/v2/sandboxes", key(adminB.Key), map[string]any{"templateID": "base", "timeout": 600}, 201, &sbB)

	doc, err := openapi3.NewLoader().LoadFromData(openapi.YAML)
	if err != nil {
		t.Fatal(err)
	}
	attackers := []struct {
		name string
		hdr  map[string]string
		// onlyAdmin limits the attacker to the admin operations.
		onlyAdmin bool
		// own: a valid credential of team B, which may list (not create:
		// that proves nothing and costs sandboxes) in its own team.
		own bool
	}{
		{name: "no credential", hdr: map[string]string{}},
		{name: "revoked key", hdr: key(revokedB.Key)},
		{name: "made-up key", hdr: key("e2b_" + randHex(20))},
		{name: "made-up token", hdr: bearer("sk_e2b_"+randHex(20), "")},
		{name: "team B admin key", hdr: key(adminB.Key), own: true},
		{name: "team B member key", hdr: key(memberB.Key), own: true},
		{name: "team B user token", hdr: tokB, own: true},
		{name: "team B token naming team A", hdr: bearer(userB.AccessToken.Token, teamA)},
		{name: "team B admin key naming team A", hdr: map[string]string{"X-API-Key": adminB.Key, "X-Team-ID": teamA}},
		{name: "team B volume token", hdr: map[string]string{"Authorization": "Bearer " + volB.Token}},
		{name: "team A member key", hdr: key(memberA.Key), onlyAdmin: true},
	}
	ops := operations(doc)
	walked := 0
	statuses := map[string]int{}
	// check judges one answer to a credential that is not team A's.
	check := func(who string, o op, path string, body any, hdr map[string]string, own bool) {
		t.Helper()
		a := c.do(o.method, path, hdr, body)
		what := fmt.Sprintf("%s: %s %s (%s)", who, o.method, path, o.id)
		switch {
		case a.code == 401 || a.code == 403 || a.code == 404:
		case o.pending != "" && a.code == 400:
			// Not merged yet: a route that shadows it refuses the path.
		case own && o.ownCollection && a.code < 300 && !o.operator:
			// The credential's own team's (empty or B's) collection.
		default:
			t.Errorf("%s: %d, want 401, 403 or 404: %.300s", what, a.code, a.body)
		}
		sent, _ := json.Marshal(body)
		statuses[who+" "+strconv.Itoa(a.code)]++
		for _, m := range v.markers {
			if m != "" && bytes.Contains(a.body, []byte(m)) && !strings.Contains(path, m) && !bytes.Contains(sent, []byte(m)) {
				t.Errorf("%s: the answer holds team A's data (%.8s...): %.300s", what, m, a.body)
			}
		}
		if bytes.Contains(a.body, []byte(`"`+sb.SandboxID+`"`)) {
			t.Errorf("%s: the answer names team A's sandbox: %.300s", what, a.body)
		}
	}
	for _, at := range attackers {
		for _, o := range ops {
			if o.public || (at.onlyAdmin && !o.admin) || (at.own && o.ownCollection && o.method == "POST" && !o.operator) {
				continue
			}
			path, body := o.request(v)
			check(at.name, o, path, body, at.hdr, at.own)
			walked++
		}
		// Team A's objects reached through another operation's body or
		// query: a sandbox from A's snapshot, template or volume, A's
		// snapshots by sandbox, A's snapshot deleted as a template.
		if at.onlyAdmin {
			continue
		}
		for _, x := range []struct {
			method, path string
			body         any
		}{
			{"POST", "/v2/sandboxes", map[string]any{"templateID": snap.SnapshotID}},
			{"POST", "/v2/sandboxes", map[string]any{"templateID": mark + "-tpl"}},
			{"POST", "/v2/sandboxes", map[string]any{"templateID": "base", "volumeMounts": []map[string]string{{"name": mark + "-vol", "path": "/mnt/v"}}}},
			{"POST", "/sandboxes/" + sb.SandboxID + "/fork", map[string]any{"count": 1}},
			{"DELETE", "/templates/" + snap.SnapshotID, nil},
			{"GET", "/snapshots?sandboxID=" + sb.SandboxID, nil},
			{"GET", "/snapshots?name=" + mark + "-snap", nil},
			{"GET", "/v2/sandboxes?metadata=owner%3D" + mark + "-meta", nil},
		} {
			check(at.name, op{method: x.method, path: x.path, id: "extra", ownCollection: x.method == "GET"}, x.path, x.body, at.hdr, at.own)
			walked++
		}
	}
	t.Logf("walked %d requests over %d operations with %d credentials", walked, len(ops), len(attackers))
	var st []string
	for k, n := range statuses {
		st = append(st, fmt.Sprintf("%s: %d", k, n))
	}
	sort.Strings(st)
	t.Logf("answers by credential and status:\n%s", strings.Join(st, "\n"))

	// Team A's objects are intact and its credentials still work.
	c.must("GET", "/sandboxes/"+sb.SandboxID, adminA, nil, 200, nil)
	c.must("GET", "/secrets/"+sec.SecretID, adminA, nil, 200, nil)
	c.must("GET", "/volumes/"+vol.VolumeID, adminA, nil, 200, nil)
	c.must("GET", "/templates/"+tpl.TemplateID, adminA, nil, 200, nil)
	c.must("GET", "/sandboxes", key(keyA2.Key), nil, 200, nil)
	c.must("GET", "/access-tokens", bearer(userA.AccessToken.Token, ""), nil, 200, nil)
	var snaps []struct {
		SnapshotID string `json:"snapshotID"`
	}
	c.must("GET", "/snapshots", adminA, nil, 200, &snaps)
	if !slices.ContainsFunc(snaps, func(s struct {
		SnapshotID string `json:"snapshotID"`
	}) bool {
		return s.SnapshotID == snap.SnapshotID
	}) {
		t.Errorf("team A's snapshot %s is gone: %+v", snap.SnapshotID, snaps)
	}
	var keysA []struct {
		ID string `json:"id"`
	}
	c.must("GET", "/api-keys", adminA, nil, 200, &keysA)
	if len(keysA) != 3 {
		t.Errorf("team A's keys: %+v", keysA)
	}
	c.must("DELETE", "/sandboxes/"+sb.SandboxID, adminA, nil, 204, nil)
	c.must("DELETE", "/sandboxes/"+sbB.SandboxID, key(adminB.Key), nil, 204, nil)
	sdkTeams(t, p.APIURL, userB.AccessToken.Token, teamB.TeamID)
}

// sdkTeams drives the Go SDK's team calls as team B's user.
func sdkTeams(t *testing.T, apiURL, token, team string) {
	ctx := context.Background()
	cl, err := sdk.New(sdk.Config{APIURL: apiURL, AccessToken: token, TeamID: team})
	if err != nil {
		t.Fatal(err)
	}
	teams, err := cl.ListTeams(ctx)
	if err != nil || len(teams) != 1 || teams[0].TeamID != team {
		t.Fatalf("sdk teams: %+v %v", teams, err)
	}
	k, err := cl.CreateAPIKey(ctx, "sdk", "user")
	if err != nil || k.Key == "" || k.Role != "user" {
		t.Fatalf("sdk create key: %+v %v", k, err)
	}
	if err := cl.RenameAPIKey(ctx, k.ID, "sdk-2"); err != nil {
		t.Fatal(err)
	}
	keys, err := cl.ListAPIKeys(ctx)
	if err != nil || !slices.ContainsFunc(keys, func(x e2bapi.TeamAPIKey) bool { return x.ID == k.ID && x.Name == "sdk-2" }) {
		t.Fatalf("sdk keys: %+v %v", keys, err)
	}
	if err := cl.DeleteAPIKey(ctx, k.ID); err != nil {
		t.Fatal(err)
	}
	withKey, _ := sdk.New(sdk.Config{APIURL: apiURL, APIKey: k.Key})
	if _, err := withKey.ListTeams(ctx); !errors.Is(err, sdk.ErrUnauthorized) {
		t.Fatalf("deleted key: %v", err)
	}
	at, err := cl.CreateAccessToken(ctx, "sdk")
	if err != nil || at.Token == "" {
		t.Fatalf("sdk token: %+v %v", at, err)
	}
	if toks, err := cl.ListAccessTokens(ctx); err != nil || len(toks) != 2 {
		t.Fatalf("sdk tokens: %+v %v", toks, err)
	}
	if err := cl.DeleteAccessToken(ctx, at.ID); err != nil {
		t.Fatal(err)
	}
	m, err := cl.InviteMember(ctx, team, "sdk-"+randHex(4)+"@example.com", "")
	if err != nil || m.Role != "user" || m.AccessToken == nil {
		t.Fatalf("sdk invite: %+v %v", m, err)
	}
	if _, err := cl.AddMember(ctx, team, m.ID, "admin"); err != nil {
		t.Fatalf("sdk role change: %v", err)
	}
	if ms, err := cl.ListMembers(ctx, team); err != nil || len(ms) != 2 || !slices.ContainsFunc(ms, func(x e2bapi.TeamMember) bool { return x.ID == m.ID && x.Role == "admin" }) {
		t.Fatalf("sdk members: %+v %v", ms, err)
	}
	if err := cl.RemoveMember(ctx, team, m.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.CreateTeam(ctx, "sdk-team"); err != nil {
		t.Fatal(err)
	}
}

// op is one operation of the document, ready to be walked.
type op struct {
	method, path, id string
	pending          string
	public           bool // security: [] (the document, health)
	admin            bool // needs the admin role (or the operator)
	// ownCollection: no path parameter names an object; a team B
	// credential lists or creates in its own team.
	ownCollection bool
	hasBody       bool
	// operator: the platform's, never a team's (listWorkers, rotate).
	operator bool
}

var paramRE = regexp.MustCompile(`\{([^}]+)\}`)

// adminOps need the team's admin role (or the platform operator's).
var adminOps = map[string]bool{
	"createAPIKey": true, "updateAPIKey": true, "deleteAPIKey": true, "inviteTeamMember": true,
	"removeTeamMember": true, "rotateSigningKey": true, "listWorkers": true,
}

func operations(doc *openapi3.T) []op {
	var out []op
	for path, item := range doc.Paths.Map() {
		for method, o := range item.Operations() {
			x := op{method: method, path: path, id: o.OperationID, admin: adminOps[o.OperationID],
				operator:      o.OperationID == "listWorkers" || o.OperationID == "rotateSigningKey",
				ownCollection: !strings.Contains(path, "{"), hasBody: o.RequestBody != nil}
			if v, ok := o.Extensions["x-space-pending"]; ok {
				x.pending = fmt.Sprint(v)
			}
			if o.Security != nil && len(*o.Security) == 0 {
				x.public = true
			}
			out = append(out, x)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].path+out[i].method < out[j].path+out[j].method })
	return out
}

// bodies are well-formed requests, so that a refusal is about the
// credential or the object, never the body.
var bodies = map[string]any{
	"createSandbox": map[string]any{"templateID": "base"}, "createSandboxV2": map[string]any{"templateID": "base"},
	"setSandboxTimeout": map[string]any{"timeout": 30}, "refreshSandbox": map[string]any{"duration": 30},
	"updateSandboxNetwork": map[string]any{"denyOut": []string{"10.0.0.0/8"}},
	"pauseSandbox":         map[string]any{}, "resumeSandbox": map[string]any{}, "connectSandbox": map[string]any{"timeout": 30},
	"connectSandboxV2": map[string]any{"timeout": 30}, "createSnapshot": map[string]any{}, "forkSandbox": map[string]any{"count": 1},
	"requestTemplateBuild": map[string]any{"name": "evil-tpl"}, "startTemplateBuild": map[string]any{"fromTemplate": "base", "steps": []any{}},
	"assignTemplateTags": nil, "deleteTemplateTags": nil, // set per victim
	"createSecret": map[string]any{"name": "evil", "value": "x"}, "updateSecret": map[string]any{"value": "pwned"},
	"createVolume": map[string]any{"name": "evil-vol"}, "updateVolumePath": map[string]any{"mode": 511},
	"createTeam": map[string]any{"name": "evil-team"}, "inviteTeamMember": map[string]any{"email": "evil@example.com", "role": "admin"},
	"createAPIKey": map[string]any{"name": "evil"}, "updateAPIKey": map[string]any{"name": "pwned"},
	"createAccessToken": map[string]any{"name": "evil"},
	"createWebhook":     map[string]any{"name": "evil", "url": "http://127.0.0.1:9/x", "events": []string{"sandbox.lifecycle.created"}},
	"updateWebhook":     map[string]any{"enabled": true, "url": "http://127.0.0.1:9/evil"},
	"issueCapability":   map[string]any{"purpose": "control"}, "migrateSandbox": map[string]any{},
}

func (o op) request(v victim) (string, any) {
	path := paramRE.ReplaceAllStringFunc(o.path, func(m string) string {
		name := m[1 : len(m)-1]
		if x, ok := v.params[name]; ok {
			return x
		}
		return "nosuch-" + name
	})
	switch {
	case strings.HasPrefix(o.path, "/volumecontent/"):
		path += "?path=/"
	case o.id == "getSandboxesMetrics":
		path += "?sandbox_ids=" + v.params["sandboxID"]
	case o.id == "getTeamMetricsMax":
		path += "?metric=concurrent_sandboxes"
	case o.id == "uploadTemplateFiles":
		path += "?exp=9999999999&sig=00"
	case o.id == "resolveSignedFilesSandbox":
		path += "?signature=v1_00&path=/etc/passwd"
	}
	body := bodies[o.id]
	switch o.id {
	case "assignTemplateTags":
		body = map[string]any{"target": v.params["alias"] + ":default", "tags": []string{"evil"}}
	case "deleteTemplateTags":
		body = map[string]any{"name": v.params["alias"], "tags": []string{"default"}}
	}
	if body == nil && o.hasBody {
		body = map[string]any{}
	}
	return path, body
}
