package deploycheck

import (
	"testing"
)

const help = `Usage of x:
  -addr string
    	listen address (default "127.0.0.1:3000")
  -keep
    	keep things (default true)
  -n int
    	count (default 100)
  -ratio float
    	fraction (default $X, else 1)
  -fmt string
    	format (default $F, else text) (default "text")
  -reg value
    	a registry (repeatable)
  -v	verbose
`

func TestParseHelp(t *testing.T) {
	fs, err := ParseHelp(help)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]Flag{
		"addr":  {Name: "addr", Type: "string", Default: "127.0.0.1:3000", Usage: "listen address"},
		"keep":  {Name: "keep", Default: "true", Usage: "keep things"},
		"n":     {Name: "n", Type: "int", Default: "100", Usage: "count"},
		"ratio": {Name: "ratio", Type: "float", Usage: "fraction (default $X, else 1)"},
		"fmt":   {Name: "fmt", Type: "string", Default: "text", Usage: "format (default $F, else text)"},
		"reg":   {Name: "reg", Type: "value", Usage: "a registry (repeatable)"},
		"v":     {Name: "v", Usage: "verbose"},
	}
	if len(fs) != len(want) {
		t.Errorf("%d flags, want %d: %+v", len(fs), len(want), fs)
	}
	for n, w := range want {
		if fs[n] != w {
			t.Errorf("%s: %+v, want %+v", n, fs[n], w)
		}
	}
	if _, err := ParseHelp("no flags here\n"); err == nil {
		t.Error("help without flags accepted")
	}
}

func TestCheckArgs(t *testing.T) {
	fs, _ := ParseHelp(help)
	if errs := CheckArgs(fs, []string{"--addr=0.0.0.0:1", "-n", "5", "--keep=false", "--v", "--ratio=${R}", "--reg", "a:1", "--reg=b:2", "--n=$(N)"}); len(errs) != 0 {
		t.Errorf("good args rejected: %v", errs)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--nope=1"}, `--nope is not defined`},
		{[]string{"--addr"}, `--addr needs a value`},
		{[]string{"--n=many"}, `"many" is not a int`},
		{[]string{"--keep=maybe"}, `not a boolean`},
		{[]string{"stray"}, `positional argument`},
		{[]string{"--addr=x", "--", "y"}, `positional argument`},
	} {
		wantErrs(t, c.want, CheckArgs(fs, c.args), c.want)
	}
	wantErrs(t, "secret", CheckArgs(fs, []string{"--fmt=x"}, "fmt"), "carries a secret")
	if v, ok := ArgValue([]string{"--addr", "a", "--keep", "--addr=b"}, "addr"); !ok || v != "b" {
		t.Errorf("ArgValue %q %v", v, ok)
	}
	if v, ok := ArgValue([]string{"--keep", "--addr=b"}, "keep"); !ok || v != "true" {
		t.Errorf("ArgValue bool %q %v", v, ok)
	}
}
