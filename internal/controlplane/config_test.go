package controlplane

import (
	"testing"
	"time"

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
	if got := (Config{}).withDefaults(); got.KeyPropagation != DefaultKeyPropagation || len(got.Templates) != 2 ||
		got.Templates["base-vm"].Substrate != identity.SubstrateMicroVM {
		t.Fatalf("empty config's defaults: %+v", got)
	}
	// A default and a set value are compared as they will be used.
	if err := (Config{DataDir: "x", MaxTimeout: time.Minute}).Validate(); err == nil {
		t.Fatal("max timeout below the default timeout accepted")
	}
}
