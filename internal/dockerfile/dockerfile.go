// Package dockerfile turns a single-stage Dockerfile into template build
// steps (the E2B template build's RUN, COPY, ENV, WORKDIR and USER) and a
// start command: `space template build` sends those to the platform,
// which runs them in a build sandbox. It understands FROM, RUN, COPY, ADD
// of local files, ENV, WORKDIR, USER, ARG (with --build-arg) and
// CMD/ENTRYPOINT; what has no meaning for a sandbox (EXPOSE, LABEL, ...)
// is reported as a warning, and what would be built wrong (multi-stage
// builds, COPY --from, ADD of a URL) is an error.
package dockerfile

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"path"
	"strings"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
)

// Limits on what Parse reads.
const (
	MaxBytes        = 1 << 20
	MaxInstructions = 1000
)

// Build is a parsed Dockerfile.
type Build struct {
	// From is FROM's reference, ARGs substituted.
	From string
	// Steps are the build steps; COPY steps carry [src, dest, chown, chmod]
	// with src relative to the build context and no FilesHash yet.
	Steps []e2bapi.TemplateStep
	// StartCmd is ENTRYPOINT followed by CMD, as a shell command line.
	StartCmd string
	// Warnings name instructions that were ignored.
	Warnings []string
}

// Error is a Dockerfile mistake at a line.
type Error struct {
	Line int
	Msg  string
}

func (e *Error) Error() string { return fmt.Sprintf("dockerfile: line %d: %s", e.Line, e.Msg) }
func (e *Error) Unwrap() error { return errdefs.ErrInvalid }

type instruction struct {
	line    int
	keyword string
	rest    string
}

// Parse reads a Dockerfile; buildArgs override ARG defaults.
func Parse(r io.Reader, buildArgs map[string]string) (*Build, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxBytes+1))
	if err != nil {
		return nil, fmt.Errorf("dockerfile: %w", err)
	}
	if len(data) > MaxBytes {
		return nil, fmt.Errorf("dockerfile: %w: larger than %d bytes", errdefs.ErrInvalid, MaxBytes)
	}
	ins, err := split(string(data))
	if err != nil {
		return nil, err
	}
	p := &parser{b: &Build{}, args: map[string]string{}, buildArgs: buildArgs, env: map[string]string{}}
	for _, in := range ins {
		if err := p.instruction(in); err != nil {
			return nil, err
		}
	}
	if p.b.From == "" {
		return nil, &Error{Line: 1, Msg: "no FROM instruction"}
	}
	p.b.StartCmd = strings.TrimSpace(strings.Join([]string{p.entrypoint, p.cmd}, " "))
	return p.b, nil
}

// split joins continuation lines and drops comments and blank lines.
func split(text string) ([]instruction, error) {
	var out []instruction
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 64<<10), MaxBytes)
	var cur strings.Builder
	start, n := 0, 0
	for sc.Scan() {
		n++
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if cur.Len() == 0 && (trimmed == "" || strings.HasPrefix(trimmed, "#")) {
			continue
		}
		if cur.Len() > 0 && strings.HasPrefix(trimmed, "#") {
			continue // comment lines inside a continued instruction
		}
		if cur.Len() == 0 {
			start = n
		}
		if strings.HasSuffix(trimmed, `\`) {
			cur.WriteString(strings.TrimSuffix(trimmed, `\`))
			cur.WriteByte(' ')
			continue
		}
		cur.WriteString(trimmed)
		if in, ok := toInstruction(start, cur.String()); ok {
			out = append(out, in)
		}
		cur.Reset()
		if len(out) > MaxInstructions {
			return nil, &Error{Line: n, Msg: fmt.Sprintf("more than %d instructions", MaxInstructions)}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("dockerfile: %w: %v", errdefs.ErrInvalid, err)
	}
	if cur.Len() > 0 {
		if in, ok := toInstruction(start, cur.String()); ok {
			out = append(out, in)
		}
	}
	return out, nil
}

func toInstruction(line int, s string) (instruction, bool) {
	s = strings.TrimSpace(s)
	if s == "" {
		return instruction{}, false
	}
	kw, rest, _ := strings.Cut(s, " ")
	if i := strings.IndexByte(kw, '\t'); i >= 0 {
		kw, rest = kw[:i], kw[i+1:]+" "+rest
	}
	return instruction{line: line, keyword: strings.ToUpper(kw), rest: strings.TrimSpace(rest)}, true
}

type parser struct {
	b         *Build
	args      map[string]string // ARGs in scope
	buildArgs map[string]string
	env       map[string]string
	workdir   string
	user      string
	cmd       string
	// entrypoint and cmd as shell strings
	entrypoint string
	runArgs    []string // ARG names a RUN sees as environment, in order
}

func (p *parser) errf(in instruction, format string, a ...any) error {
	return &Error{Line: in.line, Msg: fmt.Sprintf(format, a...)}
}

func (p *parser) instruction(in instruction) error {
	if in.keyword != "FROM" && in.keyword != "ARG" && p.b.From == "" {
		return p.errf(in, "%s before FROM", in.keyword)
	}
	switch in.keyword {
	case "FROM":
		if p.b.From != "" {
			return p.errf(in, "multi-stage builds are not supported (a second FROM)")
		}
		f := strings.Fields(p.expand(in.rest))
		for len(f) > 0 && strings.HasPrefix(f[0], "--") {
			if strings.HasPrefix(f[0], "--platform") {
				f = f[1:]
				continue
			}
			return p.errf(in, "FROM flag %s is not supported", f[0])
		}
		if len(f) != 1 && !(len(f) == 3 && strings.EqualFold(f[1], "AS")) {
			return p.errf(in, "FROM takes one image or template")
		}
		if f[0] == "scratch" {
			return p.errf(in, "FROM scratch is not supported: a sandbox needs a userland")
		}
		p.b.From = f[0]
		// ARGs declared before FROM are usable in FROM only, unless
		// declared again after it.
		p.args = map[string]string{}
		return nil
	case "ARG":
		name, def, hasDef := strings.Cut(in.rest, "=")
		name = strings.TrimSpace(name)
		if !validName(name) {
			return p.errf(in, "ARG name %q", name)
		}
		v, ok := p.buildArgs[name]
		if !ok && hasDef {
			v = p.expand(unquote(strings.TrimSpace(def)))
		}
		p.args[name] = v
		if p.b.From != "" && !contains(p.runArgs, name) {
			p.runArgs = append(p.runArgs, name)
		}
		return nil
	case "RUN":
		cmd, err := p.command(in)
		if err != nil {
			return err
		}
		if cmd == "" {
			return p.errf(in, "RUN without a command")
		}
		if strings.HasPrefix(cmd, "--") {
			return p.errf(in, "RUN flags (--mount, --network...) are not supported")
		}
		p.b.Steps = append(p.b.Steps, e2bapi.TemplateStep{Type: "RUN", Args: []string{p.withArgs(cmd)}})
		return nil
	case "COPY", "ADD":
		return p.copyStep(in)
	case "ENV":
		pairs, err := envPairs(p.expand(in.rest))
		if err != nil {
			return p.errf(in, "ENV: %v", err)
		}
		var args []string
		for _, kv := range pairs {
			p.env[kv[0]] = kv[1]
			args = append(args, kv[0], kv[1])
		}
		p.b.Steps = append(p.b.Steps, e2bapi.TemplateStep{Type: "ENV", Args: args})
		return nil
	case "WORKDIR":
		dir := unquote(p.expand(in.rest))
		if dir == "" {
			return p.errf(in, "WORKDIR without a path")
		}
		if !path.IsAbs(dir) {
			dir = path.Join("/", p.workdir, dir)
		}
		p.workdir = path.Clean(dir)
		p.b.Steps = append(p.b.Steps, e2bapi.TemplateStep{Type: "WORKDIR", Args: []string{p.workdir}})
		return nil
	case "USER":
		u, _, _ := strings.Cut(unquote(p.expand(in.rest)), ":")
		if u == "" || strings.ContainsAny(u, " \t") {
			return p.errf(in, "USER takes one user")
		}
		p.user = u
		p.b.Steps = append(p.b.Steps, e2bapi.TemplateStep{Type: "USER", Args: []string{u}})
		return nil
	case "CMD":
		cmd, err := p.command(in)
		if err != nil {
			return err
		}
		p.cmd = cmd
		return nil
	case "ENTRYPOINT":
		cmd, err := p.command(in)
		if err != nil {
			return err
		}
		p.entrypoint = cmd
		return nil
	case "EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK", "VOLUME", "SHELL", "ONBUILD":
		p.b.Warnings = append(p.b.Warnings, fmt.Sprintf("line %d: %s is ignored (no meaning for a sandbox template)", in.line, in.keyword))
		return nil
	}
	return p.errf(in, "unknown instruction %q", in.keyword)
}

// command reads a RUN/CMD/ENTRYPOINT argument: the exec form (a JSON
// array) becomes a quoted shell line; the shell form stays as written.
func (p *parser) command(in instruction) (string, error) {
	if strings.HasPrefix(in.rest, "[") {
		var argv []string
		if err := json.Unmarshal([]byte(in.rest), &argv); err == nil {
			q := make([]string, len(argv))
			for i, a := range argv {
				q[i] = ShellQuote(a)
			}
			return strings.Join(q, " "), nil
		}
	}
	return in.rest, nil
}

// withArgs gives a RUN the ARG values in scope as environment variables.
func (p *parser) withArgs(cmd string) string {
	if len(p.runArgs) == 0 {
		return cmd
	}
	var b strings.Builder
	b.WriteString("export")
	for _, n := range p.runArgs {
		fmt.Fprintf(&b, " %s=%s", n, ShellQuote(p.args[n]))
	}
	b.WriteString("; ")
	b.WriteString(cmd)
	return b.String()
}

func (p *parser) copyStep(in instruction) error {
	var chown, chmod string
	var words []string
	if strings.HasPrefix(in.rest, "[") {
		if err := json.Unmarshal([]byte(in.rest), &words); err != nil {
			return p.errf(in, "%s: bad JSON form", in.keyword)
		}
	} else {
		words = strings.Fields(in.rest)
	}
	for len(words) > 0 && strings.HasPrefix(words[0], "--") {
		flag, val, _ := strings.Cut(words[0], "=")
		switch flag {
		case "--chown":
			chown, _, _ = strings.Cut(p.expand(val), ":")
		case "--chmod":
			chmod = p.expand(val)
			if chmod == "" || strings.Trim(chmod, "01234567") != "" || len(chmod) > 4 {
				return p.errf(in, "%s --chmod takes an octal mode", in.keyword)
			}
		case "--from":
			return p.errf(in, "COPY --from (multi-stage builds) is not supported")
		case "--link", "--parents":
		default:
			return p.errf(in, "%s flag %s is not supported", in.keyword, flag)
		}
		words = words[1:]
	}
	if len(words) < 2 {
		return p.errf(in, "%s takes at least one source and a destination", in.keyword)
	}
	dest := p.expand(words[len(words)-1])
	if !path.IsAbs(dest) {
		d := path.Join("/", p.workdir, dest)
		if strings.HasSuffix(dest, "/") || dest == "." {
			d += "/"
		}
		dest = d
	}
	srcs := words[:len(words)-1]
	if len(srcs) > 1 && !strings.HasSuffix(dest, "/") {
		dest += "/" // several sources go into a directory
	}
	if chown == "" {
		chown = "root"
	}
	for _, src := range srcs {
		src = p.expand(src)
		if strings.Contains(src, "://") {
			return p.errf(in, "ADD of a URL is not supported: download it in a RUN step")
		}
		if strings.ContainsAny(src, "*?[") {
			return p.errf(in, "%s: wildcards in sources are not supported", in.keyword)
		}
		clean := path.Clean("/" + src)[1:]
		if clean == "" {
			clean = "."
		}
		if path.IsAbs(src) || src == ".." || strings.HasPrefix(src, "../") || strings.Contains(src, "/../") {
			return p.errf(in, "%s source %q is outside the build context", in.keyword, src)
		}
		if in.keyword == "ADD" && isArchiveName(clean) {
			p.b.Warnings = append(p.b.Warnings, fmt.Sprintf("line %d: ADD %s is copied, not extracted: extract it in a RUN step", in.line, src))
		}
		p.b.Steps = append(p.b.Steps, e2bapi.TemplateStep{Type: "COPY", Args: []string{clean, dest, chown, chmod}})
	}
	return nil
}

func isArchiveName(s string) bool {
	for _, ext := range []string{".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst"} {
		if strings.HasSuffix(s, ext) {
			return true
		}
	}
	return false
}

// expand substitutes $VAR, ${VAR}, ${VAR:-default} and ${VAR:+alt} from
// the ARGs and ENVs in scope (ENV wins, as in Docker); \$ is a literal $.
func (p *parser) expand(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c == '\\' && i+1 < len(s) && s[i+1] == '$' {
			b.WriteByte('$')
			i++
			continue
		}
		if c != '$' || i+1 >= len(s) {
			b.WriteByte(c)
			continue
		}
		if s[i+1] == '{' {
			end := strings.IndexByte(s[i+2:], '}')
			if end < 0 {
				b.WriteString(s[i:])
				return b.String()
			}
			expr := s[i+2 : i+2+end]
			i += 2 + end
			name, mod := expr, ""
			if j := strings.Index(expr, ":"); j >= 0 {
				name, mod = expr[:j], expr[j:]
			}
			v, set := p.lookup(name)
			switch {
			case strings.HasPrefix(mod, ":-"):
				if v == "" {
					v = mod[2:]
				}
			case strings.HasPrefix(mod, ":+"):
				if set && v != "" {
					v = mod[2:]
				} else {
					v = ""
				}
			}
			b.WriteString(v)
			continue
		}
		j := i + 1
		for j < len(s) && (s[j] == '_' || s[j] >= 'A' && s[j] <= 'Z' || s[j] >= 'a' && s[j] <= 'z' || j > i+1 && s[j] >= '0' && s[j] <= '9') {
			j++
		}
		if j == i+1 {
			b.WriteByte(c)
			continue
		}
		v, _ := p.lookup(s[i+1 : j])
		b.WriteString(v)
		i = j - 1
	}
	return b.String()
}

func (p *parser) lookup(name string) (string, bool) {
	if v, ok := p.env[name]; ok {
		return v, true
	}
	v, ok := p.args[name]
	return v, ok
}

// envPairs parses ENV's "k=v k2='v 2'" form, or the legacy "k value".
func envPairs(s string) ([][2]string, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, fmt.Errorf("no variables")
	}
	first, rest, _ := strings.Cut(s, " ")
	if !strings.Contains(first, "=") {
		if !validName(first) {
			return nil, fmt.Errorf("name %q", first)
		}
		return [][2]string{{first, strings.TrimSpace(rest)}}, nil
	}
	words, err := shellWords(s)
	if err != nil {
		return nil, err
	}
	var out [][2]string
	for _, w := range words {
		k, v, ok := strings.Cut(w, "=")
		if !ok || !validName(k) {
			return nil, fmt.Errorf("%q is not name=value", w)
		}
		out = append(out, [2]string{k, v})
	}
	return out, nil
}

// shellWords splits s on blanks, honouring single and double quotes and
// backslash escapes.
func shellWords(s string) ([]string, error) {
	var out []string
	var cur strings.Builder
	inWord := false
	var quote byte
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case quote != 0:
			if c == quote {
				quote = 0
			} else if c == '\\' && quote == '"' && i+1 < len(s) {
				i++
				cur.WriteByte(s[i])
			} else {
				cur.WriteByte(c)
			}
		case c == '\'' || c == '"':
			quote, inWord = c, true
		case c == '\\' && i+1 < len(s):
			i++
			cur.WriteByte(s[i])
			inWord = true
		case c == ' ' || c == '\t':
			if inWord {
				out = append(out, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteByte(c)
			inWord = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unterminated quote")
	}
	if inWord {
		out = append(out, cur.String())
	}
	return out, nil
}

func unquote(s string) string {
	s = strings.TrimSpace(s)
	if len(s) >= 2 && (s[0] == '"' && s[len(s)-1] == '"' || s[0] == '\'' && s[len(s)-1] == '\'') {
		return s[1 : len(s)-1]
	}
	return s
}

func validName(s string) bool {
	if s == "" || len(s) > 256 {
		return false
	}
	for i, c := range s {
		if !(c == '_' || c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// ShellQuote quotes s for POSIX sh.
func ShellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./:=@%+,") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
