package controlplane

import (
	"context"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"

	"github.com/spacesbx/space/api/openapi"
)

// The OpenAPI document (api/openapi/openapi.yaml) against the code: it is
// valid, every registered route has an operation and every operation a
// route (drift), the handlers answer what it says (openapi_handlers_test.go)
// and the E2B types in api/e2bapi match its schemas (openapi_types_test.go).

func loadDoc(t testing.TB) *openapi3.T {
	t.Helper()
	doc, err := openapi3.NewLoader().LoadFromData(openapi.YAML)
	if err != nil {
		t.Fatalf("load openapi.yaml: %v", err)
	}
	return doc
}

func TestOpenAPIDocumentValid(t *testing.T) {
	doc := loadDoc(t)
	if err := doc.Validate(context.Background()); err != nil {
		t.Fatalf("openapi.yaml does not validate: %v", err)
	}
	ids := map[string]string{}
	for path, item := range doc.Paths.Map() {
		for method, op := range item.Operations() {
			if op.OperationID == "" {
				t.Errorf("%s %s: no operationId", method, path)
			}
			if prev, ok := ids[op.OperationID]; ok {
				t.Errorf("operationId %s used by %s and %s %s", op.OperationID, prev, method, path)
			}
			ids[op.OperationID] = method + " " + path
			if op.Responses.Default() == nil {
				t.Errorf("%s %s: no default (error) response", method, path)
			}
		}
	}
}

// The served document is the checked-in one, without a key.
func TestOpenAPIServed(t *testing.T) {
	e := newEnv(t, openStore(t), nil)
	r := e.do("GET", "/openapi.yaml", nil, nil)
	if r.Code != 200 || string(r.Body) != string(openapi.YAML) {
		t.Fatalf("GET /openapi.yaml: %d (%d bytes)", r.Code, len(r.Body))
	}
	r = e.do("GET", "/openapi.json", nil, nil)
	var doc map[string]any
	if r.Code != 200 || json.Unmarshal(r.Body, &doc) != nil || doc["openapi"] != "3.0.3" || doc["paths"] == nil {
		t.Fatalf("GET /openapi.json: %d %.200s", r.Code, r.Body)
	}
	if _, err := openapi3.NewLoader().LoadFromData(r.Body); err != nil {
		t.Fatalf("served JSON does not load: %v", err)
	}
}

// pending reports the operation's x-space-pending mark: routes added by
// work merged separately (docs/API.md). Until their route exists the
// router's 404 is accepted for them; once it exists they are checked like
// every other operation.
func pending(op *openapi3.Operation) string {
	if v, ok := op.Extensions["x-space-pending"]; ok {
		return fmt.Sprint(v)
	}
	return ""
}

// excludedPatterns are registered routes the document leaves out, with
// the reason.
var excludedPatterns = map[string]string{
	"/": "the catch-all answering 404 for every unknown route",
	// /dashboard/ (h17-dash): static pages, not an API.
	"GET /dashboard/": "static pages, not part of the REST API",
	"/dashboard/":     "static pages, not part of the REST API",
	"GET /dashboard":  "the redirect to /dashboard/",
}

// registeredPatterns reads the route patterns the control plane registers,
// from its source: every mux.HandleFunc / mux.Handle call in the package's
// non-test files, whatever function it is in (routes.go and each area's
// own xxxRoutes(mux *http.ServeMux)). Reading the source, rather than
// wrapping the mux, keeps every route function's signature what it is.
func registeredPatterns(t testing.TB) []string {
	t.Helper()
	fset := token.NewFileSet()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	consts := map[string]string{} // "pkgname.Name" or "Name" -> value
	var out []string
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		imports := map[string]string{}
		for _, im := range f.Imports {
			p, _ := strconv.Unquote(im.Path.Value)
			n := filepath.Base(p)
			if im.Name != nil {
				n = im.Name.Name
			}
			imports[n] = p
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) != 2 {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || (sel.Sel.Name != "HandleFunc" && sel.Sel.Name != "Handle") {
				return true
			}
			if id, ok := sel.X.(*ast.Ident); !ok || id.Name != "mux" {
				return true
			}
			v, err := evalString(t, call.Args[0], imports, consts)
			if err != nil {
				t.Fatalf("%s: route pattern: %v", fset.Position(call.Pos()), err)
			}
			out = append(out, v)
			return true
		})
	}
	sort.Strings(out)
	return out
}

// evalString evaluates a constant string expression: literals, +, and
// constants of this module's packages.
func evalString(t testing.TB, e ast.Expr, imports, cache map[string]string) (string, error) {
	switch e := e.(type) {
	case *ast.BasicLit:
		if e.Kind == token.STRING {
			return strconv.Unquote(e.Value)
		}
	case *ast.BinaryExpr:
		if e.Op == token.ADD {
			a, err := evalString(t, e.X, imports, cache)
			if err != nil {
				return "", err
			}
			b, err := evalString(t, e.Y, imports, cache)
			return a + b, err
		}
	case *ast.ParenExpr:
		return evalString(t, e.X, imports, cache)
	case *ast.SelectorExpr:
		pkg, ok := e.X.(*ast.Ident)
		if !ok {
			break
		}
		path, ok := imports[pkg.Name]
		const mod = "github.com/spacesbx/space/"
		if !ok || !strings.HasPrefix(path, mod) {
			break
		}
		return packageConst(t, filepath.Join("..", "..", strings.TrimPrefix(path, mod)), e.Sel.Name, cache)
	case *ast.Ident:
		return packageConst(t, ".", e.Name, cache)
	}
	return "", fmt.Errorf("not a constant string expression (%T)", e)
}

func packageConst(t testing.TB, dir, name string, cache map[string]string) (string, error) {
	key := dir + "." + name
	if v, ok := cache[key]; ok {
		return v, nil
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.go"))
	fset := token.NewFileSet()
	for _, fn := range files {
		if strings.HasSuffix(fn, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, fn, nil, 0)
		if err != nil {
			return "", err
		}
		for _, d := range f.Decls {
			g, ok := d.(*ast.GenDecl)
			if !ok || g.Tok != token.CONST {
				continue
			}
			for _, s := range g.Specs {
				vs := s.(*ast.ValueSpec)
				for i, n := range vs.Names {
					if n.Name == name && i < len(vs.Values) {
						v, err := evalString(t, vs.Values[i], map[string]string{}, cache)
						if err == nil {
							cache[key] = v
						}
						return v, err
					}
				}
			}
		}
	}
	return "", fmt.Errorf("constant %s not found in %s", name, dir)
}

var pathParamRE = regexp.MustCompile(`\{[^}]+\}`)

// samplePath fills a document path's parameters with a value no route
// treats specially.
func samplePath(p string) string { return pathParamRE.ReplaceAllString(p, "p0x1") }

// opRequest is one sample request per operation, for routing.
type docOp struct {
	method, path string
	op           *openapi3.Operation
}

func docOps(doc *openapi3.T) []docOp {
	var out []docOp
	for path, item := range doc.Paths.Map() {
		for method, op := range item.Operations() {
			out = append(out, docOp{method, path, op})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].path+out[i].method < out[j].path+out[j].method })
	return out
}

// driftErrors matches the document against the registered patterns: an
// operation no pattern routes (unless pending), a pattern no operation
// reaches (unless excluded).
func driftErrors(doc *openapi3.T, patterns []string) []string {
	mux := http.NewServeMux()
	for _, p := range patterns {
		mux.HandleFunc(p, func(http.ResponseWriter, *http.Request) {})
	}
	var errs []string
	reached := map[string]bool{}
	for _, o := range docOps(doc) {
		req := httptest.NewRequest(o.method, samplePath(o.path), nil)
		_, pat := mux.Handler(req)
		reached[pat] = true
		if pat == "" || pat == "/" {
			if pending(o.op) == "" {
				errs = append(errs, fmt.Sprintf("operation %s %s (%s) has no route", o.method, o.path, o.op.OperationID))
			}
		}
	}
	for _, p := range patterns {
		if _, ok := excludedPatterns[p]; !ok && !reached[p] {
			errs = append(errs, fmt.Sprintf("route %q has no operation in openapi.yaml", p))
		}
	}
	return errs
}

func TestOpenAPIRoutesDrift(t *testing.T) {
	patterns := registeredPatterns(t)
	if len(patterns) < 50 || !slices.Contains(patterns, "GET /api-keys") || !slices.Contains(patterns, "POST /space/v1/signed-files/sandbox") {
		t.Fatalf("route scan found too little: %q", patterns)
	}
	doc := loadDoc(t)
	for _, e := range driftErrors(doc, patterns) {
		t.Error(e)
	}
	for _, o := range docOps(doc) {
		if p := pending(o.op); p != "" {
			t.Logf("pending (%s): %s %s", p, o.method, o.path)
		}
	}
}

// The drift check fails both ways: a route the document lacks, and an
// operation without a route.
func TestOpenAPIDriftCheckerCatches(t *testing.T) {
	doc := loadDoc(t)
	patterns := registeredPatterns(t)
	if errs := driftErrors(doc, append(slices.Clone(patterns), "GET /sandboxes/{id}/secret-extra")); len(errs) != 1 || !strings.Contains(errs[0], "secret-extra") {
		t.Fatalf("an undocumented route: %q", errs)
	}
	var fewer []string
	for _, p := range patterns {
		if p != "DELETE /api-keys/{apiKeyID}" {
			fewer = append(fewer, p)
		}
	}
	if errs := driftErrors(doc, fewer); len(errs) != 1 || !strings.Contains(errs[0], "deleteAPIKey") {
		t.Fatalf("an operation without a route: %q", errs)
	}
}
