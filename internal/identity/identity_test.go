package identity

import (
	"strings"
	"testing"
)

func route() Route {
	return Route{SandboxID: "sbx1", Generation: 7, ExecutionID: "e7", WorkerID: "wa", Substrate: SubstrateNS, ActivationID: "a1", PodUID: ""}
}

func TestCompareEqualAllows(t *testing.T) {
	r := route()
	if d := Compare(r, &Record{Route: r}, ""); d.Outcome != Allow {
		t.Fatalf("got %v (%s)", d.Outcome, d.Reason)
	}
	if d := Compare(r, &Record{Route: r}, "sbx1"); d.Outcome != Allow {
		t.Fatalf("per-sandbox endpoint: got %v", d.Outcome)
	}
}

// Each identity field mutated in turn must give RefreshRoute, whichever side
// holds the newer value.
func TestCompareEachFieldRefreshes(t *testing.T) {
	mutations := map[string]func(*Route){
		"generation": func(r *Route) { r.Generation++ },
		"execution":  func(r *Route) { r.ExecutionID = "e8" },
		"worker":     func(r *Route) { r.WorkerID = "wb" },
		"substrate":  func(r *Route) { r.Substrate = SubstrateMicroVM },
		"activation": func(r *Route) { r.ActivationID = "a2" },
		"pod_uid":    func(r *Route) { r.PodUID = "pod-1" },
	}
	for field, mutate := range mutations {
		sel, inst := route(), route()
		mutate(&sel)
		d := Compare(sel, &Record{Route: inst}, "")
		if d.Outcome != RefreshRoute || !strings.Contains(d.Reason, field) {
			t.Errorf("%s newer in request: got %v (%s)", field, d.Outcome, d.Reason)
		}
		d = Compare(inst, &Record{Route: sel}, "")
		if d.Outcome != RefreshRoute {
			t.Errorf("%s newer on receiver: got %v", field, d.Outcome)
		}
	}
	older := route()
	older.Generation--
	if d := Compare(older, &Record{Route: route()}, ""); d.Outcome != RefreshRoute {
		t.Errorf("older generation: %v", d.Outcome)
	}
}

func TestCompareMissingOrRetiredRefreshes(t *testing.T) {
	r := route()
	if d := Compare(r, nil, ""); d.Outcome != RefreshRoute {
		t.Errorf("missing record: %v", d.Outcome)
	}
	if d := Compare(r, &Record{Route: r, Retired: true}, ""); d.Outcome != RefreshRoute {
		t.Errorf("retired record with equal identity: %v", d.Outcome)
	}
}

func TestCompareOtherSandboxDenies(t *testing.T) {
	r := route()
	if d := Compare(r, &Record{Route: r}, "sbx2"); d.Outcome != Deny {
		t.Errorf("endpoint of another sandbox: %v", d.Outcome)
	}
	other := route()
	other.SandboxID = "sbx2"
	if d := Compare(r, &Record{Route: other}, ""); d.Outcome != Deny {
		t.Errorf("record of another sandbox: %v", d.Outcome)
	}
	if d := Compare(r, nil, "sbx2"); d.Outcome != Deny {
		t.Errorf("endpoint check precedes record lookup: %v", d.Outcome)
	}
}

func TestZeroOutcomeIsDeny(t *testing.T) {
	var d Decision
	if d.Outcome != Deny || d.Outcome.String() != "deny" {
		t.Fatal("zero decision must fail closed")
	}
}

func TestValidate(t *testing.T) {
	if err := route().Validate(); err != nil {
		t.Fatal(err)
	}
	bad := map[string]func(*Route){
		"upper":      func(r *Route) { r.SandboxID = "Sbx" },
		"empty":      func(r *Route) { r.SandboxID = "" },
		"dots":       func(r *Route) { r.SandboxID = "../x" },
		"long":       func(r *Route) { r.SandboxID = strings.Repeat("a", 64) },
		"hyphenEdge": func(r *Route) { r.SandboxID = "-a" },
		"gen0":       func(r *Route) { r.Generation = 0 },
		"noexec":     func(r *Route) { r.ExecutionID = "" },
		"noworker":   func(r *Route) { r.WorkerID = "" },
		"nosub":      func(r *Route) { r.Substrate = "" },
		"noact":      func(r *Route) { r.ActivationID = "" },
	}
	for name, m := range bad {
		r := route()
		m(&r)
		if r.Validate() == nil {
			t.Errorf("%s accepted", name)
		}
	}
}

func TestEpochIgnoresActivation(t *testing.T) {
	a, b := route(), route()
	b.ActivationID = "a2"
	if a.Epoch() != b.Epoch() {
		t.Fatal("activation-only change must keep the epoch")
	}
	b.Generation++
	if a.Epoch() == b.Epoch() {
		t.Fatal("generation change must change the epoch")
	}
}

func FuzzValidateSandboxID(f *testing.F) {
	for _, s := range []string{"abc", "a-b", "", "A", "../..", "a\x00b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if ValidateSandboxID(s) == nil {
			for _, c := range s {
				if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
					t.Fatalf("accepted %q", s)
				}
			}
		}
	})
}

func TestKnownSubstrate(t *testing.T) {
	for _, s := range []string{SubstrateNS, SubstrateMicroVM} {
		if !KnownSubstrate(s) {
			t.Errorf("%s unknown", s)
		}
	}
	for _, s := range []string{"", "NS", "docker", "ns "} {
		if KnownSubstrate(s) {
			t.Errorf("%q known", s)
		}
	}
}
