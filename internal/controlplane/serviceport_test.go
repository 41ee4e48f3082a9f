package controlplane

import (
	"testing"

	"github.com/spacesbx/space/api/e2bapi"
)

// Service ports follow E2B: public unless the sandbox was created with
// network.allowPublicTraffic false; then the edge must present the
// sandbox's traffic access token (the envd access token does not count).
func TestServicePortTrafficAccessToken(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	e.register(newFakeNode(t, "w1", st), 10)

	var private, public e2bapi.Sandbox
	r := e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "network": map[string]any{"allowPublicTraffic": false}})
	if r.Code != 201 {
		t.Fatalf("create private: %d %s", r.Code, r.Body)
	}
	r.decode(t, &private)
	if private.TrafficAccessToken == nil || len(*private.TrafficAccessToken) < 32 {
		t.Fatalf("private sandbox without traffic access token: %+v", private)
	}
	r = e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "network": map[string]any{"allowPublicTraffic": true}})
	r.decode(t, &public)
	if public.TrafficAccessToken != nil {
		t.Fatal("public sandbox got a traffic access token")
	}
	expectError(t, e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "network": []int{1}}), 400)

	sp := map[string]any{"purpose": "service-port", "port": 8000, "protocol": "http"}
	proc := map[string]any{"purpose": "process"}
	tok := *private.TrafficAccessToken
	edge := func(extra ...string) map[string]string {
		h := map[string]string{"X-API-Key": edgeKey}
		for i := 0; i+1 < len(extra); i += 2 {
			h[extra[i]] = extra[i+1]
		}
		return h
	}
	cases := []struct {
		name    string
		id      string
		headers map[string]string
		body    any
		code    int
	}{
		{"public: edge alone", public.SandboxID, edge(), sp, 200},
		{"public: envd token not needed", public.SandboxID, edge(), map[string]any{"purpose": "service-port", "port": 9000, "protocol": "tcp"}, 200},
		{"private: edge alone", private.SandboxID, edge(), sp, 403},
		{"private: envd token is not the traffic token", private.SandboxID, edge("X-Access-Token", private.EnvdAccessToken), sp, 403},
		{"private: wrong traffic token", private.SandboxID, edge(HeaderTrafficAccessToken, "nope"), sp, 403},
		{"private: traffic token", private.SandboxID, edge(HeaderTrafficAccessToken, tok), sp, 200},
		{"private: repair", private.SandboxID, edge(), map[string]any{"purpose": "service-port", "port": 8000, "protocol": "http", "repair": true}, 200},
		{"private: traffic token does not open envd", private.SandboxID, edge(HeaderTrafficAccessToken, tok), proc, 401},
		{"private: owner key", private.SandboxID, map[string]string{"X-API-Key": e.key}, sp, 200},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := e.do("POST", "/space/v1/sandboxes/"+c.id+"/capabilities", c.headers, c.body)
			if r.Code != c.code {
				t.Fatalf("status %d, want %d: %s", r.Code, c.code, r.Body)
			}
		})
	}
}
