package controlplane

import (
	"strings"
	"testing"

	"github.com/spacesbx/space/api/e2bapi"
)

// The network options of create and updateNetwork: validated, stored,
// echoed by GET, sent to the worker with secrets resolved; the team's
// limits enforced.
func TestNetworkOptions(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, func(c *Config) {
		c.EgressLimits = map[string]EgressLimit{"other": {Deny: true}}
	})
	node := newFakeNode(t, "w1", st)
	e.register(node, 10)

	// A secret, then a sandbox whose rule names it.
	r := e.api("POST", "/secrets", map[string]any{"name": "Api-Key", "value": "s3cr3t", "metadata": map[string]string{"k": "v"}})
	if r.Code != 201 || strings.Contains(string(r.Body), "s3cr3t") {
		t.Fatalf("create secret: %d %s", r.Code, r.Body)
	}
	sb := createV2(t, e, map[string]any{"templateID": "base", "allow_internet_access": false,
		"network": map[string]any{"allowOut": []string{"*.example.com", "1.2.3.4"}, "denyOut": []string{"0.0.0.0/0"},
			"rules":              map[string]any{"api.example.com": []any{map[string]any{"transform": map[string]any{"headers": map[string]string{"Authorization": "Bearer ${e2b.secrets.api-key}"}}}}},
			"egressProxy":        map[string]string{"address": "proxy.example.com:1080", "username": "u", "password": "pw"},
			"allowPublicTraffic": false, "maskRequestHost": "localhost:${PORT}"}})
	node.mu.Lock()
	req := node.installs[len(node.installs)-1]
	node.mu.Unlock()
	if req.Network == nil || req.Network.CACert == "" || req.Network.CAKey == "" {
		t.Fatalf("install carries no network or CA: %+v", req.Network)
	}
	if got := req.Network.Spec.Rules["api.example.com"][0].Transform.Headers["Authorization"]; got != "Bearer s3cr3t" {
		t.Fatalf("worker got header %q, want the resolved secret", got)
	}
	var d e2bapi.SandboxDetail
	r = e.api("GET", "/sandboxes/"+sb.SandboxID, nil)
	r.decode(t, &d)
	if d.Network == nil || len(d.Network.AllowOut) != 2 || d.AllowInternetAccess == nil || *d.AllowInternetAccess ||
		d.Network.AllowPublicTraffic == nil || *d.Network.AllowPublicTraffic || d.Network.MaskRequestHost != "localhost:${PORT}" ||
		d.Network.EgressProxy == nil || d.Network.EgressProxy.Username != "u" {
		t.Fatalf("GET network: %s", r.Body)
	}
	if strings.Contains(string(r.Body), "s3cr3t") || strings.Contains(string(r.Body), `"pw"`) || strings.Contains(string(r.Body), "PRIVATE KEY") {
		t.Fatalf("GET leaks a secret, the proxy password or the CA key: %s", r.Body)
	}
	if got := d.Network.Rules["api.example.com"][0].Transform.Headers["Authorization"]; got != "Bearer ${e2b.secrets.api-key}" {
		t.Fatalf("GET rule header %q, want the placeholder", got)
	}

	// A new version of the secret reaches the running sandbox's worker.
	if r := e.api("POST", "/secrets/api-key", map[string]any{"value": "rotated"}); r.Code != 200 {
		t.Fatalf("update secret: %d %s", r.Code, r.Body)
	}
	node.mu.Lock()
	if n := len(node.networks); n == 0 || node.networks[n-1].Network.Spec.Rules["api.example.com"][0].Transform.Headers["Authorization"] != "Bearer rotated" {
		node.mu.Unlock()
		t.Fatal("the rotated secret was not pushed to the sandbox's worker")
	}
	node.mu.Unlock()

	// updateNetwork: replaced as a whole, pushed to the worker.
	if r := e.api("PUT", "/sandboxes/"+sb.SandboxID+"/network", map[string]any{"allowOut": []string{"10.0.0.0/8"}}); r.Code != 204 {
		t.Fatalf("update: %d %s", r.Code, r.Body)
	}
	node.mu.Lock()
	nets := append([]any(nil), len(node.networks))
	last := node.networks[len(node.networks)-1]
	node.mu.Unlock()
	if len(nets) == 0 || last.Route.SandboxID != sb.SandboxID || len(last.Network.Spec.AllowOut) != 1 || len(last.Network.Spec.Rules) != 0 ||
		last.Network.Spec.EgressProxy != nil || last.Network.CACert != req.Network.CACert {
		t.Fatalf("worker got %+v", last)
	}
	r = e.api("GET", "/sandboxes/"+sb.SandboxID, nil)
	d = e2bapi.SandboxDetail{}
	r.decode(t, &d)
	if d.Network == nil || len(d.Network.DenyOut) != 0 || d.Network.EgressProxy != nil || d.AllowInternetAccess != nil {
		t.Fatalf("update did not replace the config: %s", r.Body)
	}

	// Rejections, each with its class.
	for _, c := range []struct {
		name string
		body map[string]any
		code int
	}{
		{"bare wildcard", map[string]any{"templateID": "base", "network": map[string]any{"allowOut": []string{"*"}}}, 400},
		{"domain in denyOut", map[string]any{"templateID": "base", "network": map[string]any{"denyOut": []string{"example.com"}}}, 400},
		{"header injection", map[string]any{"templateID": "base", "network": map[string]any{"rules": map[string]any{"a.com": []any{map[string]any{"transform": map[string]any{"headers": map[string]string{"X": "a\r\nB: c"}}}}}}}, 400},
		{"unknown secret", map[string]any{"templateID": "base", "network": map[string]any{"rules": map[string]any{"a.com": []any{map[string]any{"transform": map[string]any{"headers": map[string]string{"X": "${e2b.secrets.nope}"}}}}}}}, 404},
		{"identity token", map[string]any{"templateID": "base", "network": map[string]any{"rules": map[string]any{"a.com": []any{map[string]any{"transform": map[string]any{"headers": map[string]string{"X": "${e2b.identity.tokens.aws}"}}}}}}}, 400},
		{"network not an object", map[string]any{"templateID": "base", "network": []int{1}}, 400},
		{"envd port in httpsPorts", map[string]any{"templateID": "base", "network": map[string]any{"httpsPorts": []int{49983}}}, 400},
		{"bad proxy", map[string]any{"templateID": "base", "network": map[string]any{"egressProxy": map[string]string{"address": "no-port"}}}, 400},
	} {
		t.Run(c.name, func(t *testing.T) {
			expectError(t, e.api("POST", "/v2/sandboxes", c.body), c.code)
		})
	}
	expectError(t, e.api("PUT", "/sandboxes/"+sb.SandboxID+"/network", map[string]any{"allowOut": []string{"a b"}}), 400)

	// A team whose egress is denied: options that open egress are
	// refused (403); its sandboxes get a deny-all policy on the worker.
	other := map[string]string{"X-API-Key": otherTeamKey(t, st)}
	expectError(t, e.do("POST", "/v2/sandboxes", other, map[string]any{"templateID": "base", "allow_internet_access": true}), 403)
	expectError(t, e.do("POST", "/v2/sandboxes", other, map[string]any{"templateID": "base", "network": map[string]any{"allowOut": []string{"1.1.1.1"}}}), 403)
	if r := e.do("POST", "/v2/sandboxes", other, map[string]any{"templateID": "base"}); r.Code != 201 {
		t.Fatalf("locked team create: %d %s", r.Code, r.Body)
	}
	node.mu.Lock()
	req = node.installs[len(node.installs)-1]
	node.mu.Unlock()
	if a := req.Network.Spec.AllowInternetAccess; a == nil || *a || len(req.Network.Spec.AllowOut) != 0 {
		t.Fatalf("locked team's sandbox got %+v", req.Network.Spec)
	}
	expectError(t, e.api("PUT", "/sandboxes/nosuchsandbox0000000/network", map[string]any{}), 404)
}

// The E2B /secrets API: names unique per team, values never returned,
// versions counted, lookups by id or name, typed errors.
func TestSecretsAPI(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	r := e.api("POST", "/secrets", map[string]any{"name": "tok", "value": "v1"})
	var info secretInfo
	r.decode(t, &info)
	if r.Code != 201 || !strings.HasPrefix(info.SecretID, "sec_") || info.CurrentVersion != 1 || info.Metadata == nil {
		t.Fatalf("create: %d %s", r.Code, r.Body)
	}
	expectError(t, e.api("POST", "/secrets", map[string]any{"name": "TOK", "value": "x"}), 409)
	for _, bad := range []map[string]any{
		{"name": "", "value": "x"}, {"name": "a{b}", "value": "x"}, {"name": "sec_x", "value": "x"},
		{"name": "ok", "value": ""}, {"name": "ok", "value": "a\nb"}, {"name": strings.Repeat("a", 200), "value": "x"},
	} {
		expectError(t, e.api("POST", "/secrets", bad), 400)
	}
	r = e.api("POST", "/secrets/"+info.SecretID, map[string]any{"value": "v2"})
	r.decode(t, &info)
	if r.Code != 200 || info.CurrentVersion != 2 {
		t.Fatalf("update: %d %s", r.Code, r.Body)
	}
	for _, path := range []string{"/secrets/tok", "/secrets/" + info.SecretID, "/secrets"} {
		r := e.api("GET", path, nil)
		if r.Code != 200 || strings.Contains(string(r.Body), "v2") || strings.Contains(string(r.Body), "v1\"") {
			t.Fatalf("GET %s: %d %s", path, r.Code, r.Body)
		}
	}
	if r := e.api("DELETE", "/secrets/tok", nil); r.Code != 204 {
		t.Fatalf("delete: %d", r.Code)
	}
	expectError(t, e.api("GET", "/secrets/tok", nil), 404)
	expectError(t, e.api("DELETE", "/secrets/tok", nil), 404)
	expectError(t, e.api("POST", "/secrets/tok", map[string]any{"value": "x"}), 404)
}
