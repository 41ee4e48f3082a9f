package controlplane

import (
	"context"
	"strings"
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

// A worker whose microvm substrate found no working accelerator does not
// advertise it; a base-vm create gets 503 naming the worker and its reason.
func TestUnavailableSubstrateReasonIn503(t *testing.T) {
	st := openStore(t)
	e := newEnv(t, st, nil)
	n := newFakeNode(t, "w1", st)
	reg, err := st.RegisterWorker(context.Background(), spacev1.Worker{ID: "w1", NodeURL: n.srv.URL, State: "ready", Capacity: 10,
		Substrates:  []string{identity.SubstrateNS},
		Unavailable: map[string]string{identity.SubstrateMicroVM: "no working accelerator (kvm: guest not ready within 3s; tcg: qemu exited)"}},
		5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reg.Close() })
	r := e.api("POST", "/v2/sandboxes", map[string]any{"templateID": "base-vm"})
	expectError(t, r, 503)
	if !strings.Contains(string(r.Body), "w1: no working accelerator (kvm: guest not ready within 3s") {
		t.Fatalf("503 does not name the reason: %s", r.Body)
	}
	// The reason is shown to operators with the worker.
	ws := e.api("GET", "/space/v1/workers", nil)
	if ws.Code != 200 || !strings.Contains(string(ws.Body), `"unavailable":{"microvm":"no working accelerator`) {
		t.Fatalf("workers: %d %s", ws.Code, ws.Body)
	}
}
