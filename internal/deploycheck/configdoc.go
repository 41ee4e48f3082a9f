package deploycheck

import (
	"fmt"
	"regexp"
	"strings"
)

// DocTable is one binary's section of docs/CONFIGURATION.md: its flags
// with the default the table states, and its environment variables.
type DocTable struct {
	Flags map[string]string
	Env   map[string]bool
}

var (
	docSection = regexp.MustCompile("^## `([a-z-]+(?: up)?)`")
	docFlagRow = regexp.MustCompile("^\\| `--([a-z0-9-]+)` \\| [a-z]+ \\| ([^|]*) \\|")
	docEnvRow  = regexp.MustCompile("^\\| `([A-Z][A-Z0-9_]+)` \\|")
)

// ParseConfigDoc reads the reference's sections (## `binary`), each with
// a flag table (| `--flag` | type | default | ...) and an environment table
// (| `NAME` | ...). A default cell is `value` or "none".
func ParseConfigDoc(md string) (map[string]DocTable, error) {
	out := map[string]DocTable{}
	cur := ""
	for n, line := range strings.Split(md, "\n") {
		if m := docSection.FindStringSubmatch(line); m != nil {
			cur = m[1]
			out[cur] = DocTable{Flags: map[string]string{}, Env: map[string]bool{}}
			continue
		}
		if strings.HasPrefix(line, "## ") {
			cur = ""
			continue
		}
		if cur == "" {
			continue
		}
		if m := docFlagRow.FindStringSubmatch(line); m != nil {
			if _, dup := out[cur].Flags[m[1]]; dup {
				return nil, fmt.Errorf("line %d: --%s twice in %s", n+1, m[1], cur)
			}
			def := strings.TrimSpace(m[2])
			if def == "none" {
				def = ""
			} else if len(def) >= 2 && def[0] == '`' && def[len(def)-1] == '`' {
				def = def[1 : len(def)-1]
			} else {
				return nil, fmt.Errorf("line %d: default of --%s: want `value` or none, have %q", n+1, m[1], def)
			}
			out[cur].Flags[m[1]] = def
		} else if m := docEnvRow.FindStringSubmatch(line); m != nil {
			out[cur].Env[m[1]] = true
		}
	}
	return out, nil
}

// CheckConfigDoc compares one binary's documented flags with its real
// ones: every flag documented, nothing documented that does not exist,
// and every default as the binary prints it.
func CheckConfigDoc(bin string, doc DocTable, fs FlagSet, env []string) []error {
	var errs []error
	for name, f := range fs {
		d, ok := doc.Flags[name]
		if !ok {
			errs = append(errs, fmt.Errorf("%s: --%s is not documented", bin, name))
			continue
		}
		if d != f.Default {
			errs = append(errs, fmt.Errorf("%s: --%s: documented default %q, the binary's is %q", bin, name, d, f.Default))
		}
	}
	for name := range doc.Flags {
		if _, ok := fs[name]; !ok {
			errs = append(errs, fmt.Errorf("%s: --%s is documented but the binary has no such flag", bin, name))
		}
	}
	for _, e := range env {
		if !doc.Env[e] {
			errs = append(errs, fmt.Errorf("%s: environment variable %s is not documented", bin, e))
		}
	}
	return errs
}
