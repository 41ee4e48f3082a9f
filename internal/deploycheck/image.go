package deploycheck

import (
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/spacesbx/space/internal/dockerfile"
)

// ImageRules are what the container image's Dockerfile is checked
// against.
type ImageRules struct {
	// Context is the build context (the repository root).
	Context string
	// Built names the binaries `make build` builds.
	Built map[string]bool
	// Targets maps each final stage operators build (--target) to the
	// binary its ENTRYPOINT runs.
	Targets map[string]string
}

// CheckDockerfile reads a Dockerfile and returns its stages and what is
// wrong with it: FROM and COPY --from name earlier stages or images,
// COPY sources from the context exist, every target's ENTRYPOINT runs
// one of SPACE's binaries in exec form, and the binary is copied into
// the target (or a stage it is built on).
func (r ImageRules) CheckDockerfile(name string, rd io.Reader) ([]dockerfile.Stage, []error) {
	stages, err := dockerfile.Stages(rd)
	if err != nil {
		return nil, []error{fmt.Errorf("%s: %w", name, err)}
	}
	var errs []error
	bad := func(line int, format string, a ...any) {
		errs = append(errs, fmt.Errorf("%s:%d: %s", name, line, fmt.Sprintf(format, a...)))
	}
	byName := map[string]int{}
	copied := map[int][]string{} // stage -> destinations of COPY --from
	for i, st := range stages {
		if st.Name != "" {
			if _, dup := byName[st.Name]; dup {
				bad(st.Line, "stage %s is defined twice", st.Name)
			}
			byName[st.Name] = i
		}
		if j, ok := byName[st.From]; ok && j != i {
			copied[i] = append(copied[i], copied[j]...)
		} else if !strings.Contains(st.From, ":") && !strings.Contains(st.From, "@") {
			bad(st.Line, "FROM %s: neither an earlier stage nor a pinned image (name:tag)", st.From)
		}
		for _, in := range st.Instructions {
			if in.Keyword != "COPY" && in.Keyword != "ADD" {
				continue
			}
			from, srcs, dest, err := in.Copy()
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", name, err))
				continue
			}
			if from != "" {
				if j, ok := byName[from]; !ok || j >= i {
					bad(in.Line, "COPY --from=%s names no earlier stage", from)
				}
				for _, s := range srcs {
					d := dest
					if strings.HasSuffix(dest, "/") {
						d = path.Join(dest, path.Base(s))
					}
					copied[i] = append(copied[i], d)
				}
				continue
			}
			for _, s := range srcs {
				if strings.ContainsAny(s, "*?[") || strings.Contains(s, "://") {
					bad(in.Line, "%s source %s: use plain paths of the repository", in.Keyword, s)
					continue
				}
				if _, err := os.Stat(filepath.Join(r.Context, filepath.FromSlash(s))); err != nil {
					bad(in.Line, "%s source %s does not exist in the build context", in.Keyword, s)
				}
			}
		}
	}
	for target, bin := range r.Targets {
		i, ok := byName[target]
		if !ok {
			errs = append(errs, fmt.Errorf("%s: no stage %q (docker build --target %s)", name, target, target))
			continue
		}
		var argv []string
		line := stages[i].Line
		for j := i; ; {
			for _, in := range stages[j].Instructions {
				if in.Keyword == "ENTRYPOINT" {
					if a, ok := in.Exec(); ok {
						argv = a
					} else {
						bad(in.Line, "ENTRYPOINT in shell form: signals would go to a shell, not %s", bin)
						argv = []string{}
					}
					line = in.Line
				}
			}
			if argv != nil {
				break
			}
			k, ok := byName[stages[j].From]
			if !ok {
				break
			}
			j = k
		}
		switch {
		case argv == nil:
			bad(line, "target %s has no ENTRYPOINT", target)
		case len(argv) == 0:
		case !r.Built[path.Base(argv[0])] || path.Base(argv[0]) != bin:
			bad(line, "target %s: ENTRYPOINT runs %s, want %s (a binary make build builds)", target, argv[0], bin)
		case !contains(copied[i], argv[0]):
			bad(line, "target %s: ENTRYPOINT %s is not copied into the image", target, argv[0])
		}
	}
	return stages, errs
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}
