package controlplane

import (
	"context"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
)

// The template picks the substrate; only workers that advertise it are
// scheduled, and without one the create is unavailable (503), not placed
// on a worker that cannot run it.
func TestTemplateSubstrateSchedulesMatchingWorkers(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	nsOnly := newFakeNode(t, "w1", st)
	e.register(nsOnly, 100) // no Substrates field: ns only
	expectError(t, e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base-vm"}), 503)

	vm := newFakeNode(t, "w2", st)
	reg, err := st.RegisterWorker(context.Background(), spacev1.Worker{ID: "w2", NodeURL: vm.srv.URL, State: "ready", Capacity: 10,
		Substrates: []string{identity.SubstrateNS, identity.SubstrateMicroVM}}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reg.Close() })
	for range 3 {
		sb := createV2(t, e, map[string]any{"templateID": "base-vm"})
		rec := e.record(sb.SandboxID)
		if rec.Route.WorkerID != "w2" || rec.Route.Substrate != identity.SubstrateMicroVM || rec.MemoryMB != DefaultVMTemplate.MemoryMB {
			t.Fatalf("base-vm placed as %+v (memory %d)", rec.Route, rec.MemoryMB)
		}
	}
	sb := createV2(t, e, map[string]any{"templateID": "base"})
	if rec := e.record(sb.SandboxID); rec.Route.Substrate != identity.SubstrateNS {
		t.Fatalf("base placed as %+v", rec.Route)
	}
}

func TestTemplateSubstrateValidated(t *testing.T) {
	cfg := Config{DataDir: t.TempDir(), Templates: map[string]Template{"odd": {Substrate: "firecracker"}}}
	if err := cfg.Validate(); err == nil {
		t.Fatal("unknown substrate accepted")
	}
}
