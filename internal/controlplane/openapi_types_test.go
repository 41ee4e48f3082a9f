package controlplane

import (
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/openapi3"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
)

// The E2B-compatible Go types are hand-written; this checks each against
// its schema in openapi.yaml, so neither can drift from the other:
// every JSON field of the type is a property of the schema with a
// compatible type, every property is a field, a required property is
// never omitempty, and a field always sent that can be null (a pointer
// without omitempty) is nullable.
var e2bSchemas = map[string]any{
	"NewSandbox": e2bapi.NewSandbox{}, "SandboxAutoResumeConfig": e2bapi.AutoResumeConfig{},
	"SandboxVolumeMount": e2bapi.SandboxVolumeMount{}, "Sandbox": e2bapi.Sandbox{},
	"SandboxForkResult": e2bapi.SandboxForkResult{}, "SandboxLifecycle": e2bapi.SandboxLifecycle{},
	"SandboxDetail": e2bapi.SandboxDetail{}, "SandboxNetwork": e2bapi.SandboxNetwork{},
	"SandboxNetworkRule": e2bapi.NetworkRule{}, "SandboxNetworkTransform": e2bapi.NetworkTransform{},
	"EgressProxyInfo": e2bapi.EgressProxyInfo{}, "ListedSandbox": e2bapi.ListedSandbox{},
	"SandboxTimeoutRequest": e2bapi.TimeoutRequest{}, "ForkError": e2bapi.Error{}, "Error": spacev1.Error{}, "SandboxMetric": e2bapi.SandboxMetric{},
	"SandboxesWithMetrics": e2bapi.SandboxesWithMetrics{}, "TeamMetric": e2bapi.TeamMetric{}, "MaxTeamMetric": e2bapi.MaxTeamMetric{},
	"SandboxRefreshRequest": e2bapi.SandboxRefreshRequest{},
	"SandboxLog":            e2bapi.SandboxLog{}, "SandboxLogEntry": e2bapi.SandboxLogEntry{}, "SandboxLogs": e2bapi.SandboxLogs{},
	"SandboxLogsV2Response": e2bapi.SandboxLogsV2Response{}, "SandboxEvent": e2bapi.SandboxEvent{},
	"SandboxEventData": e2bapi.EventData{}, "SandboxEventExecution": e2bapi.EventExecution{},
	"NewWebhook": e2bapi.NewWebhook{}, "WebhookUpdate": e2bapi.WebhookUpdate{}, "Webhook": e2bapi.Webhook{},
	"WebhookDeliveryState": e2bapi.WebhookDeliveryState{}, "FailedDelivery": e2bapi.FailedDelivery{},

	"TemplateBuildRequestV3": e2bapi.TemplateBuildRequestV3{}, "TemplateRequestResponseV3": e2bapi.TemplateRequestResponseV3{},
	"TemplateBuildFileUpload": e2bapi.TemplateBuildFileUpload{}, "TemplateBuildStartV2": e2bapi.TemplateBuildStartV2{},
	"FromImageRegistry": e2bapi.FromImageRegistry{}, "TemplateStep": e2bapi.TemplateStep{},
	"BuildLogEntry": e2bapi.BuildLogEntry{}, "BuildStatusReason": e2bapi.BuildStatusReason{},
	"TemplateBuildInfo": e2bapi.TemplateBuildInfo{}, "TemplateAliasResponse": e2bapi.TemplateAliasResponse{},
	"Template": e2bapi.Template{}, "TemplateBuild": e2bapi.TemplateBuild{}, "TemplateWithBuilds": e2bapi.TemplateWithBuilds{},
	"AssignTemplateTagsRequest": e2bapi.AssignTemplateTagsRequest{}, "AssignedTemplateTags": e2bapi.AssignedTemplateTags{},
	"DeleteTemplateTagsRequest": e2bapi.DeleteTemplateTagsRequest{}, "TemplateTag": e2bapi.TemplateTag{},

	"Team": e2bapi.Team{}, "NewTeam": e2bapi.NewTeam{}, "TeamUser": e2bapi.TeamUser{},
	"IdentifierMaskingDetails": e2bapi.IdentifierMaskingDetails{}, "TeamAPIKey": e2bapi.TeamAPIKey{},
	"CreatedTeamAPIKey": e2bapi.CreatedTeamAPIKey{}, "NewTeamAPIKey": e2bapi.NewTeamAPIKey{},
	"UpdateTeamAPIKey": e2bapi.UpdateTeamAPIKey{}, "NewAccessToken": e2bapi.NewAccessToken{},
	"AccessToken": e2bapi.AccessToken{}, "CreatedAccessToken": e2bapi.CreatedAccessToken{},
	"TeamMember": e2bapi.TeamMember{}, "NewTeamMember": e2bapi.NewTeamMember{}, "InvitedTeamMember": e2bapi.InvitedTeamMember{},

	// The control plane's own answers in E2B shapes.
	"Secret": secretInfo{}, "SnapshotInfo": SnapshotInfo{}, "Volume": volumeInfo{},
	// SPACE's own.
	"Worker": spacev1.Worker{}, "Execution": spacev1.Execution{}, "CapabilityRequest": spacev1.CapabilityRequest{},
	"CapabilityResponse": spacev1.CapabilityResponse{}, "MigrateResponse": spacev1.MigrateResponse{},
	"RotateResponse": spacev1.RotateResponse{},
}

// jsonFields lists a struct's JSON fields (embedded structs flattened).
type jsonField struct {
	name      string
	typ       reflect.Type
	omitEmpty bool
}

func jsonFields(t reflect.Type) []jsonField {
	var out []jsonField
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, opts, _ := strings.Cut(tag, ",")
		if f.Anonymous && name == "" && f.Type.Kind() == reflect.Struct {
			out = append(out, jsonFields(f.Type)...)
			continue
		}
		if name == "" {
			name = f.Name
		}
		out = append(out, jsonField{name: name, typ: f.Type, omitEmpty: strings.Contains(opts, "omitempty") || strings.Contains(opts, "omitzero")})
	}
	return out
}

var (
	timeType = reflect.TypeFor[time.Time]()
	rawType  = reflect.TypeFor[json.RawMessage]()
)

// schemaOf resolves allOf-wrapped references ({nullable, allOf: [$ref]}).
func schemaOf(s *openapi3.Schema) *openapi3.Schema {
	if len(s.AllOf) == 1 && s.Type == nil {
		return s.AllOf[0].Value
	}
	return s
}

// typeErrors compares a Go type with a schema; seen stops recursion.
func typeErrors(where string, gt reflect.Type, s *openapi3.Schema, seen map[reflect.Type]bool) []string {
	s = schemaOf(s)
	for gt.Kind() == reflect.Pointer {
		gt = gt.Elem()
	}
	is := func(ty string) bool { return s.Type != nil && s.Type.Is(ty) }
	bad := func() []string { return []string{fmt.Sprintf("%s: Go %s vs schema type %v", where, gt, s.Type)} }
	switch {
	case gt == rawType:
		return nil // any JSON
	case gt == timeType:
		if !is("string") || s.Format != "date-time" {
			return bad()
		}
		return nil
	}
	switch gt.Kind() {
	case reflect.String:
		if !is("string") {
			return bad()
		}
	case reflect.Bool:
		if !is("boolean") {
			return bad()
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64, reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		if !is("integer") {
			return bad()
		}
	case reflect.Float32, reflect.Float64:
		if !is("number") {
			return bad()
		}
	case reflect.Slice:
		if !is("array") || s.Items == nil {
			return bad()
		}
		return typeErrors(where+"[]", gt.Elem(), s.Items.Value, seen)
	case reflect.Map:
		if !is("object") {
			return bad()
		}
		if s.AdditionalProperties.Schema != nil {
			return typeErrors(where+"{}", gt.Elem(), s.AdditionalProperties.Schema.Value, seen)
		}
	case reflect.Struct:
		if !is("object") {
			return bad()
		}
		if seen[gt] {
			return nil
		}
		seen[gt] = true
		return structErrors(where, gt, s, seen)
	default:
		return bad()
	}
	return nil
}

func structErrors(where string, gt reflect.Type, s *openapi3.Schema, seen map[reflect.Type]bool) []string {
	var errs []string
	fields := map[string]jsonField{}
	for _, f := range jsonFields(gt) {
		fields[f.name] = f
		p, ok := s.Properties[f.name]
		if !ok {
			errs = append(errs, fmt.Sprintf("%s: Go field %q is not in the schema", where, f.name))
			continue
		}
		ps := schemaOf(p.Value)
		if f.typ.Kind() == reflect.Pointer && !f.omitEmpty && !ps.Nullable && !p.Value.Nullable {
			errs = append(errs, fmt.Sprintf("%s.%s: Go sends null (pointer without omitempty); the schema is not nullable", where, f.name))
		}
		errs = append(errs, typeErrors(where+"."+f.name, f.typ, p.Value, seen)...)
	}
	for name, p := range s.Properties {
		if _, ok := fields[name]; !ok && p.Value.Extensions["x-space-pending"] == nil {
			errs = append(errs, fmt.Sprintf("%s: schema property %q has no Go field", where, name))
		}
	}
	for _, name := range s.Required {
		if f, ok := fields[name]; ok && f.omitEmpty {
			errs = append(errs, fmt.Sprintf("%s: %q is required but the Go field is omitempty", where, name))
		}
	}
	sort.Strings(errs)
	return errs
}

// schemaErrors checks one Go value's type against a named schema.
func schemaErrors(doc *openapi3.T, name string, v any) []string {
	ref, ok := doc.Components.Schemas[name]
	if !ok {
		return []string{fmt.Sprintf("no schema %s", name)}
	}
	return typeErrors(name, reflect.TypeOf(v), ref.Value, map[reflect.Type]bool{})
}

func TestE2BTypesMatchOpenAPI(t *testing.T) {
	doc := loadDoc(t)
	for name, v := range e2bSchemas {
		for _, e := range schemaErrors(doc, name, v) {
			t.Error(e)
		}
	}
}

// A deliberate mismatch fails the check, each kind of it.
func TestE2BTypeCheckerCatches(t *testing.T) {
	doc := loadDoc(t)
	type renamed struct { // Team with a field renamed
		TeamID    string `json:"teamId"`
		Name      string `json:"name"`
		APIKey    string `json:"apiKey"`
		IsDefault bool   `json:"isDefault"`
	}
	type wrongType struct {
		TeamID    string `json:"teamID"`
		Name      string `json:"name"`
		APIKey    string `json:"apiKey"`
		IsDefault string `json:"isDefault"`
	}
	type omitted struct {
		TeamID    string `json:"teamID,omitempty"`
		Name      string `json:"name"`
		APIKey    string `json:"apiKey"`
		IsDefault bool   `json:"isDefault"`
	}
	type nullable struct {
		TeamID    *string `json:"teamID"`
		Name      string  `json:"name"`
		APIKey    string  `json:"apiKey"`
		IsDefault bool    `json:"isDefault"`
	}
	type missing struct {
		TeamID string `json:"teamID"`
		Name   string `json:"name"`
		APIKey string `json:"apiKey"`
	}
	for _, c := range []struct {
		v    any
		want string
	}{
		{renamed{}, `Go field "teamId" is not in the schema`},
		{wrongType{}, "Team.isDefault: Go string vs schema type"},
		{omitted{}, `"teamID" is required but the Go field is omitempty`},
		{nullable{}, "Team.teamID: Go sends null"},
		{missing{}, `schema property "isDefault" has no Go field`},
	} {
		errs := schemaErrors(doc, "Team", c.v)
		if !strings.Contains(strings.Join(errs, "\n"), c.want) {
			t.Errorf("%T: errors %q, want one containing %q", c.v, errs, c.want)
		}
	}
	if errs := schemaErrors(doc, "Team", e2bapi.Team{}); len(errs) != 0 {
		t.Errorf("the real Team: %q", errs)
	}
}

// Every struct type of api/e2bapi is checked: a type added there (by any
// change) fails this until it is mapped to its schema in e2bSchemas.
func TestEveryE2BTypeMapped(t *testing.T) {
	mapped := map[string]bool{}
	for _, v := range e2bSchemas {
		ty := reflect.TypeOf(v)
		if ty.PkgPath() == "github.com/spacesbx/space/api/e2bapi" {
			mapped[ty.Name()] = true
		}
	}
	fset := token.NewFileSet()
	files, _ := filepath.Glob("../../api/e2bapi/*.go")
	n := 0
	for _, fn := range files {
		if strings.HasSuffix(fn, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, fn, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			g, ok := d.(*ast.GenDecl)
			if !ok || g.Tok != token.TYPE {
				continue
			}
			for _, sp := range g.Specs {
				ts := sp.(*ast.TypeSpec)
				if _, ok := ts.Type.(*ast.StructType); !ok || !ts.Name.IsExported() {
					continue
				}
				n++
				if !mapped[ts.Name.Name] {
					t.Errorf("e2bapi.%s (%s) is not checked against a schema: add it to e2bSchemas", ts.Name.Name, filepath.Base(fn))
				}
			}
		}
	}
	if n < 30 {
		t.Fatalf("found only %d e2bapi types", n)
	}
}
