package microvm

import (
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/substrate"
)

func TestConfigValidate(t *testing.T) {
	good := Config{StateDir: "/var/lib/space/vm", KernelPath: "/k/vmlinuz", ModulesDir: "/k/modules"}
	if err := good.Validate(); err != nil {
		t.Fatalf("good config: %v", err)
	}
	bad := map[string]func(*Config){
		"relative state dir": func(c *Config) { c.StateDir = "state" },
		"no kernel":          func(c *Config) { c.KernelPath = "" },
		"relative modules":   func(c *Config) { c.ModulesDir = "lib/modules" },
		"relative qemu":      func(c *Config) { c.QEMUPath = "qemu" },
		"accel":              func(c *Config) { c.Accel = "hvf" },
		"tiny memory":        func(c *Config) { c.Limits.MemoryBytes = 64 << 20 },
		"too many cpus":      func(c *Config) { c.Limits.CPUMillis = (MaxVCPUs + 1) * 1000 },
		"negative timeout":   func(c *Config) { c.StopTimeout = -1 },
		"uid range low":      func(c *Config) { c.UIDFirst = 10 },
		"uid range overflow": func(c *Config) { c.UIDFirst, c.UIDCount = 1<<31-5, 10 },
	}
	for name, mut := range bad {
		c := good
		mut(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%s: Validate accepted %+v", name, c)
		} else if !strings.HasPrefix(err.Error(), "microvm: ") {
			t.Errorf("%s: error %q lacks the package prefix", name, err)
		}
	}
	if _, err := New(Config{StateDir: "rel"}); err == nil {
		t.Error("New accepted an invalid config")
	}
}

func TestShape(t *testing.T) {
	for _, tc := range []struct {
		lim  substrate.Limits
		want machineShape
	}{
		{substrate.Limits{MemoryBytes: 256 << 20, CPUMillis: 1000}, machineShape{256, 1}},
		{substrate.Limits{MemoryBytes: 256<<20 + 1, CPUMillis: 1001}, machineShape{257, 2}},
		{substrate.Limits{MemoryBytes: 128 << 20, CPUMillis: 250}, machineShape{128, 1}},
		{substrate.Limits{MemoryBytes: 1 << 30, CPUMillis: 0}, machineShape{1024, 1}},
	} {
		if got := shapeOf(tc.lim); got != tc.want {
			t.Errorf("shapeOf(%+v) = %+v, want %+v", tc.lim, got, tc.want)
		}
	}
}

// A template named in Config.Images boots its image when the spec names
// none; a spec's own image wins; other templates keep busybox.
func TestTemplateImage(t *testing.T) {
	img := substrate.Image{ID: "sha256:" + strings.Repeat("a", 64), Layers: []string{"/x"}}
	own := &substrate.Image{ID: "sha256:" + strings.Repeat("b", 64), Layers: []string{"/y"}}
	s := &Substrate{cfg: Config{Images: map[string]substrate.Image{"base-vm": img}}}
	if got := s.templateImage(substrate.Spec{Template: "base-vm"}); got.Image == nil || got.Image.ID != img.ID {
		t.Fatalf("base-vm: %+v", got.Image)
	}
	if got := s.templateImage(substrate.Spec{Template: "base-vm", Image: own}); got.Image != own {
		t.Fatalf("a spec's own image replaced: %+v", got.Image)
	}
	if got := s.templateImage(substrate.Spec{Template: "other"}); got.Image != nil {
		t.Fatalf("other template got %+v", got.Image)
	}
}
