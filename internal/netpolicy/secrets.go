package netpolicy

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/spacesbx/space/internal/errdefs"
)

// Placeholders in header values. Everything that starts with "${e2b." is
// ours: one that is not a well-formed secret reference is refused rather
// than sent upstream as literal text.
const (
	placeholderOpen = "${e2b."
	secretsPrefix   = "e2b.secrets."
	identityPrefix  = "e2b.identity."
	maxSecretName   = 128
)

var errIdentity = errors.New("workload identity tokens (${e2b.identity...}) are not supported")

// scanPlaceholders checks v's placeholders and, when fn is not nil,
// returns v with each secret reference replaced by fn(name).
func scanPlaceholders(v string, fn func(name string) (string, error)) (string, error) {
	var out strings.Builder
	for {
		i := strings.Index(v, placeholderOpen)
		if i < 0 {
			out.WriteString(v)
			return out.String(), nil
		}
		out.WriteString(v[:i])
		end := strings.IndexByte(v[i:], '}')
		if end < 0 {
			return "", errors.New(`unterminated "${e2b." placeholder`)
		}
		inner := v[i+2 : i+end] // without "${" and "}"
		v = v[i+end+1:]
		switch {
		case strings.HasPrefix(inner, identityPrefix):
			return "", errIdentity
		case strings.HasPrefix(inner, secretsPrefix):
			name := inner[len(secretsPrefix):]
			if err := validSecretName(name); err != nil {
				return "", err
			}
			if fn != nil {
				r, err := fn(name)
				if err != nil {
					return "", err
				}
				out.WriteString(r)
			}
		default:
			return "", errors.New(`unknown "${e2b." placeholder (only ${e2b.secrets.NAME})`)
		}
	}
}

// validSecretName: 1-128 bytes of [A-Za-z0-9_.-].
func validSecretName(name string) error {
	if name == "" || len(name) > maxSecretName {
		return fmt.Errorf("secret name must be 1-%d bytes", maxSecretName)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '.' || c == '-') {
			return fmt.Errorf("secret name %s: byte %d is not one of [A-Za-z0-9_.-]", quote(name), i)
		}
	}
	return nil
}

// SecretRefs lists the secret names referenced as ${e2b.secrets.NAME} in
// rule header values, sorted, each once. Malformed placeholders are
// skipped (Validate reports them).
func (s Spec) SecretRefs() []string {
	var refs []string
	for _, list := range s.Rules {
		for _, r := range list {
			if r.Transform == nil {
				continue
			}
			for _, v := range r.Transform.Headers {
				for {
					i := strings.Index(v, placeholderOpen+"secrets.")
					if i < 0 {
						break
					}
					v = v[i+len(placeholderOpen+"secrets."):]
					end := strings.IndexByte(v, '}')
					if end < 0 {
						break
					}
					if name := v[:end]; validSecretName(name) == nil {
						refs = append(refs, name)
					}
					v = v[end+1:]
				}
			}
		}
	}
	slices.Sort(refs)
	return slices.Compact(refs)
}

// ResolveSecrets returns a copy with every ${e2b.secrets.NAME} in rule
// header values replaced by lookup(NAME), in one pass (a secret's value
// is never scanned for placeholders). An unknown name -> an error
// wrapping errdefs.ErrNotFound; ${e2b.identity.tokens.X} or a malformed
// placeholder -> errdefs.ErrInvalid; so is a secret whose value would
// break the header (CR, LF, NUL, over 8 KiB). Errors name the rule,
// header and secret, never a value.
func (s Spec) ResolveSecrets(lookup func(name string) (string, bool)) (Spec, error) {
	out := s.clone()
	for _, key := range sortedKeys(out.Rules) {
		for j, r := range out.Rules[key] {
			if r.Transform == nil {
				continue
			}
			for _, h := range sortedKeys(r.Transform.Headers) {
				v, err := scanPlaceholders(r.Transform.Headers[h], func(name string) (string, error) {
					val, ok := lookup(name)
					if !ok {
						return "", fmt.Errorf("secret %s: %w", quote(name), errdefs.ErrNotFound)
					}
					return val, nil
				})
				if err == nil {
					err = validHeaderValue(v)
				}
				if err != nil {
					if !errors.Is(err, errdefs.ErrNotFound) {
						err = fmt.Errorf("%w: %v", errdefs.ErrInvalid, err)
					}
					return Spec{}, fmt.Errorf("netpolicy: rules[%s][%d] header %s: %w", quote(key), j, quote(h), err)
				}
				r.Transform.Headers[h] = v
			}
		}
	}
	return out, nil
}
