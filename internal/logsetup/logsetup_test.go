package logsetup

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
)

func TestFormatsAndLevels(t *testing.T) {
	var b bytes.Buffer
	log, err := New(&b, Options{Format: FormatJSON, Level: "warn"})
	if err != nil {
		t.Fatal(err)
	}
	log.Info("hidden")
	log.Warn("shown", "k", "v")
	var rec map[string]any
	if err := json.Unmarshal(b.Bytes(), &rec); err != nil || rec["msg"] != "shown" || rec["k"] != "v" {
		t.Fatalf("json line %q: %v", b.String(), err)
	}
	b.Reset()
	log, err = New(&b, Options{})
	if err != nil {
		t.Fatal(err)
	}
	log.Debug("hidden")
	log.Info("shown")
	if got := b.String(); !strings.Contains(got, "level=INFO msg=shown") || strings.Contains(got, "hidden") {
		t.Fatalf("text default: %q", got)
	}
}

func TestInvalid(t *testing.T) {
	for _, o := range []Options{{Format: "xml"}, {Level: "loud"}} {
		if _, err := New(&bytes.Buffer{}, o); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%+v: %v, want ErrInvalid", o, err)
		}
	}
}

func TestFlagsTakeDefaults(t *testing.T) {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	o := Flags(fs, Options{Format: FormatJSON})
	if err := fs.Parse([]string{"--log-level", "debug"}); err != nil {
		t.Fatal(err)
	}
	if *o != (Options{Format: FormatJSON, Level: "debug"}) {
		t.Fatalf("%+v", *o)
	}
}

// A child's main reads back exactly what the worker passed it.
func TestEnvRoundTrip(t *testing.T) {
	o := Options{Format: FormatJSON, Level: "debug"}
	env := map[string]string{}
	for _, kv := range Env(o) {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	if got := FromEnv(func(k string) string { return env[k] }); got != o {
		t.Fatalf("FromEnv(Env(%+v)) = %+v", o, got)
	}
	if got := Env(Options{}); got[0] != EnvFormat+"="+FormatText || got[1] != EnvLevel+"=info" {
		t.Fatalf("defaults: %v", got)
	}
}
