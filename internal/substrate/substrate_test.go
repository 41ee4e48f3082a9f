package substrate

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/identity"
)

func TestSpecValidate(t *testing.T) {
	dir := t.TempDir()
	agent := filepath.Join(dir, "agent")
	if err := os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	good := Spec{
		Route: identity.Route{SandboxID: "sbx", Generation: 1, ExecutionID: "e1", WorkerID: "w1",
			Substrate: identity.SubstrateNS, ActivationID: "a1"},
		Dir: filepath.Join(dir, "act"), AgentPath: agent,
	}
	if err := good.Validate(identity.SubstrateNS, "guest.sock"); err != nil {
		t.Fatalf("good spec: %v", err)
	}
	for name, mut := range map[string]func(*Spec){
		"bad route":       func(s *Spec) { s.Route.SandboxID = "" },
		"other substrate": func(s *Spec) { s.Route.Substrate = identity.SubstrateMicroVM },
		"relative dir":    func(s *Spec) { s.Dir = "act" },
		"long dir":        func(s *Spec) { s.Dir = "/" + strings.Repeat("d", 100) },
		"relative agent":  func(s *Spec) { s.AgentPath = "agent" },
		"missing agent":   func(s *Spec) { s.AgentPath = filepath.Join(dir, "none") },
		"plain agent":     func(s *Spec) { s.AgentPath = plain },
		"dir agent":       func(s *Spec) { s.AgentPath = dir },
	} {
		s := good
		mut(&s)
		err := s.Validate(identity.SubstrateNS, "guest.sock")
		if err == nil {
			t.Errorf("%s: accepted", name)
		} else if name != "bad route" && !strings.HasPrefix(err.Error(), "ns: ") {
			t.Errorf("%s: error %q lacks the substrate's prefix", name, err)
		}
	}
}
