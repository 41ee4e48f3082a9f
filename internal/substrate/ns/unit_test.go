package ns

import (
	"testing"

	"github.com/spacesbx/space/internal/substrate"
)

func TestConfigValidate(t *testing.T) {
	good := Config{StateDir: "/var/lib/space"}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]Config{
		"relative state": {StateDir: "state"},
		"empty state":    {},
		"parent abs":     {StateDir: "/s", CgroupParent: "/a/b"},
		"parent empty":   {StateDir: "/s", CgroupParent: "a//b"},
		"parent trail":   {StateDir: "/s", CgroupParent: "a/"},
		"parent dotdot":  {StateDir: "/s", CgroupParent: ".."},
		"parent nested":  {StateDir: "/s", CgroupParent: "space/../x"},
		"parent deep":    {StateDir: "/s", CgroupParent: "a/b/c/d/e/f/g/h/i"},
		"tiny memory":    {StateDir: "/s", Limits: substrate.Limits{MemoryBytes: 1024}},
		"negative pids":  {StateDir: "/s", Limits: substrate.Limits{Pids: -1}},
		"relative usr":   {StateDir: "/s", UsrDir: "usr"},
		"image no layer": {StateDir: "/s", Images: map[string]substrate.Image{"base": {}}},
		"image relative": {StateDir: "/s", Images: map[string]substrate.Image{"base": {Layers: []string{"l"}}}},
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if err := (Config{StateDir: "/s", CgroupParent: "space/w1"}).Validate(); err != nil {
		t.Fatalf("nested parent: %v", err)
	}
	d := Config{StateDir: "/s"}.withDefaults()
	if d.CgroupParent != "space" || d.Limits.MemoryBytes != 512<<20 || d.Limits.Pids != 512 || d.Limits.CPUMillis != 1000 {
		t.Fatalf("defaults: %+v", d)
	}
	l := mergeLimits(substrate.Limits{Pids: 64}, d.Limits)
	if l.Pids != 64 || l.MemoryBytes != 512<<20 {
		t.Fatalf("merge: %+v", l)
	}
}
