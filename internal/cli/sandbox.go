package cli

// Sandbox commands: create, list, get, kill, timeout.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spacesbx/space/sdk"
)

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
