package templatebuild

import (
	"errors"
	"testing"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/dockerfile"
	"github.com/spacesbx/space/internal/errdefs"
)

func TestKeyChainsEverythingThatWentIn(t *testing.T) {
	base := BaseKey("template:base")
	run := e2bapi.TemplateStep{Type: "RUN", Args: []string{"echo a"}}
	k := Key(base, run)
	if Key(base, run) != k {
		t.Fatal("Key is not deterministic")
	}
	for name, other := range map[string]string{
		"another parent":  Key(BaseKey("template:base-vm"), run),
		"another command": Key(base, e2bapi.TemplateStep{Type: "RUN", Args: []string{"echo b"}}),
		"another user":    Key(base, e2bapi.TemplateStep{Type: "RUN", Args: []string{"echo a", "user"}}),
		"another files":   Key(base, e2bapi.TemplateStep{Type: "COPY", Args: []string{"a", "/b"}, FilesHash: "1"}),
		"another prefix":  Key(Key(base, run), run),
	} {
		if other == k {
			t.Errorf("%s gives the same key", name)
		}
	}
	c1 := Key(base, e2bapi.TemplateStep{Type: "COPY", Args: []string{"a", "/b"}, FilesHash: "1"})
	c2 := Key(base, e2bapi.TemplateStep{Type: "COPY", Args: []string{"a", "/b"}, FilesHash: "2"})
	if c1 == c2 {
		t.Error("changed files give the same key")
	}
}

func TestValidateRejects(t *testing.T) {
	long := make([]byte, maxArgBytes+1)
	for i := range long {
		long[i] = 'a'
	}
	for name, steps := range map[string][]e2bapi.TemplateStep{
		"empty RUN":        {{Type: "RUN"}},
		"RUN 3 args":       {{Type: "RUN", Args: []string{"a", "b", "c"}}},
		"unknown":          {{Type: "FROM", Args: []string{"x"}}},
		"odd ENV":          {{Type: "ENV", Args: []string{"A"}}},
		"bad ENV name":     {{Type: "ENV", Args: []string{"A-B", "x"}}},
		"relative WORKDIR": {{Type: "WORKDIR", Args: []string{"x"}}},
		"bad USER":         {{Type: "USER", Args: []string{"a;b"}}},
		"COPY no hash":     {{Type: "COPY", Args: []string{"a", "/b"}}},
		"COPY bad mode":    {{Type: "COPY", Args: []string{"a", "/b", "", "999"}, FilesHash: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}},
		"NUL":              {{Type: "RUN", Args: []string{"a\x00"}}},
		"huge":             {{Type: "RUN", Args: []string{string(long)}}},
		"too many":         make([]e2bapi.TemplateStep, MaxSteps+1),
	} {
		if err := Validate(steps); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: %v, want invalid", name, err)
		}
	}
	ok := []e2bapi.TemplateStep{
		{Type: "RUN", Args: []string{"apt-get install -y x", "root"}},
		{Type: "ENV", Args: []string{"A", "1", "B_2", ""}},
		{Type: "WORKDIR", Args: []string{"/app"}},
		{Type: "USER", Args: []string{"user"}},
		{Type: "COPY", Args: []string{"a", "b/", "user", "0755"}, FilesHash: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"},
	}
	if err := Validate(ok); err != nil {
		t.Fatal(err)
	}
}

func TestShellQuote(t *testing.T) {
	if got := dockerfile.ShellQuote(`it's "x" $(y)`); got != `'it'\''s "x" $(y)'` {
		t.Fatal(got)
	}
}
