package netpolicy

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
)

func secretsSpec(values ...string) Spec {
	h := map[string]string{}
	for i, v := range values {
		h["X-"+string(rune('A'+i))] = v
	}
	return Spec{AllowOut: []string{"a.com"}, Rules: map[string][]Rule{"a.com": {{}, {Transform: &Transform{Headers: h}}}}}
}

func TestSecretRefs(t *testing.T) {
	s := Spec{Rules: map[string][]Rule{
		"a.com":   hdr(map[string]string{"Authorization": "Bearer ${e2b.secrets.TOKEN}", "X-Two": "${e2b.secrets.B}:${e2b.secrets.A}"}),
		"*.b.com": {{}, {Transform: &Transform{Headers: map[string]string{"X-Again": "${e2b.secrets.TOKEN}${e2b.secrets.TOKEN}"}}}},
		"c.com":   hdr(map[string]string{"X-None": "plain ${NOT} ${e2b.identity.tokens.x} ${e2b.secrets.bad name}"}),
	}}
	if got, want := s.SecretRefs(), []string{"A", "B", "TOKEN"}; !reflect.DeepEqual(got, want) {
		t.Errorf("SecretRefs = %v, want %v", got, want)
	}
	if got := (Spec{}).SecretRefs(); len(got) != 0 {
		t.Errorf("SecretRefs(empty) = %v", got)
	}
}

func TestResolveSecrets(t *testing.T) {
	secrets := map[string]string{"TOKEN": "t0k3n", "A": "a-val", "EMPTY": "", "NESTED": "${e2b.secrets.TOKEN}",
		"CRLF": "x\r\nEvil: 1", "NUL": "x\x00", "BIG": strings.Repeat("b", MaxHeaderValueLen)}
	lookup := func(name string) (string, bool) { v, ok := secrets[name]; return v, ok }
	for _, tc := range []struct {
		name, in, want string
		err            error
	}{
		{"found", "${e2b.secrets.TOKEN}", "t0k3n", nil},
		{"text around", "Bearer ${e2b.secrets.TOKEN} (v1)", "Bearer t0k3n (v1)", nil},
		{"twice", "${e2b.secrets.TOKEN}:${e2b.secrets.TOKEN}", "t0k3n:t0k3n", nil},
		{"two names", "${e2b.secrets.A}/${e2b.secrets.TOKEN}", "a-val/t0k3n", nil},
		{"empty secret", "k=${e2b.secrets.EMPTY};", "k=;", nil},
		{"no placeholder", "plain ${TOKEN} $", "plain ${TOKEN} $", nil},
		{"a value is not rescanned", "${e2b.secrets.NESTED}", "${e2b.secrets.TOKEN}", nil},
		{"unknown", "Bearer ${e2b.secrets.NOPE}", "", errdefs.ErrNotFound},
		{"unknown after a known one", "${e2b.secrets.TOKEN}${e2b.secrets.NOPE}", "", errdefs.ErrNotFound},
		{"identity token", "Bearer ${e2b.identity.tokens.X}", "", errdefs.ErrInvalid},
		{"unknown kind", "${e2b.vars.X}", "", errdefs.ErrInvalid},
		{"unterminated", "${e2b.secrets.TOKEN", "", errdefs.ErrInvalid},
		{"secret with CRLF", "${e2b.secrets.CRLF}", "", errdefs.ErrInvalid},
		{"secret with NUL", "${e2b.secrets.NUL}", "", errdefs.ErrInvalid},
		{"secret too long in its value", "x${e2b.secrets.BIG}", "", errdefs.ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := secretsSpec(tc.in, "${e2b.secrets.A}")
			got, err := in.ResolveSecrets(lookup)
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("ResolveSecrets = %v, want %v", err, tc.err)
				}
				for _, v := range secrets {
					if len(v) > 2 && strings.Contains(err.Error(), v) {
						t.Errorf("error %q holds a secret value", err)
					}
				}
				if !strings.Contains(err.Error(), `header "X-A"`) {
					t.Errorf("error %q does not name the header", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("ResolveSecrets: %v", err)
			}
			h := got.Rules["a.com"][1].Transform.Headers
			if h["X-A"] != tc.want || h["X-B"] != "a-val" {
				t.Errorf("resolved %q, %q; want %q, %q", h["X-A"], h["X-B"], tc.want, "a-val")
			}
			// The original is untouched.
			if v := in.Rules["a.com"][1].Transform.Headers["X-A"]; v != tc.in {
				t.Errorf("original changed to %q", v)
			}
			if got.Rules["a.com"][0].Transform != nil || !reflect.DeepEqual(got.AllowOut, in.AllowOut) {
				t.Errorf("rest of the spec not copied: %+v", got)
			}
			if _, err := Compile(got, Defaults{}); err != nil {
				t.Errorf("Compile(resolved): %v", err)
			}
		})
	}
}

// The lookup is asked only for names that are referenced.
func TestResolveSecretsAsksOnlyForRefs(t *testing.T) {
	var asked []string
	_, err := secretsSpec("${e2b.secrets.X}", "no refs").ResolveSecrets(func(name string) (string, bool) {
		asked = append(asked, name)
		return "v", true
	})
	if err != nil || !reflect.DeepEqual(asked, []string{"X"}) {
		t.Errorf("asked %v, err %v", asked, err)
	}
	got, err := (Spec{}).ResolveSecrets(func(string) (string, bool) { t.Fatal("lookup called"); return "", false })
	if err != nil || !reflect.DeepEqual(got, Spec{}) {
		t.Errorf("empty: %+v, %v", got, err)
	}
}
