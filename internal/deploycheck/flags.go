package deploycheck

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
)

// Flag is one flag as a Go binary's -h output describes it.
type Flag struct {
	Name string
	// Type is the value's type name (string, int, float, value, ...);
	// empty for a boolean flag.
	Type string
	// Default is the default Go prints, unquoted; empty when it prints
	// none (the zero value).
	Default string
	Usage   string
}

// Bool reports whether the flag takes no value (-name, -name=false).
func (f Flag) Bool() bool { return f.Type == "" }

// FlagSet is a binary's flags by name.
type FlagSet map[string]Flag

// HelpFlags runs bin with args and -h in an environment of PATH only (so
// defaults taken from the environment show as the binary's own) and reads
// the flags it prints.
func HelpFlags(ctx context.Context, bin string, args ...string) (FlagSet, error) {
	cmd := exec.CommandContext(ctx, bin, append(args, "-h")...)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	fs, perr := ParseHelp(out.String())
	if perr != nil {
		return nil, fmt.Errorf("%s -h: %w (exit: %v)", bin, perr, err)
	}
	return fs, nil
}

var (
	flagLine      = regexp.MustCompile(`^  -([A-Za-z0-9][A-Za-z0-9._-]*)(?: ([a-z0-9]+))?(?:\t(.*))?$`)
	quotedDefault = regexp.MustCompile(` \(default ("(?:[^"\\]|\\.)*")\)$`)
	plainDefault  = regexp.MustCompile(` \(default ([^ ()]+)\)$`)
)

// ParseHelp reads the flag list of Go's flag.PrintDefaults format:
//
//	-name type
//	  	usage (default "x")
func ParseHelp(text string) (FlagSet, error) {
	fs := FlagSet{}
	var cur *Flag
	flush := func() {
		if cur == nil {
			return
		}
		cur.Usage = strings.TrimSpace(cur.Usage)
		if cur.Type == "string" {
			if m := quotedDefault.FindStringSubmatch(cur.Usage); m != nil {
				if s, err := strconv.Unquote(m[1]); err == nil {
					cur.Default = s
					cur.Usage = strings.TrimSuffix(cur.Usage, m[0])
				}
			}
		} else if m := plainDefault.FindStringSubmatch(cur.Usage); m != nil && isPlainDefault(cur.Type, m[1]) {
			cur.Default = m[1]
			cur.Usage = strings.TrimSuffix(cur.Usage, m[0])
		}
		fs[cur.Name] = *cur
		cur = nil
	}
	for _, line := range strings.Split(text, "\n") {
		if m := flagLine.FindStringSubmatch(line); m != nil {
			flush()
			cur = &Flag{Name: m[1], Type: m[2], Usage: m[3]}
			continue
		}
		if cur != nil && strings.HasPrefix(line, "    \t") {
			cur.Usage += " " + strings.TrimPrefix(line, "    \t")
			continue
		}
		flush()
	}
	flush()
	if len(fs) == 0 {
		return nil, fmt.Errorf("no flags in the help text")
	}
	return fs, nil
}

// isPlainDefault tells a default Go appended from the end of a usage text
// that happens to read "(default ...)": Go prints the value of the flag's
// type.
func isPlainDefault(typ, v string) bool {
	switch typ {
	case "":
		return v == "true" || v == "false"
	case "int", "uint":
		_, err := strconv.ParseInt(v, 10, 64)
		return err == nil
	case "float":
		_, err := strconv.ParseFloat(v, 64)
		return err == nil
	}
	return true
}

// CheckArgs checks a command line's arguments (without the program name)
// against fs: every flag exists, takes a value when it needs one, and the
// value parses as its type unless it is substituted at run time
// ($VAR, ${VAR}, $(VAR)). Positional arguments are refused: none of
// SPACE's servers takes one. secret names flags that must never be on a
// command line (visible in process listings).
func CheckArgs(fs FlagSet, args []string, secret ...string) []error {
	var errs []error
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" || !strings.HasPrefix(a, "-") || a == "-" {
			errs = append(errs, fmt.Errorf("positional argument %q: no flag takes it", a))
			continue
		}
		name, val, hasVal := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-"), "=")
		f, ok := fs[name]
		if !ok {
			errs = append(errs, fmt.Errorf("flag --%s is not defined by the binary", name))
			continue
		}
		for _, s := range secret {
			if s == name {
				errs = append(errs, fmt.Errorf("flag --%s carries a secret: pass it in the environment", name))
			}
		}
		if f.Bool() {
			if hasVal && !substituted(val) {
				if _, err := strconv.ParseBool(val); err != nil {
					errs = append(errs, fmt.Errorf("flag --%s: %q is not a boolean", name, val))
				}
			}
			continue
		}
		if !hasVal {
			if i+1 >= len(args) {
				errs = append(errs, fmt.Errorf("flag --%s needs a value", name))
				continue
			}
			i++
			val = args[i]
		}
		if err := checkValue(f, val); err != nil {
			errs = append(errs, fmt.Errorf("flag --%s: %w", name, err))
		}
	}
	return errs
}

func substituted(v string) bool { return strings.Contains(v, "$") }

func checkValue(f Flag, v string) error {
	if substituted(v) {
		return nil
	}
	var err error
	switch f.Type {
	case "int":
		_, err = strconv.ParseInt(v, 0, 64)
	case "uint":
		_, err = strconv.ParseUint(v, 0, 64)
	case "float":
		_, err = strconv.ParseFloat(v, 64)
	}
	if err != nil {
		return fmt.Errorf("%q is not a %s", v, f.Type)
	}
	return nil
}
