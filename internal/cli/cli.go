// Package cli implements the `space` command line. It drives SPACE through
// the Go SDK exactly as a customer would.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"

	"github.com/spacesbx/space/internal/up"

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
  template build --name N[:tag] [--file Dockerfile] [--build-arg k=v]... [--tag t]...
                 [--ready-cmd cmd] [--no-cache] [context]
                 build a template from a Dockerfile (FROM a template or an image;
                 RUN, COPY, ADD, ENV, WORKDIR, USER, ARG; CMD/ENTRYPOINT start it)

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
	case "template", "tpl":
		if len(args) == 0 || args[0] != "build" {
			return usagef("template: missing or unknown subcommand (build)")
		}
		return cmdTemplateBuild(ctx, g, args[1:], e)
	case "up":
		if code := up.Run(ctx, args, e.getenv, e.stdout, e.stderr); code != 0 {
			return exitCode(code)
		}
		return nil
	}
	return usagef("unknown command %q", cmd)
}
