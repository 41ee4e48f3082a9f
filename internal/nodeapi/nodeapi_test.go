package nodeapi

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/sbxmanager"
	"github.com/spacesbx/space/internal/substrate"
)

// refusingSubstrate proves an install got past authorization: it is the
// first thing the manager calls, and it always fails.
type refusingSubstrate struct{ calls int }

func (s *refusingSubstrate) Name() string { return identity.SubstrateNS }
func (s *refusingSubstrate) Capabilities() substrate.Capabilities {
	return substrate.Capabilities{Netns: true}
}
func (s *refusingSubstrate) Start(context.Context, substrate.Spec) (substrate.Instance, error) {
	s.calls++
	return nil, errors.New("fake substrate refuses to start")
}

func setup(t *testing.T) (*httptest.Server, *capability.Signer, *refusingSubstrate) {
	t.Helper()
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	signer, _ := capability.NewSigner("k1", priv)
	ver, _ := capability.NewVerifier(capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: pub}}})
	sub := &refusingSubstrate{}
	mgr, err := sbxmanager.New(sbxmanager.Config{WorkerID: "w1", StateDir: t.TempDir(), SpacedHostPath: "/x", AgentPath: "/x"},
		sbxmanager.Deps{Substrates: []substrate.Substrate{sub}, WriteError: WriteError, Verifier: ver})
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Addr: "127.0.0.1:0", WorkerID: "w1"}, mgr, ver)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s.Handler())
	t.Cleanup(func() { srv.Close(); s.Close(); mgr.Close() })
	return srv, signer, sub
}

var route = identity.Route{SandboxID: "sbx1", Generation: 1, ExecutionID: "e1", WorkerID: "w1", Substrate: "ns", ActivationID: "a1"}

func post(t *testing.T, url, token string, body any) (int, string) {
	t.Helper()
	var b []byte
	if s, ok := body.(string); ok {
		b = []byte(s)
	} else {
		b, _ = json.Marshal(body)
	}
	req, _ := http.NewRequest("POST", url, bytes.NewReader(b))
	if token != "" {
		req.Header.Set(spacev1.HeaderCapability, token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(out)
}

func TestControlAuthorization(t *testing.T) {
	srv, signer, sub := setup(t)
	tok := func(r identity.Route, p capability.Purpose) string {
		s, _, err := signer.Issue(capability.Claims{Route: r, Purpose: p})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	otherWorker := route
	otherWorker.WorkerID = "w2"
	otherExec := route
	otherExec.ExecutionID = "e9"
	_, foreign, _ := ed25519.GenerateKey(rand.Reader)
	forger, _ := capability.NewSigner("k1", foreign)
	forged, _, _ := forger.Issue(capability.Claims{Route: route, Purpose: capability.PurposeControl})
	install := spacev1.InstallRequest{Route: route, Template: "base"}
	cases := []struct {
		name   string
		token  string
		body   any
		status int
	}{
		{"no capability", "", install, 403},
		{"forged signature", forged, install, 403},
		{"data-plane purpose", tok(route, capability.PurposeFiles), install, 403},
		{"control for another worker", tok(otherWorker, capability.PurposeControl), spacev1.InstallRequest{Route: otherWorker}, 403},
		{"control for another execution", tok(otherExec, capability.PurposeControl), install, 403},
		{"malformed body", tok(route, capability.PurposeControl), "{", 400},
		{"unknown field", tok(route, capability.PurposeControl), `{"route":{},"evil":1}`, 400},
		{"oversized body", tok(route, capability.PurposeControl), `{"template":"` + strings.Repeat("a", MaxControlBody+10) + `"}`, 400},
	}
	for _, c := range cases {
		status, body := post(t, srv.URL+spacev1.NodePathInstall, c.token, c.body)
		if status != c.status {
			t.Errorf("%s: status %d want %d (%s)", c.name, status, c.status, body)
		}
	}
	if sub.calls != 0 {
		t.Fatalf("rejected installs reached the substrate %d times", sub.calls)
	}
	// An authorized install reaches the manager (and the failing substrate).
	status, body := post(t, srv.URL+spacev1.NodePathInstall, tok(route, capability.PurposeControl), install)
	if sub.calls != 1 || status < 500 || !strings.Contains(body, "fake substrate refuses") {
		t.Fatalf("authorized install: %d %s (calls %d)", status, body, sub.calls)
	}
	// Teardown of an execution this worker does not hold is 404.
	if status, _ := post(t, srv.URL+spacev1.NodePathTeardown, tok(route, capability.PurposeControl), spacev1.TeardownRequest{Route: route}); status != 404 {
		t.Fatalf("teardown unknown: %d", status)
	}
	if status, _ := post(t, srv.URL+spacev1.NodePathTeardown, "", spacev1.TeardownRequest{Route: route}); status != 403 {
		t.Fatalf("teardown without capability: %d", status)
	}
}

func TestHealthAndMetrics(t *testing.T) {
	srv, _, _ := setup(t)
	for _, p := range []string{spacev1.NodePathHealth, "/space/node/v1/metrics"} {
		resp, err := http.Get(srv.URL + p)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("%s: %v %v", p, err, resp.Status)
		}
		resp.Body.Close()
	}
}
