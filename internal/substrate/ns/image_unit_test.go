package ns

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/substrate"
)

func TestValidateImage(t *testing.T) {
	if err := validateImage(&substrate.Image{Layers: []string{"/a", "/b/c"}, Env: []string{"A=1", "B="}, WorkingDir: "/w"}); err != nil {
		t.Fatal(err)
	}
	many := make([]string, maxImageLayers+1)
	for i := range many {
		many[i] = fmt.Sprintf("/l%d", i)
	}
	for name, img := range map[string]substrate.Image{
		"none":        {},
		"too many":    {Layers: many},
		"relative":    {Layers: []string{"a"}},
		"unclean":     {Layers: []string{"/a/../b"}},
		"trailing":    {Layers: []string{"/a/"}},
		"colon":       {Layers: []string{"/a:b"}},
		"comma":       {Layers: []string{"/a,upperdir=/x"}},
		"backslash":   {Layers: []string{`/a\b`}},
		"newline":     {Layers: []string{"/a\nb"}},
		"env no =":    {Layers: []string{"/a"}, Env: []string{"A"}},
		"env empty k": {Layers: []string{"/a"}, Env: []string{"=v"}},
		"env nul":     {Layers: []string{"/a"}, Env: []string{"A=\x00"}},
		"workdir":     {Layers: []string{"/a"}, WorkingDir: "w"},
	} {
		if err := validateImage(&img); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestTopFirst(t *testing.T) {
	in := []string{"/bottom", "/mid", "/top"}
	if got := topFirst(in); !slices.Equal(got, []string{"/top", "/mid", "/bottom"}) || in[0] != "/bottom" {
		t.Fatalf("topFirst %v (input %v)", got, in)
	}
}

func TestWithImageDefaults(t *testing.T) {
	cfg := `{"identity":{"sandbox":"s"},"env":{"A":"sandbox"},"default_user":"user"}`
	env := []string{"X=1", guestConfigVar + cfg}
	img := &substrate.Image{Env: []string{"A=image", "PATH=/img/bin", "EQ=a=b"}, User: "app:staff", WorkingDir: "/srv"}
	out, err := withImageDefaults(env, img)
	if err != nil {
		t.Fatal(err)
	}
	if out[0] != "X=1" || env[1] != guestConfigVar+cfg {
		t.Fatalf("other variables or the input changed: %q %q", out, env)
	}
	var got struct {
		Identity map[string]string `json:"identity"`
		Env      map[string]string `json:"env"`
		User     string            `json:"default_user"`
		Cwd      string            `json:"default_cwd"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(out[1], guestConfigVar)), &got); err != nil {
		t.Fatal(err)
	}
	if got.Env["A"] != "sandbox" || got.Env["PATH"] != "/img/bin" || got.Env["EQ"] != "a=b" || got.User != "app" || got.Cwd != "/srv" || got.Identity["sandbox"] != "s" {
		t.Fatalf("merged: %+v", got)
	}
	// No defaults, or no configuration: unchanged.
	if out, _ := withImageDefaults(env, &substrate.Image{Layers: []string{"/a"}}); !slices.Equal(out, env) {
		t.Fatalf("no defaults: %q", out)
	}
	if out, _ := withImageDefaults([]string{"X=1"}, img); !slices.Equal(out, []string{"X=1"}) {
		t.Fatalf("no configuration: %q", out)
	}
	for _, bad := range []string{`{`, `[]`, `{"env":[1]}`, `{"env":{"A":1}}`, `null`} {
		if _, err := withImageDefaults([]string{guestConfigVar + bad}, img); err == nil {
			t.Errorf("configuration %s: accepted", bad)
		}
	}
}

func FuzzWithImageDefaults(f *testing.F) {
	f.Add(`{"env":{"A":"1"},"default_user":"user"}`, "A=2", "u")
	f.Add(`null`, "", "")
	f.Fuzz(func(t *testing.T, cfg, kv, user string) {
		img := &substrate.Image{Env: []string{kv}, User: user, WorkingDir: "/w"}
		out, err := withImageDefaults([]string{guestConfigVar + cfg}, img)
		if err != nil {
			return
		}
		var m map[string]json.RawMessage
		if len(out) != 1 || json.Unmarshal([]byte(strings.TrimPrefix(out[0], guestConfigVar)), &m) != nil {
			t.Fatalf("output is not a configuration: %q", out)
		}
	})
}
