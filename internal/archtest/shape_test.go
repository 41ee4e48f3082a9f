package archtest

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// layer orders the packages: a package imports only packages of a lower
// layer (never the same or a higher one), so nothing points upward and a
// new package has to be placed on purpose. A package matches the longest
// prefix listed. The table is the one in docs/ARCHITECTURE.md.
var layer = map[string]int{
	// 0: the error classes and the Connect envelope parser, which every
	// side links.
	"internal/errdefs": 0, "internal/envelope": 0,
	// 1: wire contracts and leaves that know nothing of SPACE's components.
	"api/e2bapi": 1, "api/openapi": 1, "api/envd/filesystem": 1, "api/envd/process": 1,
	"internal/identity":   1,
	"internal/atomicfile": 1, "internal/procwait": 1, "internal/procid": 1,
	"internal/vmchan": 1, "internal/substrate/uidlease": 1, "internal/substrate/spawner": 1,
	"internal/guest/cgexec": 1, "internal/logsetup": 1, "internal/crashpoint": 1,
	// 1 also: tracing setup and the metrics listener (telemetry), and the
	// guest's span report (telemetry/guestspan).
	"internal/telemetry": 1,
	"internal/netpolicy": 1, "internal/sbxnet": 1, "internal/netsim": 1, "internal/hostsim": 1, "internal/hostaddr": 1,
	"internal/egress/intercept": 1, "internal/egress/socks5": 1,
	// 1 also: the code interpreter server (Python, embedded) for the
	// code-interpreter-v1 image.
	"internal/codeinterp": 1,
	// 1 also: the web dashboard's embedded bundle.
	"internal/dashboard": 1,
	// 2: contracts built on identity, envd connect stubs.
	"api/spacev1": 2, "internal/capability": 2, "internal/edgecert": 2,
	"api/envd/filesystem/filesystempbconnect": 2, "api/envd/process/processpbconnect": 2,
	// 3: state, policies and the substrate interface.
	"internal/store": 3, "internal/scheduler": 3, "internal/snapshot": 3, "internal/substrate": 3,
	"internal/guest": 3, "sdk": 3, "internal/egress": 3, "internal/baseimage": 3, "internal/volume": 3,
	// 4 also: a template build, a client of sandboxes.
	"internal/templatebuild": 4,
	// 4 also: lifecycle events and webhook deliveries, over the store.
	"internal/events": 4,
	// 2 also: a Dockerfile read into E2B template build steps.
	"internal/dockerfile": 2,
	// 1 and 2 also: image layers and the registry client.
	"internal/layerstore": 1, "internal/oci": 2, "internal/loopdev": 1,
	// 4: substrates, per-activation host processes.
	"internal/substrate/ns": 4, "internal/substrate/microvm": 4,
	"internal/bridge": 4, "internal/gateway": 4,
	// 5: components.
	"internal/sbxmanager": 5, "internal/controlplane": 5, "internal/edge": 5,
	// 6: the node API over sbx-manager.
	"internal/nodeapi": 6,
	// 7: a worker; a simulated fleet of them (node-api's control checks,
	// no sandboxes).
	"internal/worker": 7, "internal/fleetsim": 7,
	// 8: a worker assembled from its parts (substrates, store adapters).
	"internal/node": 8,
	// 9: a whole single-machine SPACE.
	"internal/up": 9,
	// 10: what drives a whole SPACE: the CLI, benchmarks, test harnesses.
	"internal/cli": 10, "internal/bench": 10, "internal/testenv": 10,
	// 10 also: the deployment files' checker (units, image, manifests,
	// configuration reference against the binaries' flags).
	"internal/deploycheck": 10,
	// 11: mains and suites.
	"cmd": 11, "test": 11, "internal/archtest": 11, "sdk/sdktest": 11,
	"internal/vmchan/vmchantest": 11, "internal/bench/idleproc": 11,
}

func layerOf(pkg string) (int, bool) {
	best, l := "", 0
	for p, n := range layer {
		if (pkg == p || strings.HasPrefix(pkg, p+"/")) && len(p) > len(best) {
			best, l = p, n
		}
	}
	return l, best != ""
}

func TestNothingImportsUpward(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}} {{join .Imports " "}}`, mod+"...").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg := strings.TrimPrefix(f[0], mod)
		pl, ok := layerOf(pkg)
		if !ok {
			t.Errorf("%s has no layer: place it in archtest's table and docs/ARCHITECTURE.md", pkg)
			continue
		}
		for _, imp := range f[1:] {
			if !strings.HasPrefix(imp, mod) {
				continue
			}
			dep := strings.TrimPrefix(imp, mod)
			dl, ok := layerOf(dep)
			if ok && dl >= pl {
				t.Errorf("%s (layer %d) imports %s (layer %d): imports point down only", pkg, pl, dep, dl)
			}
		}
	}
}

// The leaves every side links import nothing internal.
func TestLeaves(t *testing.T) {
	for _, p := range []string{"internal/errdefs", "internal/envelope"} {
		for _, d := range deps(t, p) {
			if strings.HasPrefix(d, mod) && d != mod+p {
				t.Errorf("%s imports %s; it is a leaf", p, d)
			}
		}
	}
}

// sbx-manager reaches substrates only through internal/substrate: it
// imports no concrete substrate and never asks which one it has.
func TestSbxmanagerKnowsNoConcreteSubstrate(t *testing.T) {
	for _, d := range deps(t, "internal/sbxmanager") {
		if strings.HasPrefix(d, mod+"internal/substrate/") && !strings.HasPrefix(d, mod+"internal/substrate/uidlease") {
			t.Errorf("internal/sbxmanager imports %s", d)
		}
	}
	for _, f := range parseFiles(t, "internal/sbxmanager", false) {
		ast.Inspect(f.file, func(n ast.Node) bool {
			if sel, ok := n.(*ast.SelectorExpr); ok && isIdent(sel.X, "identity") && strings.HasPrefix(sel.Sel.Name, "Substrate") {
				t.Errorf("%s: sbxmanager names a substrate (identity.%s): ask the instance for a capability instead", f.pos(sel), sel.Sel.Name)
			}
			return true
		})
	}
}

// Components act on what a substrate declares, never on its name: no
// comparison with a substrate name (identity.Substrate* or a literal) in
// the packages on the request path.
func TestComponentsDoNotCompareSubstrateNames(t *testing.T) {
	for _, dir := range []string{"internal/sbxmanager", "internal/controlplane", "internal/edge", "internal/nodeapi", "internal/worker"} {
		for _, f := range parseFiles(t, dir, false) {
			ast.Inspect(f.file, func(n ast.Node) bool {
				var operands []ast.Expr
				switch x := n.(type) {
				case *ast.BinaryExpr:
					if x.Op == token.EQL || x.Op == token.NEQ {
						operands = []ast.Expr{x.X, x.Y}
					}
				case *ast.CaseClause:
					operands = x.List
				}
				for _, e := range operands {
					if isSubstrateName(e) {
						t.Errorf("%s: %s compares a substrate name: declare a substrate.Capabilities field instead", f.pos(e), dir)
					}
				}
				return true
			})
		}
	}
}

func isSubstrateName(e ast.Expr) bool {
	switch x := e.(type) {
	case *ast.SelectorExpr:
		return isIdent(x.X, "identity") && strings.HasPrefix(x.Sel.Name, "Substrate")
	case *ast.BasicLit:
		return x.Kind == token.STRING && (x.Value == `"ns"` || x.Value == `"microvm"`)
	}
	return false
}

// errClassNames are the classes internal/errdefs defines; nobody else
// declares its own.
var errClassNames = map[string]bool{
	"ErrNotFound": true, "ErrConflict": true, "ErrInvalid": true, "ErrUnauthenticated": true, "ErrDenied": true,
	"ErrTooLarge": true, "ErrTimeout": true, "ErrUnavailable": true, "ErrUpstream": true,
}

func TestOneErrorClassSet(t *testing.T) {
	for _, f := range parseFiles(t, "", false) {
		if f.pkgDir == "internal/errdefs" {
			continue
		}
		for _, d := range f.file.Decls {
			g, ok := d.(*ast.GenDecl)
			if !ok || g.Tok != token.VAR {
				continue
			}
			for _, s := range g.Specs {
				vs := s.(*ast.ValueSpec)
				for i, n := range vs.Names {
					// The SDK re-exports a class as that very value.
					if i < len(vs.Values) && isSelector(vs.Values[i], "errdefs", n.Name) {
						continue
					}
					if errClassNames[n.Name] {
						t.Errorf("%s: declares its own %s; wrap internal/errdefs.%s", f.pos(n), n.Name, n.Name)
					}
				}
			}
		}
	}
}

// Errors become HTTP statuses at the API edges only, each through one
// function: the control plane's REST server, the node API and the edge.
func TestOneHTTPErrorMapperPerEdge(t *testing.T) {
	edges := map[string]bool{"internal/controlplane": true, "internal/nodeapi": true, "internal/edge": true}
	mappers := map[string][]string{}
	for _, f := range parseFiles(t, "", false) {
		for _, d := range f.file.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				continue
			}
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				if sel, ok := n.(*ast.SelectorExpr); ok && isIdent(sel.X, "errdefs") && sel.Sel.Name == "HTTPStatus" {
					if !edges[f.pkgDir] {
						t.Errorf("%s: %s maps errors to HTTP statuses; only the API edges do (%v)", f.pos(sel), f.pkgDir, keys(edges))
					}
					name := f.pkgDir + "." + fn.Name.Name
					if l := mappers[f.pkgDir]; len(l) == 0 || l[len(l)-1] != name {
						mappers[f.pkgDir] = append(l, name)
					}
				}
				return true
			})
		}
	}
	for pkg, fns := range mappers {
		if len(fns) > 1 {
			t.Errorf("%s maps errors to HTTP in %d functions (%v); one per edge", pkg, len(fns), fns)
		}
	}
	for pkg := range edges {
		if len(mappers[pkg]) == 0 {
			t.Errorf("%s: no error mapper found (errdefs.HTTPStatus): its statuses are decided by hand", pkg)
		}
	}
}

// Outside the API edges nobody turns an error class into a status by
// hand: no function both tests an errdefs class (errors.Is(err,
// errdefs.ErrX)) and names an HTTP status.
func TestNoHandMadeStatusMapping(t *testing.T) {
	allowed := map[string]bool{"internal/errdefs": true, "internal/controlplane": true, "internal/nodeapi": true, "internal/edge": true}
	for _, f := range parseFiles(t, "", false) {
		if allowed[f.pkgDir] {
			continue
		}
		for _, d := range f.file.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				continue
			}
			var class, status ast.Node
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				switch x := n.(type) {
				case *ast.CallExpr:
					if isSelector(x.Fun, "errors", "Is") && len(x.Args) == 2 {
						if sel, ok := x.Args[1].(*ast.SelectorExpr); ok && isIdent(sel.X, "errdefs") {
							class = x
						}
					}
				case *ast.SelectorExpr:
					if isIdent(x.X, "http") && strings.HasPrefix(x.Sel.Name, "Status") && x.Sel.Name != "StatusText" {
						status = x
					}
				}
				return true
			})
			if class != nil && status != nil {
				t.Errorf("%s: %s maps an error class to an HTTP status by hand; return the classed error to the edge's mapper", f.pos(class), fn.Name.Name)
			}
		}
	}
}

// Tests ask for root through internal/testenv and skip only through it,
// so a run says what it did not run.
func TestRootChecksGoThroughTestenv(t *testing.T) {
	for _, f := range parseFiles(t, "", true) {
		if !f.test || f.pkgDir == "internal/testenv" {
			continue
		}
		ast.Inspect(f.file, func(n ast.Node) bool {
			sel, ok := n.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			if isIdent(sel.X, "os") && (sel.Sel.Name == "Geteuid" || sel.Sel.Name == "Getuid") {
				t.Errorf("%s: os.%s in a test: use testenv.RequireRoot / RequireNonRoot / IsRoot", f.pos(sel), sel.Sel.Name)
			}
			if id, isID := sel.X.(*ast.Ident); isID && id.Name != "testenv" && (sel.Sel.Name == "Skip" || sel.Sel.Name == "Skipf" || sel.Sel.Name == "SkipNow") {
				t.Errorf("%s: a bare %s: skip through testenv (Require*, Skipf) so the run lists it as NOT RUN", f.pos(sel), sel.Sel.Name)
			}
			return true
		})
	}
}

// longFileLines is where a file has to say why it is one file.
const longFileLines = 550

var longFileReason = regexp.MustCompile(`(?m)^// Long file: \S`)

// A source file over ~500 lines says in its doc comment ("// Long file:
// <reason>") why it is not split; generated code is exempt.
func TestLongFilesSayWhy(t *testing.T) {
	for _, f := range parseFiles(t, "", false) {
		b, err := os.ReadFile(f.path)
		if err != nil {
			t.Fatal(err)
		}
		if n := strings.Count(string(b), "\n"); n > longFileLines && !longFileReason.Match(b) && !ast.IsGenerated(f.file) {
			t.Errorf("%s: %d lines and no \"// Long file: <reason>\" comment: split it by purpose or say why not", f.rel, n)
		}
	}
}

type srcFile struct {
	path, rel, pkgDir string
	test              bool
	fset              *token.FileSet
	file              *ast.File
}

func (f srcFile) pos(n ast.Node) string {
	p := f.fset.Position(n.Pos())
	return f.rel + ":" + strconv.Itoa(p.Line)
}

// parseFiles parses the module's Go files under dir ("" = all), with or
// without tests, skipping caches, node_modules and testdata.
func parseFiles(t *testing.T, dir string, withTests bool) []srcFile {
	t.Helper()
	root := moduleRoot(t)
	var files []srcFile
	fset := token.NewFileSet()
	err := filepath.WalkDir(filepath.Join(root, dir), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			switch d.Name() {
			case ".cache", "node_modules", "testdata", "bin", ".git":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") {
			return nil
		}
		test := strings.HasSuffix(p, "_test.go")
		if test && !withTests {
			return nil
		}
		af, err := parser.ParseFile(fset, p, nil, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		files = append(files, srcFile{path: p, rel: rel, pkgDir: filepath.Dir(rel), test: test, fset: fset, file: af})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

func moduleRoot(t *testing.T) string {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

func isIdent(e ast.Expr, name string) bool {
	id, ok := e.(*ast.Ident)
	return ok && id.Name == name
}

func isSelector(e ast.Expr, pkg, name string) bool {
	sel, ok := e.(*ast.SelectorExpr)
	return ok && isIdent(sel.X, pkg) && sel.Sel.Name == name
}

func keys(m map[string]bool) []string {
	var l []string
	for k := range m {
		l = append(l, k)
	}
	return l
}
