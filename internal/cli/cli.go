// Package cli implements the `space` command line. It drives SPACE through
// the Go SDK exactly as a customer would. Commands are cobra commands (per
// command help, shell completion); every command that prints data takes
// --json, whose field names are the SDK's JSON names and stay stable.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/spacesbx/space/internal/up"
	"github.com/spacesbx/space/sdk"
)

// Exit codes (docs/CLI.md). exec exits with the remote process's code.
const (
	ExitOK    = 0
	ExitError = 1
	ExitUsage = 2
	// ExitInterrupted is the exit after Ctrl-C or SIGTERM (128+SIGINT,
	// as shells report it).
	ExitInterrupted = 130
	// ExitAbnormal is returned by exec when the command did not exit
	// normally (killed by a signal, stream cut).
	ExitAbnormal = 255
)

// Defaults for a local `space up`.
const (
	DefaultAPIURL     = "http://127.0.0.1:3000"
	DefaultSandboxURL = "http://127.0.0.1:3001"
)

// Version is the build's version, set by the Makefile
// (-ldflags "-X github.com/spacesbx/space/internal/cli.Version=..."); when
// empty, the module's VCS revision, if the build recorded one.
var Version string

// version returns the version `space --version` prints.
func version() string {
	if Version != "" {
		return Version
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	rev, dirty := "", false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if rev != "" {
		if len(rev) > 12 {
			rev = rev[:12]
		}
		if dirty {
			rev += "-dirty"
		}
		return rev
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	return "devel"
}

// env is what a command may touch besides its arguments; tests replace it.
type env struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	getenv         func(string) string
	// term is the local terminal for `space term` (nil: not a terminal).
	term terminal
	// stderrTTY says stderr is a terminal: progress is drawn there.
	stderrTTY bool
}

// Main runs the CLI with args (without the program name) and returns the
// process exit code.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return run(ctx, args, &env{stdin: os.Stdin, stdout: stdout, stderr: stderr, getenv: os.Getenv,
		term: stdinTerminal(), stderrTTY: isTerminal(os.Stderr)})
}

func run(ctx context.Context, args []string, e *env) int {
	g := &globals{e: e}
	root := newRoot(g)
	root.SetArgs(args)
	_, err := root.ExecuteContextC(ctx)
	return exit(err, g, e.stderr)
}

// exit reports err once on w and returns the exit code for it.
func exit(err error, g *globals, w io.Writer) int {
	var ec exitCode
	switch {
	case err == nil:
		return ExitOK
	case errors.As(err, &ec):
		return int(ec)
	}
	ue := asUsage(err, g.ran)
	if ue != nil {
		fmt.Fprintf(w, "space: %s\n", ue.msg)
		if ue.cmd != "" {
			fmt.Fprintf(w, "Run '%s --help' for usage.\n", ue.cmd)
		}
		return ExitUsage
	}
	fmt.Fprintf(w, "space: %s\n", describe(err, g))
	if errors.Is(err, context.Canceled) {
		return ExitInterrupted
	}
	return ExitError
}

// usageError is a command-line mistake (exit 2).
type usageError struct {
	msg string
	// cmd is the command path whose help to point at.
	cmd string
}

func (e *usageError) Error() string { return e.msg }

func usagef(format string, a ...any) error { return &usageError{msg: fmt.Sprintf(format, a...)} }

// asUsage returns err as a usage error: one of ours, or any error cobra
// returned before a command ran (unknown command or flag, bad flag value,
// wrong argument count).
func asUsage(err error, ran bool) *usageError {
	var ue *usageError
	if errors.As(err, &ue) {
		return ue
	}
	if !ran {
		return &usageError{msg: err.Error(), cmd: "space"}
	}
	return nil
}

// exitCode is a command's requested exit status (exec, up).
type exitCode int

func (e exitCode) Error() string { return "exit " + strconv.Itoa(int(e)) }

// globals are the connection flags and what every command shares.
type globals struct {
	e                          *env
	apiURL, sandboxURL, apiKey string
	// accessToken (a user's sk_e2b_ token) and teamID authenticate
	// instead of an API key: Authorization: Bearer, X-Team-ID.
	accessToken, teamID string
	// ran is set once a command's own code runs: errors before it are
	// cobra's parse errors (usage).
	ran bool
}

func firstEnv(getenv func(string) string, names ...string) string {
	for _, n := range names {
		if v := getenv(n); v != "" {
			return v
		}
	}
	return ""
}

// resolve fills the connection settings flags left empty from the
// environment, then the defaults. Flags are not defaulted from the
// environment at definition time so that help never prints a key.
func (g *globals) resolve() {
	if g.apiURL == "" {
		g.apiURL = firstEnv(g.e.getenv, "SPACE_API_URL", "E2B_API_URL")
	}
	if g.apiURL == "" {
		g.apiURL = DefaultAPIURL
	}
	if g.sandboxURL == "" {
		g.sandboxURL = firstEnv(g.e.getenv, "SPACE_SANDBOX_URL", "E2B_SANDBOX_URL")
	}
	if g.sandboxURL == "" {
		g.sandboxURL = DefaultSandboxURL
	}
	// A flag beats the environment; at the same level the API key wins.
	if g.apiKey == "" && g.accessToken == "" {
		g.apiKey = firstEnv(g.e.getenv, "SPACE_API_KEY", "E2B_API_KEY")
	}
	if g.apiKey == "" && g.accessToken == "" {
		g.accessToken = firstEnv(g.e.getenv, "SPACE_ACCESS_TOKEN", "E2B_ACCESS_TOKEN")
	}
	if g.teamID == "" {
		g.teamID = firstEnv(g.e.getenv, "SPACE_TEAM_ID", "E2B_TEAM_ID")
	}
}

func (g *globals) client() (*sdk.Client, error) {
	cfg := sdk.Config{APIURL: g.apiURL, SandboxURL: g.sandboxURL, APIKey: g.apiKey}
	if g.apiKey == "" && g.accessToken != "" {
		u, err := url.Parse(g.apiURL)
		if err != nil {
			return nil, usagef("--api-url %q is not a URL", g.apiURL)
		}
		cfg.HTTPClient = &http.Client{Transport: &tokenTransport{base: http.DefaultTransport, host: u.Host, token: g.accessToken, team: g.teamID}}
	}
	c, err := sdk.New(cfg)
	if err != nil {
		return nil, usagef("%s", strings.TrimPrefix(err.Error(), "sdk: "))
	}
	return c, nil
}

// tokenTransport authenticates control-plane requests with a user's
// access token. Only requests to the control plane's host carry it, and
// never in place of an Authorization header already set: the edge's
// requests go to sandboxes, and their Authorization header names the
// sandbox user.
type tokenTransport struct {
	base        http.RoundTripper
	host        string
	token, team string
}

func (t *tokenTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Host != t.host || r.Header.Get("Authorization") != "" {
		return t.base.RoundTrip(r)
	}
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+t.token)
	if t.team != "" {
		r.Header.Set("X-Team-ID", t.team)
	}
	return t.base.RoundTrip(r)
}

// open returns a data-plane handle, reading the access token from the
// control plane.
func (g *globals) open(ctx context.Context, id string) (*sdk.Sandbox, error) {
	c, err := g.client()
	if err != nil {
		return nil, err
	}
	sbx, err := c.OpenSandbox(ctx, id)
	return sbx, onSandbox(id, err)
}

const rootLong = `space drives SPACE sandboxes from the command line: create, list, pause,
resume, snapshot, fork and migrate sandboxes, run commands and terminals in
them, move files, read their logs and metrics, build templates, and run a
single-machine SPACE (space up).

Connection settings come from flags, else the environment:
  --api-url      SPACE_API_URL, E2B_API_URL          (default ` + DefaultAPIURL + `)
  --sandbox-url  SPACE_SANDBOX_URL, E2B_SANDBOX_URL  (default ` + DefaultSandboxURL + `)
  --api-key      SPACE_API_KEY, E2B_API_KEY
  or a user's --access-token (SPACE_ACCESS_TOKEN, E2B_ACCESS_TOKEN) with
  --team (SPACE_TEAM_ID, E2B_TEAM_ID)

Exit codes: 0 success, 1 error, 2 usage, 130 interrupted; exec exits with the
remote command's code (255 when it did not exit normally).`

func newRoot(g *globals) *cobra.Command {
	root := &cobra.Command{
		Use:           "space",
		Short:         "SPACE sandboxes from the command line",
		Long:          rootLong,
		Version:       version(),
		SilenceErrors: true,
		SilenceUsage:  true,
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
			g.ran = true
			g.resolve()
			return nil
		},
	}
	root.SetVersionTemplate("space version {{.Version}}\n")
	root.SetIn(g.e.stdin)
	root.SetOut(g.e.stdout)
	root.SetErr(g.e.stderr)
	pf := root.PersistentFlags()
	pf.StringVar(&g.apiURL, "api-url", "", "control plane URL (env SPACE_API_URL, E2B_API_URL)")
	pf.StringVar(&g.sandboxURL, "sandbox-url", "", "edge URL (env SPACE_SANDBOX_URL, E2B_SANDBOX_URL)")
	pf.StringVar(&g.apiKey, "api-key", "", "API key (env SPACE_API_KEY, E2B_API_KEY)")
	pf.StringVar(&g.accessToken, "access-token", "", "a user's access token, instead of an API key (env SPACE_ACCESS_TOKEN, E2B_ACCESS_TOKEN)")
	pf.StringVar(&g.teamID, "team", "", "with --access-token: the team to act for (default the user's; env SPACE_TEAM_ID, E2B_TEAM_ID)")
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return &usageError{msg: err.Error(), cmd: c.CommandPath()}
	})
	root.AddGroup(&cobra.Group{ID: "sandbox", Title: "Sandboxes:"}, &cobra.Group{ID: "platform", Title: "Platform:"})
	for _, c := range []*cobra.Command{sandboxCmd(g), execCmd(g), termCmd(g), fsCmd(g)} {
		c.GroupID = "sandbox"
		root.AddCommand(c)
	}
	for _, c := range []*cobra.Command{templateCmd(g), upCmd(g), versionCmd(g)} {
		c.GroupID = "platform"
		root.AddCommand(c)
	}
	root.SetHelpCommandGroupID("platform")
	root.SetCompletionCommandGroupID("platform")
	completeIDs(root, g)
	return root
}

// completeIDs makes the shell complete the sandbox ID of every command
// whose first argument is one, from the caller's sandbox list.
func completeIDs(c *cobra.Command, g *globals) {
	if f := strings.Fields(c.Use); len(f) > 1 && strings.HasPrefix(f[1], "ID") {
		multi := strings.HasPrefix(f[1], "ID...")
		c.ValidArgsFunction = func(cmd *cobra.Command, a []string, _ string) ([]cobra.Completion, cobra.ShellCompDirective) {
			if len(a) > 0 && !multi {
				return nil, cobra.ShellCompDirectiveDefault
			}
			g.resolve() // completion runs no PersistentPreRun
			cl, err := g.client()
			if err != nil {
				return nil, cobra.ShellCompDirectiveNoFileComp
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 3*time.Second)
			defer cancel()
			list, err := cl.ListSandboxes(ctx)
			if err != nil {
				return nil, cobra.ShellCompDirectiveNoFileComp
			}
			out := make([]cobra.Completion, 0, len(list))
			for _, s := range list {
				out = append(out, cobra.CompletionWithDesc(s.SandboxID, s.TemplateID+" "+s.State))
			}
			return out, cobra.ShellCompDirectiveNoFileComp
		}
	}
	for _, s := range c.Commands() {
		completeIDs(s, g)
	}
}

// args checks a command's positional arguments, naming them on error.
func args(n int, names string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, a []string) error {
		if len(a) != n {
			return &usageError{msg: fmt.Sprintf("%s: expected %s, got %d argument(s)", cmdName(cmd), names, len(a)), cmd: cmd.CommandPath()}
		}
		return nil
	}
}

// cmdName is cmd's path without the program name ("sandbox get").
func cmdName(cmd *cobra.Command) string {
	return strings.TrimPrefix(cmd.CommandPath(), cmd.Root().Name()+" ")
}

// jsonFlag adds --json to cmd.
func jsonFlag(cmd *cobra.Command, v *bool) {
	cmd.Flags().BoolVar(v, "json", false, "print JSON (stable field names)")
}

// kvFlag collects repeated k=v flags.
type kvFlag map[string]string

var _ pflag.Value = kvFlag{}

func (m kvFlag) String() string { return "" }
func (m kvFlag) Type() string   { return "key=value" }

func (m kvFlag) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" {
		return fmt.Errorf("%q is not key=value", s)
	}
	m[k] = v
	return nil
}

func upCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:                "up [--workers N] [--api-key K] [--data-dir D] ...",
		Short:              "Run a single-machine SPACE (etcd, control plane, workers, edge)",
		Long:               "Run a single-machine SPACE (etcd, control plane, workers, edge).\nRun 'space up -h' for its flags.",
		DisableFlagParsing: true,
		RunE: func(cmd *cobra.Command, a []string) error {
			if code := up.Run(cmd.Context(), a, g.e.getenv, g.e.stdout, g.e.stderr); code != 0 {
				return exitCode(code)
			}
			return nil
		},
	}
}

func versionCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print the version of space",
		Args:  args(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			v := struct {
				Version string `json:"version"`
				Go      string `json:"go"`
				OS      string `json:"os"`
				Arch    string `json:"arch"`
			}{version(), runtime.Version(), runtime.GOOS, runtime.GOARCH}
			if asJSON {
				return printJSON(g.e.stdout, v)
			}
			_, err := fmt.Fprintf(g.e.stdout, "space version %s (%s %s/%s)\n", v.Version, v.Go, v.OS, v.Arch)
			return err
		},
	}
	jsonFlag(cmd, &asJSON)
	return cmd
}

// groupRun makes a command that only holds subcommands print its help when
// called alone and reject an unknown subcommand (cobra would print the
// help and succeed).
func groupRun(cmd *cobra.Command, a []string) error {
	if len(a) > 0 {
		return &usageError{msg: fmt.Sprintf("unknown command %q for %q", a[0], cmd.CommandPath()), cmd: cmd.CommandPath()}
	}
	return cmd.Help()
}
