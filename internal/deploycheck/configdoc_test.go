package deploycheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"sort"
	"strconv"
	"testing"

	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/telemetry"
)

// envConsts resolves the constants the mains read variables by.
var envConsts = map[string]string{
	"logsetup.EnvFormat":        logsetup.EnvFormat,
	"logsetup.EnvLevel":         logsetup.EnvLevel,
	"crashpoint.EnvVar":         crashpoint.EnvVar,
	"telemetry.EnvOTLPEndpoint": telemetry.EnvOTLPEndpoint,
	"telemetry.EnvSampleRatio":  telemetry.EnvSampleRatio,
}

// mainEnv returns the variables cmd/<bin>/main.go reads: the arguments
// of os.Getenv, getenv and envOr calls, and telemetry.FromEnv's.
func mainEnv(t *testing.T, bin string) []string {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, filepath.Join(root, "cmd", bin, "main.go"), nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	set := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok || len(call.Args) == 0 {
			return true
		}
		name := ""
		switch fn := call.Fun.(type) {
		case *ast.Ident:
			name = fn.Name
		case *ast.SelectorExpr:
			if x, ok := fn.X.(*ast.Ident); ok {
				name = x.Name + "." + fn.Sel.Name
			}
		}
		switch name {
		case "os.Getenv", "getenv", "envOr":
		case "telemetry.FromEnv":
			set[telemetry.EnvOTLPEndpoint], set[telemetry.EnvSampleRatio] = true, true
			return true
		default:
			return true
		}
		switch a := call.Args[0].(type) {
		case *ast.BasicLit:
			s, _ := strconv.Unquote(a.Value)
			set[s] = true
		case *ast.SelectorExpr:
			k := a.X.(*ast.Ident).Name + "." + a.Sel.Name
			v, ok := envConsts[k]
			if !ok {
				t.Errorf("cmd/%s reads the variable %s: add it to envConsts", bin, k)
			}
			set[v] = true
		case *ast.Ident:
			// a helper's parameter (envOr's k): its callers are read
		default:
			t.Errorf("cmd/%s: %s with a computed name at %s", bin, name, fset.Position(call.Pos()))
		}
		return true
	})
	var out []string
	for k := range set {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// docs/CONFIGURATION.md documents every flag of every server with its
// real default, no flag that does not exist, and every variable the
// mains read.
func TestConfigurationDoc(t *testing.T) {
	fl := binFlags(t)
	doc, err := ParseConfigDoc(readFile(t, "docs/CONFIGURATION.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, bin := range servers {
		sec := bin
		var env []string
		if bin == "space" {
			sec = "space up"
			env = []string{"SPACE_API_KEY", logsetup.EnvFormat, logsetup.EnvLevel, telemetry.EnvOTLPEndpoint, telemetry.EnvSampleRatio}
		} else {
			env = mainEnv(t, bin)
		}
		d, ok := doc[sec]
		if !ok {
			t.Errorf("no section ## `%s`", sec)
			continue
		}
		for _, err := range CheckConfigDoc(sec, d, fl[bin], env) {
			t.Error(err)
		}
	}
	if env := mainEnv(t, "space-api"); len(env) < 5 {
		t.Errorf("space-api's variables: %v", env)
	}
}

// A reference that is wrong in each way is rejected.
func TestConfigurationDocRejects(t *testing.T) {
	fs := FlagSet{
		"addr": {Name: "addr", Type: "string", Default: "127.0.0.1:1"},
		"keep": {Name: "keep", Default: "true"},
	}
	doc, err := ParseConfigDoc("## `x`\n| `--addr` | string | `0.0.0.0:1` | a |\n| `--gone` | int | none | b |\n| `FOO` | c |\n")
	if err != nil {
		t.Fatal(err)
	}
	wantErrs(t, "doc", CheckConfigDoc("x", doc["x"], fs, []string{"FOO", "BAR"}),
		`--keep is not documented`, `--gone is documented but the binary has no such flag`,
		`--addr: documented default "0.0.0.0:1", the binary's is "127.0.0.1:1"`, `BAR is not documented`)
	for _, bad := range []string{"## `x`\n| `--a` | string | 1 | x |\n", "## `x`\n| `--a` | string | none | x |\n| `--a` | string | none | x |\n"} {
		if _, err := ParseConfigDoc(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}
