package nodeapi

import (
	"crypto/ed25519"
	"crypto/rand"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/identity"
)

// Every lifecycle path is authorized exactly like install: a control
// capability signed by the control plane for this worker and exactly the
// route in the body. Manager errors map to their classes' statuses.
func TestLifecycleAuthorizationAndErrors(t *testing.T) {
	srv, signer, _ := setup(t)
	tok := func(r identity.Route, p capability.Purpose) string {
		s, _, err := signer.Issue(capability.Claims{Route: r, Purpose: p})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	otherExec := route
	otherExec.ExecutionID = "e9"
	otherWorker := route
	otherWorker.WorkerID = "w2"
	_, foreign, _ := ed25519.GenerateKey(rand.Reader)
	forger, _ := capability.NewSigner("k1", foreign)
	forged, _, _ := forger.Issue(capability.Claims{Route: route, Purpose: capability.PurposeControl})
	control := tok(route, capability.PurposeControl)

	bodies := map[string]any{
		spacev1.NodePathPause:    spacev1.LifecycleRequest{Route: route},
		spacev1.NodePathResume:   spacev1.LifecycleRequest{Route: route},
		spacev1.NodePathRetire:   spacev1.LifecycleRequest{Route: route},
		spacev1.NodePathSnapshot: spacev1.SnapshotRequest{Route: route, SnapshotID: "snap1"},
		spacev1.NodePathMetrics:  spacev1.LifecycleRequest{Route: route},
	}
	for path, body := range bodies {
		for _, c := range []struct {
			name   string
			token  string
			body   any
			status int
		}{
			{"no capability", "", body, 403},
			{"forged", forged, body, 403},
			{"data-plane purpose", tok(route, capability.PurposeProcess), body, 403},
			{"control for another execution", tok(otherExec, capability.PurposeControl), body, 403},
			{"control for another worker", tok(otherWorker, capability.PurposeControl), spacev1.LifecycleRequest{Route: otherWorker}, 403},
			{"malformed", control, "{", 400},
			{"unknown field", control, `{"route":{},"evil":true}`, 400},
		} {
			if status, out := post(t, srv.URL+path, c.token, c.body); status != c.status {
				t.Errorf("%s %s: %d want %d (%s)", path, c.name, status, c.status, out)
			}
		}
	}
	// Authorized calls reach the manager, whose errors keep their class.
	for _, c := range []struct {
		path   string
		body   any
		status int
	}{
		{spacev1.NodePathPause, bodies[spacev1.NodePathPause], 404},   // nothing installed
		{spacev1.NodePathResume, bodies[spacev1.NodePathResume], 404}, // nothing installed
		{spacev1.NodePathRetire, bodies[spacev1.NodePathRetire], 204}, // nothing served: done
		{spacev1.NodePathSnapshot, spacev1.SnapshotRequest{Route: route, SnapshotID: "../x"}, 400},
		{spacev1.NodePathSnapshot, bodies[spacev1.NodePathSnapshot], 503}, // no snapshot store
		{spacev1.NodePathMetrics, bodies[spacev1.NodePathMetrics], 404},   // nothing installed
	} {
		if status, out := post(t, srv.URL+c.path, control, c.body); status != c.status {
			t.Errorf("authorized %s: %d want %d (%s)", c.path, status, c.status, out)
		}
	}
}
