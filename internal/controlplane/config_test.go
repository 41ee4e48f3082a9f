package controlplane

import (
	"testing"
	"time"

	"github.com/spacesbx/space/internal/codeinterp"
	"github.com/spacesbx/space/internal/identity"
)

// Zero fields are valid and become their documented defaults; filling them
// leaves the caller's template map alone.
func TestConfigDefaults(t *testing.T) {
	tmpl := map[string]Template{"t": {CPUCount: 1}}
	c := Config{DataDir: "x", Templates: tmpl, KeyPropagation: -1}
	if err := c.Validate(); err != nil {
		t.Fatalf("zero fields refused: %v", err)
	}
	d := c.withDefaults()
	if d.Addr != DefaultAddr || d.BootstrapTeamID != DefaultTeamID || d.Domain != DefaultDomain ||
		d.DefaultTimeout != DefaultTimeout || d.MaxTimeout != DefaultMaxTimeout || d.Substrate != identity.SubstrateNS ||
		d.DefaultEnvdVersion != DefaultEnvdVersion || d.InstallTimeout != DefaultInstallTimeout ||
		d.NodeTimeout != DefaultNodeTimeout || d.ReapInterval != DefaultReapInterval || d.TombstoneTTL != DefaultTombstoneTTL {
		t.Fatalf("defaults not filled: %+v", d)
	}
	if d.KeyPropagation != -1 {
		t.Fatalf("negative key propagation (no wait) replaced: %v", d.KeyPropagation)
	}
	if d.Templates["t"].Substrate != identity.SubstrateNS || tmpl["t"].Substrate != "" {
		t.Fatalf("template substrate: filled %q, caller's %q", d.Templates["t"].Substrate, tmpl["t"].Substrate)
	}
	if got := (Config{}).withDefaults(); got.KeyPropagation != DefaultKeyPropagation || len(got.Templates) != 4 ||
		got.Templates["base-vm"].Substrate != identity.SubstrateMicroVM {
		t.Fatalf("empty config's defaults: %+v", got)
	}
	// A default and a set value are compared as they will be used.
	if err := (Config{DataDir: "x", MaxTimeout: time.Minute}).Validate(); err == nil {
		t.Fatal("max timeout below the default timeout accepted")
	}
}

// The code interpreter templates start their server as user in its home
// and wait for it; only the microVM one is started once and snapshotted.
func TestCodeInterpreterTemplates(t *testing.T) {
	got := (Config{}).withDefaults().Templates
	ci, vm := got["code-interpreter-v1"], got["code-interpreter-v1-vm"]
	if ci.StartCmd != codeinterp.StartCommand() || ci.ReadyCmd != codeinterp.ReadyCommand() || ci.User != "user" ||
		ci.Workdir != "/home/user" || ci.WarmSnapshot || ci.Substrate != identity.SubstrateNS {
		t.Fatalf("code-interpreter-v1: %+v", ci)
	}
	if vm.StartCmd != ci.StartCmd || vm.ReadyCmd != ci.ReadyCmd || !vm.WarmSnapshot || vm.Substrate != identity.SubstrateMicroVM {
		t.Fatalf("code-interpreter-v1-vm: %+v", vm)
	}
	if platformStart("base", got["base"]) != nil {
		t.Fatal("base has a start")
	}
	b := platformStart("code-interpreter-v1", ci)
	if b == nil || b.build.StartCmd != ci.StartCmd || b.build.ReadyCmd != ci.ReadyCmd || b.build.User != "user" || b.build.Workdir != "/home/user" {
		t.Fatalf("start of code-interpreter-v1: %+v", b)
	}
}
