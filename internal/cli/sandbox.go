package cli

// Sandbox commands: create, list, get, kill, timeout (lifecycle.go has
// connect, pause, resume, snapshot, fork and migrate; observe.go logs and
// metrics).

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacesbx/space/sdk"
)

func sandboxCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:     "sandbox",
		Aliases: []string{"sbx"},
		Short:   "Create, list, pause, resume, snapshot, fork, migrate and kill sandboxes",
		RunE:    groupRun,
	}
	cmd.AddCommand(createCmd(g), listCmd(g), getCmd(g), killCmd(g), timeoutCmd(g),
		connectCmd(g), pauseCmd(g), resumeCmd(g), snapshotCmd(g), forkCmd(g), migrateCmd(g),
		logsCmd(g), metricsCmd(g))
	return cmd
}

// created is what create prints with --json.
type created struct {
	SandboxID  string `json:"sandboxID"`
	TemplateID string `json:"templateID"`
}

func createCmd(g *globals) *cobra.Command {
	var (
		template string
		timeout  int
		secure   bool
		asJSON   bool
		md, envs = kvFlag{}, kvFlag{}
	)
	cmd := &cobra.Command{
		Use:   "create [TEMPLATE]",
		Short: "Create a sandbox and print its id",
		Example: `  space sandbox create
  space sandbox create code-interpreter-v1
  space sandbox create --template base --timeout 600 --metadata owner=me --env FOO=bar`,
		Args: func(cmd *cobra.Command, a []string) error {
			if len(a) > 1 {
				return &usageError{msg: "sandbox create: expected at most one TEMPLATE", cmd: cmd.CommandPath()}
			}
			if len(a) == 1 && cmd.Flags().Changed("template") && a[0] != template {
				return &usageError{msg: "sandbox create: TEMPLATE and --template disagree", cmd: cmd.CommandPath()}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, a []string) error {
			if len(a) == 1 {
				template = a[0]
			}
			if timeout < 0 {
				return &usageError{msg: "sandbox create: --timeout must not be negative", cmd: cmd.CommandPath()}
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			o := sdk.CreateOptions{Template: template, Timeout: time.Duration(timeout) * time.Second, Secure: secure}
			if len(md) > 0 {
				o.Metadata = md
			}
			if len(envs) > 0 {
				o.EnvVars = envs
			}
			sbx, err := spin(g, asJSON, "creating a sandbox from "+template, func() (*sdk.Sandbox, error) {
				return c.CreateSandbox(cmd.Context(), o)
			})
			if err != nil {
				return templateError(template, err)
			}
			if asJSON {
				return printJSON(g.e.stdout, created{SandboxID: sbx.ID, TemplateID: template})
			}
			_, err = fmt.Fprintln(g.e.stdout, sbx.ID)
			return err
		},
	}
	f := cmd.Flags()
	f.StringVarP(&template, "template", "t", "base", "template id or alias")
	f.IntVar(&timeout, "timeout", 0, "lifetime in seconds (0: the server's default)")
	f.BoolVar(&secure, "secure", true, "require the sandbox access token for data-plane access")
	f.Var(md, "metadata", "metadata key=value (repeatable)")
	f.Var(envs, "env", "environment variable key=value (repeatable)")
	jsonFlag(cmd, &asJSON)
	return cmd
}

// templateError words a create failure for an unknown template.
func templateError(template string, err error) error {
	if err != nil && strings.Contains(err.Error(), "template") && isNotFound(err) {
		return &hintError{err, "build one with: space template build"}
	}
	return err
}

func listCmd(g *globals) *cobra.Command {
	var (
		asJSON bool
		f      listFilter
	)
	cmd := &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List sandboxes (running and paused)",
		Args:    args(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			list, err := c.ListSandboxes(cmd.Context())
			if err != nil {
				return err
			}
			list = f.apply(list)
			if asJSON {
				return printJSON(g.e.stdout, list)
			}
			tw := tabwriter.NewWriter(g.e.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "SANDBOX\tTEMPLATE\tSTATE\tSTARTED\tENDS\tMETADATA")
			for _, s := range list {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", s.SandboxID, s.TemplateID, orDash(s.State),
					fmtTime(s.StartedAt), fmtTime(s.EndAt), fmtMap(s.Metadata))
			}
			return tw.Flush()
		},
	}
	f.register(cmd)
	jsonFlag(cmd, &asJSON)
	return cmd
}

// listFilter selects sandboxes by state and metadata (e2b CLI's --state
// and --metadata).
type listFilter struct {
	states   []string
	metadata kvFlag
}

func (f *listFilter) register(cmd *cobra.Command) {
	f.metadata = kvFlag{}
	cmd.Flags().StringSliceVar(&f.states, "state", nil, "only sandboxes in these states (running, paused; comma-separated)")
	cmd.Flags().Var(f.metadata, "metadata", "only sandboxes with this metadata key=value (repeatable)")
}

func (f *listFilter) apply(list []sdk.SandboxInfo) []sdk.SandboxInfo {
	out := []sdk.SandboxInfo{}
	for _, s := range list {
		if len(f.states) > 0 && !slices.Contains(f.states, s.State) {
			continue
		}
		match := true
		for k, v := range f.metadata {
			match = match && s.Metadata[k] == v
		}
		if match {
			out = append(out, s)
		}
	}
	return out
}

func getCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:     "get ID",
		Aliases: []string{"info"},
		Short:   "Show a sandbox's details",
		Args:    args(1, "ID"),
		RunE: func(cmd *cobra.Command, a []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			info, err := c.GetSandbox(cmd.Context(), a[0])
			if err != nil {
				return onSandbox(a[0], err)
			}
			info.EnvdAccessToken = "" // a secret: never printed
			if asJSON {
				return printJSON(g.e.stdout, info)
			}
			return printInfo(g.e.stdout, info)
		},
	}
	jsonFlag(cmd, &asJSON)
	return cmd
}

// printInfo prints a sandbox's details as "key: value" lines.
func printInfo(w io.Writer, s *sdk.SandboxInfo) error {
	tw := tabwriter.NewWriter(w, 0, 4, 1, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "%s:\t%s\n", k, v) }
	row("Sandbox", s.SandboxID)
	row("Template", s.TemplateID+aliasOf(s.Alias))
	row("State", orDash(s.State))
	row("Started", fmtTime(s.StartedAt))
	row("Ends", fmtTime(s.EndAt))
	row("CPUs", strconv.Itoa(s.CPUCount))
	row("Memory", fmt.Sprintf("%d MiB", s.MemoryMB))
	row("Disk", fmt.Sprintf("%d MiB", s.DiskSizeMB))
	row("Metadata", fmtMap(s.Metadata))
	if s.EnvdVersion != "" {
		row("Envd", s.EnvdVersion)
	}
	if s.Domain != "" {
		row("Domain", s.Domain)
	}
	return tw.Flush()
}

func aliasOf(a string) string {
	if a == "" {
		return ""
	}
	return " (" + a + ")"
}

func killCmd(g *globals) *cobra.Command {
	var (
		all bool
		f   listFilter
	)
	cmd := &cobra.Command{
		Use:     "kill ID... | --all [--state S] [--metadata k=v]",
		Aliases: []string{"rm"},
		Short:   "Kill sandboxes",
		Args: func(cmd *cobra.Command, a []string) error {
			switch {
			case all && len(a) > 0:
				return &usageError{msg: cmdName(cmd) + ": IDs and --all exclude each other", cmd: cmd.CommandPath()}
			case !all && len(a) == 0:
				return &usageError{msg: cmdName(cmd) + ": expected at least one ID (or --all)", cmd: cmd.CommandPath()}
			case !all && (len(f.states) > 0 || len(f.metadata) > 0):
				return &usageError{msg: cmdName(cmd) + ": --state and --metadata select with --all only", cmd: cmd.CommandPath()}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, a []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			if all {
				list, err := c.ListSandboxes(cmd.Context())
				if err != nil {
					return err
				}
				for _, s := range f.apply(list) {
					a = append(a, s.SandboxID)
				}
			}
			for _, id := range a {
				err := c.KillSandbox(cmd.Context(), id)
				if all && isNotFound(err) {
					continue // ended since the list
				}
				if err != nil {
					return onSandbox(id, err)
				}
			}
			return nil
		},
	}
	cmd.Flags().BoolVarP(&all, "all", "a", false, "kill every sandbox (that --state and --metadata select)")
	f.register(cmd)
	return cmd
}

func timeoutCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "timeout ID SECONDS",
		Short: "Set a sandbox to end SECONDS from now",
		Args:  args(2, "ID SECONDS"),
		RunE: func(cmd *cobra.Command, a []string) error {
			secs, err := strconv.Atoi(a[1])
			if err != nil || secs <= 0 {
				return &usageError{msg: "sandbox timeout: SECONDS must be a positive integer", cmd: cmd.CommandPath()}
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			return onSandbox(a[0], c.SetTimeout(cmd.Context(), a[0], time.Duration(secs)*time.Second))
		},
	}
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

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
