package deploycheck

import (
	"bufio"
	"fmt"
	"io"
	"strings"
)

// Unit is a systemd unit file (or drop-in): its entries by section, in
// order, keys as written.
type Unit struct {
	Name     string
	Sections map[string][]Entry
}

// Entry is one Key=Value line.
type Entry struct {
	Key, Value string
	Line       int
}

// ParseUnit reads a unit file in systemd's syntax: [Section] headers,
// Key=Value lines, comments (# or ;), and lines continued with a
// trailing backslash.
func ParseUnit(name string, r io.Reader) (*Unit, error) {
	u := &Unit{Name: name, Sections: map[string][]Entry{}}
	sc := bufio.NewScanner(r)
	section, n, start := "", 0, 0
	var cont strings.Builder
	for sc.Scan() {
		n++
		line := strings.TrimSpace(sc.Text())
		if cont.Len() == 0 {
			if line == "" || line[0] == '#' || line[0] == ';' {
				continue
			}
			start = n
		} else if line != "" && (line[0] == '#' || line[0] == ';') {
			continue // comments inside a continued value
		}
		if strings.HasSuffix(line, `\`) {
			cont.WriteString(strings.TrimSuffix(line, `\`))
			cont.WriteByte(' ')
			continue
		}
		cont.WriteString(line)
		full := cont.String()
		cont.Reset()
		if strings.HasPrefix(full, "[") {
			if !strings.HasSuffix(full, "]") {
				return nil, fmt.Errorf("%s:%d: bad section header %q", name, start, full)
			}
			section = full[1 : len(full)-1]
			if _, ok := u.Sections[section]; !ok {
				u.Sections[section] = nil // a section may be empty
			}
			continue
		}
		k, v, ok := strings.Cut(full, "=")
		if !ok {
			return nil, fmt.Errorf("%s:%d: not Key=Value: %q", name, start, full)
		}
		if section == "" {
			return nil, fmt.Errorf("%s:%d: %s outside a section", name, start, strings.TrimSpace(k))
		}
		u.Sections[section] = append(u.Sections[section], Entry{Key: strings.TrimSpace(k), Value: strings.TrimSpace(v), Line: start})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if cont.Len() > 0 {
		return nil, fmt.Errorf("%s:%d: file ends inside a continued line", name, start)
	}
	return u, nil
}

// Values returns every value of key in section, in order. An empty
// assignment resets the list, as systemd does for list settings.
func (u *Unit) Values(section, key string) []string {
	var out []string
	for _, e := range u.Sections[section] {
		if e.Key != key {
			continue
		}
		if e.Value == "" {
			out = nil
			continue
		}
		out = append(out, e.Value)
	}
	return out
}

// Has reports whether section sets key at all (an empty value counts:
// CapabilityBoundingSet= is the empty set).
func (u *Unit) Has(section, key string) bool {
	for _, e := range u.Sections[section] {
		if e.Key == key {
			return true
		}
	}
	return false
}

// Value returns the last value of key in section ("" when unset).
func (u *Unit) Value(section, key string) string {
	v := u.Values(section, key)
	if len(v) == 0 {
		return ""
	}
	return v[len(v)-1]
}

// SplitCommand splits an Exec*= line as systemd does: its prefix
// characters (@-:+!) apart, then words separated by blanks, with single
// and double quotes and backslash escapes. $VAR (a word of its own) and
// ${VAR} are expanded from env; a variable env lacks is an error, since
// systemd would silently expand it to nothing.
func SplitCommand(line string, env map[string]string) (prefix string, argv []string, err error) {
	line = strings.TrimSpace(line)
	for line != "" && strings.ContainsRune("@-:+!", rune(line[0])) {
		prefix += line[:1]
		line = line[1:]
	}
	words, err := splitWords(line)
	if err != nil {
		return "", nil, err
	}
	for _, w := range words {
		if name, ok := strings.CutPrefix(w.s, "$"); ok && !w.quoted && isVarName(name) {
			v, ok := env[name]
			if !ok {
				return "", nil, fmt.Errorf("$%s is not set by the unit's environment files", name)
			}
			argv = append(argv, strings.Fields(v)...)
			continue
		}
		s, err := expandBraced(w.s, env)
		if err != nil {
			return "", nil, err
		}
		argv = append(argv, s)
	}
	if len(argv) == 0 {
		return "", nil, fmt.Errorf("empty command")
	}
	return prefix, argv, nil
}

type word struct {
	s      string
	quoted bool
}

func splitWords(s string) ([]word, error) {
	var out []word
	var cur strings.Builder
	in, quoted := false, false
	var q byte
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case q != 0 && c == q:
			q = 0
		case q == 0 && (c == '"' || c == '\''):
			q, in, quoted = c, true, true
		case c == '\\' && i+1 < len(s):
			i++
			cur.WriteByte(s[i])
			in = true
		case q == 0 && (c == ' ' || c == '\t'):
			if in {
				out = append(out, word{cur.String(), quoted})
				cur.Reset()
				in, quoted = false, false
			}
		default:
			cur.WriteByte(c)
			in = true
		}
	}
	if q != 0 {
		return nil, fmt.Errorf("unterminated quote in %q", s)
	}
	if in {
		out = append(out, word{cur.String(), quoted})
	}
	return out, nil
}

func expandBraced(s string, env map[string]string) (string, error) {
	var b strings.Builder
	for {
		i := strings.Index(s, "${")
		if i < 0 {
			b.WriteString(s)
			return b.String(), nil
		}
		j := strings.IndexByte(s[i:], '}')
		if j < 0 {
			return "", fmt.Errorf("unterminated ${ in %q", s)
		}
		name := s[i+2 : i+j]
		v, ok := env[name]
		if !ok {
			return "", fmt.Errorf("${%s} is not set by the unit's environment files", name)
		}
		b.WriteString(s[:i])
		b.WriteString(v)
		s = s[i+j+1:]
	}
}

func isVarName(s string) bool {
	if s == "" {
		return false
	}
	for i, c := range s {
		if !(c == '_' || c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

// ParseEnvFile reads an EnvironmentFile= (KEY=value lines, # comments,
// optional quotes around a value).
func ParseEnvFile(name string, r io.Reader) (map[string]string, error) {
	env := map[string]string{}
	sc := bufio.NewScanner(r)
	n := 0
	for sc.Scan() {
		n++
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		k = strings.TrimSpace(strings.TrimPrefix(k, "export "))
		if !ok || !isVarName(k) {
			return nil, fmt.Errorf("%s:%d: not KEY=value", name, n)
		}
		v = strings.TrimSpace(v)
		if len(v) >= 2 && (v[0] == '"' || v[0] == '\'') && v[len(v)-1] == v[0] {
			v = v[1 : len(v)-1]
		}
		env[k] = v
	}
	return env, sc.Err()
}
