// Package cli implements the `space` command line. It drives SPACE through
// the Go SDK exactly as a customer would.
package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"github.com/spacesbx/space/internal/up"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spacesbx/space/sdk"
)

// Exit codes.
const (
	ExitOK    = 0
	ExitError = 1
	ExitUsage = 2
	// ExitAbnormal is returned by exec when the command did not exit
	// normally (killed by a signal, stream cut).
	ExitAbnormal = 255
)

// Defaults for a local `space up`.
const (
	DefaultAPIURL     = "http://127.0.0.1:3000"
	DefaultSandboxURL = "http://127.0.0.1:3001"
)

const usage = `space: SPACE sandboxes from the command line

Usage:
  space [global flags] <command> [flags] [args]

Commands:
  up [--workers N] [--api-key K] [--data-dir D] [--api-addr A] [--edge-addr A]
                 run a single-machine SPACE (etcd, control plane, workers, edge)
  sandbox create [--template base] [--timeout 300] [--metadata k=v]... [--env k=v]... [--secure=true]
  sandbox list [--json]
  sandbox get <id>
  sandbox kill <id>
  sandbox timeout <id> <seconds>
  exec <id> [--user u] [--cwd dir] [--env k=v]... -- cmd [args...]
  fs ls <id> <path>
  fs cat <id> <path>
  fs put <id> <local> <remote>
  fs get <id> <remote> <local>
  term <id> [--user u] [--cwd dir]

Global flags (also accepted after the command):
  --api-url      control plane URL   (env SPACE_API_URL, E2B_API_URL; default ` + DefaultAPIURL + `)
  --sandbox-url  edge URL            (env SPACE_SANDBOX_URL, E2B_SANDBOX_URL; default ` + DefaultSandboxURL + `)
  --api-key      API key             (env SPACE_API_KEY, E2B_API_KEY)
`

// env is what a command may touch besides its arguments; tests replace it.
type env struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	getenv         func(string) string
	// term is the local terminal for `space term` (nil: not a terminal).
	term terminal
}

// usageError is a command-line mistake (exit 2).
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, a ...any) error { return &usageError{fmt.Sprintf(format, a...)} }

// exitCode is a command's requested exit status (exec).
type exitCode int

func (e exitCode) Error() string { return "exit " + strconv.Itoa(int(e)) }

// Main runs the CLI with args (without the program name) and returns the
// process exit code.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return run(ctx, args, &env{stdin: os.Stdin, stdout: stdout, stderr: stderr, getenv: os.Getenv, term: stdinTerminal()})
}

func run(ctx context.Context, args []string, e *env) int {
	err := dispatch(ctx, args, e)
	var ue *usageError
	var ec exitCode
	switch {
	case err == nil:
		return ExitOK
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprint(e.stdout, usage)
		return ExitOK
	case errors.As(err, &ue):
		fmt.Fprintf(e.stderr, "space: %s\n\nRun 'space help' for usage.\n", ue.msg)
		return ExitUsage
	case errors.As(err, &ec):
		return int(ec)
	default:
		fmt.Fprintf(e.stderr, "space: %s\n", describe(err))
		return ExitError
	}
}

// describe renders an error with a hint for the common classes.
func describe(err error) string {
	msg := err.Error()
	switch {
	case errors.Is(err, sdk.ErrUnauthorized):
		return msg + " (check --api-key / SPACE_API_KEY)"
	case errors.Is(err, context.Canceled):
		return "interrupted"
	}
	return msg
}

// globals are the connection flags.
type globals struct {
	apiURL, sandboxURL, apiKey string
}

func (g *globals) register(fs *flag.FlagSet) {
	fs.StringVar(&g.apiURL, "api-url", g.apiURL, "control plane URL")
	fs.StringVar(&g.sandboxURL, "sandbox-url", g.sandboxURL, "edge URL")
	fs.StringVar(&g.apiKey, "api-key", g.apiKey, "API key")
}

func firstEnv(getenv func(string) string, names ...string) string {
	for _, n := range names {
		if v := getenv(n); v != "" {
			return v
		}
	}
	return ""
}

func (g *globals) client() (*sdk.Client, error) {
	c, err := sdk.New(sdk.Config{APIURL: g.apiURL, SandboxURL: g.sandboxURL, APIKey: g.apiKey})
	if err != nil {
		return nil, usagef("%v", err)
	}
	return c, nil
}

func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// parse parses flags interspersed with positional arguments. Everything
// after a literal "--" is returned as rest, unparsed.
func parse(fs *flag.FlagSet, args []string) (pos, rest []string, dashdash bool, err error) {
	head := args
	for i, a := range args {
		if a == "--" {
			head, rest, dashdash = args[:i], args[i+1:], true
			break
		}
	}
	for {
		if err := fs.Parse(head); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, nil, false, err
			}
			return nil, nil, false, usagef("%s: %v", fs.Name(), err)
		}
		left := fs.Args()
		if len(left) == 0 {
			break
		}
		pos = append(pos, left[0])
		head = left[1:]
	}
	return pos, rest, dashdash, nil
}

func dispatch(ctx context.Context, args []string, e *env) error {
	g := &globals{
		apiURL:     firstEnv(e.getenv, "SPACE_API_URL", "E2B_API_URL"),
		sandboxURL: firstEnv(e.getenv, "SPACE_SANDBOX_URL", "E2B_SANDBOX_URL"),
		apiKey:     firstEnv(e.getenv, "SPACE_API_KEY", "E2B_API_KEY"),
	}
	if g.apiURL == "" {
		g.apiURL = DefaultAPIURL
	}
	if g.sandboxURL == "" {
		g.sandboxURL = DefaultSandboxURL
	}
	top := newFlagSet("space")
	g.register(top)
	if err := top.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usagef("%v", err)
	}
	args = top.Args()
	if len(args) == 0 {
		return usagef("missing command")
	}
	cmd, args := args[0], args[1:]
	switch cmd {
	case "help", "-h", "--help":
		return flag.ErrHelp
	case "sandbox", "sbx":
		if len(args) == 0 {
			return usagef("sandbox: missing subcommand (create, list, get, kill, timeout)")
		}
		switch args[0] {
		case "create":
			return cmdCreate(ctx, g, args[1:], e)
		case "list", "ls":
			return cmdList(ctx, g, args[1:], e)
		case "get":
			return cmdGet(ctx, g, args[1:], e)
		case "kill", "rm":
			return cmdKill(ctx, g, args[1:], e)
		case "timeout":
			return cmdTimeout(ctx, g, args[1:], e)
		}
		return usagef("sandbox: unknown subcommand %q", args[0])
	case "exec":
		return cmdExec(ctx, g, args, e)
	case "fs":
		if len(args) == 0 {
			return usagef("fs: missing subcommand (ls, cat, put, get)")
		}
		switch args[0] {
		case "ls", "cat", "put", "get":
			return cmdFS(ctx, g, args[0], args[1:], e)
		}
		return usagef("fs: unknown subcommand %q", args[0])
	case "term", "terminal":
		return cmdTerm(ctx, g, args, e)
	case "up":
		if code := up.Run(ctx, args, e.getenv, e.stdout, e.stderr); code != 0 {
			return exitCode(code)
		}
		return nil
	}
	return usagef("unknown command %q", cmd)
}

// kvFlag collects repeated k=v flags.
type kvFlag map[string]string

func (m kvFlag) String() string { return "" }

func (m kvFlag) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" {
		return fmt.Errorf("%q is not key=value", s)
	}
	m[k] = v
	return nil
}

func cmdCreate(ctx context.Context, g *globals, args []string, e *env) error {
	fs := newFlagSet("sandbox create")
	g.register(fs)
	template := fs.String("template", "base", "template id or alias")
	timeout := fs.Int("timeout", 0, "lifetime in seconds (0: server default)")
	secure := fs.Bool("secure", true, "require the sandbox access token for data-plane access")
	md, envs := kvFlag{}, kvFlag{}
	fs.Var(md, "metadata", "metadata key=value (repeatable)")
	fs.Var(envs, "env", "environment variable key=value (repeatable)")
	pos, _, _, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usagef("sandbox create: unexpected argument %q", pos[0])
	}
	if *timeout < 0 {
		return usagef("sandbox create: --timeout must not be negative")
	}
	c, err := g.client()
	if err != nil {
		return err
	}
	o := sdk.CreateOptions{Template: *template, Timeout: time.Duration(*timeout) * time.Second, Secure: *secure}
	if len(md) > 0 {
		o.Metadata = md
	}
	if len(envs) > 0 {
		o.EnvVars = envs
	}
	sbx, err := c.CreateSandbox(ctx, o)
	if err != nil {
		return err
	}
	fmt.Fprintln(e.stdout, sbx.ID)
	return nil
}

func cmdList(ctx context.Context, g *globals, args []string, e *env) error {
	fs := newFlagSet("sandbox list")
	g.register(fs)
	asJSON := fs.Bool("json", false, "print JSON")
	pos, _, _, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usagef("sandbox list: unexpected argument %q", pos[0])
	}
	c, err := g.client()
	if err != nil {
		return err
	}
	list, err := c.ListSandboxes(ctx)
	if err != nil {
		return err
	}
	if *asJSON {
		if list == nil {
			list = []sdk.SandboxInfo{}
		}
		return printJSON(e.stdout, list)
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SANDBOX\tTEMPLATE\tSTATE\tSTARTED\tENDS\tMETADATA")
	for _, s := range list {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", s.SandboxID, s.TemplateID, s.State,
			fmtTime(s.StartedAt), fmtTime(s.EndAt), fmtMap(s.Metadata))
	}
	return tw.Flush()
}

func fmtTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

func fmtMap(m map[string]string) string {
	if len(m) == 0 {
		return "-"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + m[k]
	}
	return strings.Join(parts, ",")
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// oneID parses a command that takes exactly n positional arguments.
func positional(name string, g *globals, args []string, n int, names string) ([]string, error) {
	fs := newFlagSet(name)
	g.register(fs)
	pos, _, _, err := parse(fs, args)
	if err != nil {
		return nil, err
	}
	if len(pos) != n {
		return nil, usagef("%s: expected %s", name, names)
	}
	return pos, nil
}

func cmdGet(ctx context.Context, g *globals, args []string, e *env) error {
	pos, err := positional("sandbox get", g, args, 1, "<id>")
	if err != nil {
		return err
	}
	c, err := g.client()
	if err != nil {
		return err
	}
	info, err := c.GetSandbox(ctx, pos[0])
	if err != nil {
		return err
	}
	info.EnvdAccessToken = "" // a secret: never printed
	return printJSON(e.stdout, info)
}

func cmdKill(ctx context.Context, g *globals, args []string, e *env) error {
	pos, err := positional("sandbox kill", g, args, 1, "<id>")
	if err != nil {
		return err
	}
	c, err := g.client()
	if err != nil {
		return err
	}
	return c.KillSandbox(ctx, pos[0])
}

func cmdTimeout(ctx context.Context, g *globals, args []string, e *env) error {
	pos, err := positional("sandbox timeout", g, args, 2, "<id> <seconds>")
	if err != nil {
		return err
	}
	secs, err := strconv.Atoi(pos[1])
	if err != nil || secs <= 0 {
		return usagef("sandbox timeout: seconds must be a positive integer")
	}
	c, err := g.client()
	if err != nil {
		return err
	}
	return c.SetTimeout(ctx, pos[0], time.Duration(secs)*time.Second)
}

// open returns a data-plane handle, reading the access token from the
// control plane.
func open(ctx context.Context, g *globals, id string) (*sdk.Sandbox, error) {
	c, err := g.client()
	if err != nil {
		return nil, err
	}
	return c.OpenSandbox(ctx, id)
}

func cmdExec(ctx context.Context, g *globals, args []string, e *env) error {
	fs := newFlagSet("exec")
	g.register(fs)
	user := fs.String("user", "", "run as this sandbox user")
	cwd := fs.String("cwd", "", "working directory")
	envs := kvFlag{}
	fs.Var(envs, "env", "environment variable key=value (repeatable)")
	pos, rest, dashdash, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) == 0 {
		return usagef("exec: expected <id> -- cmd [args...]")
	}
	argv := rest
	if !dashdash {
		argv = pos[1:]
	} else if len(pos) > 1 {
		return usagef("exec: unexpected argument %q before --", pos[1])
	}
	if len(argv) == 0 {
		return usagef("exec: missing command")
	}
	sbx, err := open(ctx, g, pos[0])
	if err != nil {
		return err
	}
	o := sdk.RunOptions{User: *user, Cwd: *cwd, Stdout: e.stdout, Stderr: e.stderr}
	if len(envs) > 0 {
		o.Envs = envs
	}
	code, err := sbx.Exec(ctx, argv, o)
	var pe *sdk.ProcessError
	switch {
	case errors.As(err, &pe):
		fmt.Fprintf(e.stderr, "space: %v\n", pe)
		return exitCode(ExitAbnormal)
	case err != nil:
		return err
	case code != 0:
		if code < 0 || code > 255 {
			return exitCode(ExitAbnormal)
		}
		return exitCode(code)
	}
	return nil
}

func cmdFS(ctx context.Context, g *globals, sub string, args []string, e *env) error {
	n, names := 2, "<id> <path>"
	if sub == "put" {
		n, names = 3, "<id> <local> <remote>"
	} else if sub == "get" {
		n, names = 3, "<id> <remote> <local>"
	}
	fs := newFlagSet("fs " + sub)
	g.register(fs)
	user := fs.String("user", "", "act as this sandbox user")
	pos, _, _, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != n {
		return usagef("fs %s: expected %s", sub, names)
	}
	sbx, err := open(ctx, g, pos[0])
	if err != nil {
		return err
	}
	fo := sdk.FileOptions{User: *user}
	switch sub {
	case "ls":
		entries, err := sbx.ListDir(ctx, pos[1], fo)
		if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		for _, en := range entries {
			name := en.Name
			if en.Type == "dir" {
				name += "/"
			}
			if en.SymlinkTarget != "" {
				name += " -> " + en.SymlinkTarget
			}
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\n", orDash(en.Permissions), en.Size, fmtTime(en.ModTime), name)
		}
		return tw.Flush()
	case "cat":
		_, err := sbx.ReadFileTo(ctx, pos[1], e.stdout, fo)
		return err
	case "put":
		f, err := os.Open(pos[1])
		if err != nil {
			return err
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil {
			return err
		}
		if st.IsDir() {
			return usagef("fs put: %s is a directory", pos[1])
		}
		if st.Size() <= 16<<20 {
			data, err := io.ReadAll(f)
			if err != nil {
				return err
			}
			_, err = sbx.WriteFile(ctx, pos[2], data, fo)
			return err
		}
		_, err = sbx.WriteFileFrom(ctx, pos[2], f, fo)
		return err
	case "get":
		return getFile(ctx, sbx, pos[1], pos[2], fo)
	}
	return nil
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// getFile downloads into a temporary file next to local and renames it into
// place, so a failed download never leaves a truncated file.
func getFile(ctx context.Context, sbx *sdk.Sandbox, remote, local string, fo sdk.FileOptions) error {
	dir, base := ".", local
	if i := strings.LastIndexByte(local, '/'); i >= 0 {
		dir, base = local[:i+1], local[i+1:]
	}
	if base == "" {
		return usagef("fs get: %q names a directory", local)
	}
	tmp, err := os.CreateTemp(dir, "."+base+".space-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := sbx.ReadFileTo(ctx, remote, tmp, fo); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), local)
}
