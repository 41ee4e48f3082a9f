package dockerfile

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"github.com/spacesbx/space/internal/errdefs"
)

// Stage is one stage of a Dockerfile read as a container image build reads
// it (several FROMs, COPY --from): what Stages returns for checking an
// image's Dockerfile (deploy/container). Parse, which turns a Dockerfile
// into template build steps, still refuses several stages.
type Stage struct {
	// Name is the stage's AS name in lower case ("" when it has none).
	Name string
	// From is FROM's image or earlier stage, global ARGs substituted.
	From string
	// Line is FROM's line.
	Line int
	// Instructions follow FROM, in order (continuations joined, comments
	// dropped, keywords upper-case, arguments as written).
	Instructions []Instruction
}

// Instruction is one instruction of a Stage.
type Instruction struct {
	Line    int
	Keyword string
	Args    string
}

// Exec returns the exec (JSON array) form of a RUN, CMD or ENTRYPOINT;
// ok is false for the shell form.
func (in Instruction) Exec() (argv []string, ok bool) {
	if !strings.HasPrefix(in.Args, "[") {
		return nil, false
	}
	if err := json.Unmarshal([]byte(in.Args), &argv); err != nil {
		return nil, false
	}
	return argv, true
}

// Copy splits a COPY or ADD into its --from stage (empty: the build
// context), its sources and its destination.
func (in Instruction) Copy() (from string, srcs []string, dest string, err error) {
	var words []string
	if strings.HasPrefix(in.Args, "[") {
		if err := json.Unmarshal([]byte(in.Args), &words); err != nil {
			return "", nil, "", &Error{Line: in.Line, Msg: in.Keyword + ": bad JSON form"}
		}
	} else {
		words = strings.Fields(in.Args)
	}
	for len(words) > 0 && strings.HasPrefix(words[0], "--") {
		if f, v, ok := strings.Cut(words[0], "="); ok && f == "--from" {
			from = strings.ToLower(v)
		}
		words = words[1:]
	}
	if len(words) < 2 {
		return "", nil, "", &Error{Line: in.Line, Msg: in.Keyword + " takes at least one source and a destination"}
	}
	return from, words[:len(words)-1], words[len(words)-1], nil
}

// Stages reads a (multi-stage) Dockerfile into its stages. ARGs before the
// first FROM are substituted in FROM lines; nothing else is interpreted.
func Stages(r io.Reader) ([]Stage, error) {
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
	p := &parser{args: map[string]string{}, env: map[string]string{}}
	var out []Stage
	for _, in := range ins {
		switch {
		case in.keyword == "FROM":
			f := strings.Fields(p.expand(in.rest))
			for len(f) > 0 && strings.HasPrefix(f[0], "--") {
				f = f[1:]
			}
			st := Stage{Line: in.line}
			switch {
			case len(f) == 1:
			case len(f) == 3 && strings.EqualFold(f[1], "AS"):
				st.Name = strings.ToLower(f[2])
			default:
				return nil, &Error{Line: in.line, Msg: "FROM takes an image and an optional AS name"}
			}
			st.From = f[0]
			out = append(out, st)
		case len(out) == 0 && in.keyword == "ARG":
			name, def, _ := strings.Cut(in.rest, "=")
			p.args[strings.TrimSpace(name)] = unquote(strings.TrimSpace(def))
		case len(out) == 0:
			return nil, &Error{Line: in.line, Msg: in.keyword + " before FROM"}
		default:
			st := &out[len(out)-1]
			st.Instructions = append(st.Instructions, Instruction{Line: in.line, Keyword: in.keyword, Args: in.rest})
		}
	}
	if len(out) == 0 {
		return nil, &Error{Line: 1, Msg: "no FROM instruction"}
	}
	return out, nil
}
