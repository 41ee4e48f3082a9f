package cli

// Lifecycle commands: connect, pause, resume, snapshot, fork, migrate.

import (
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/sdk"
)

// timeoutFlag adds --timeout (seconds) to cmd.
func timeoutFlag(cmd *cobra.Command, v *int, what string) {
	cmd.Flags().IntVar(v, "timeout", 0, what+" in seconds (0: the server's default)")
}

func checkTimeout(cmd *cobra.Command, secs int) (time.Duration, error) {
	if secs < 0 {
		return 0, &usageError{msg: cmdName(cmd) + ": --timeout must not be negative", cmd: cmd.CommandPath()}
	}
	return time.Duration(secs) * time.Second, nil
}

func connectCmd(g *globals) *cobra.Command {
	var (
		timeout  int
		noAttach bool
		asJSON   bool
		to       termOptions
	)
	cmd := &cobra.Command{
		Use:   "connect ID",
		Short: "Resume a sandbox if paused, then open a terminal in it",
		Long: `Connect to a sandbox: a paused sandbox is resumed, a running one has its
timeout extended, then a terminal opens in it (as space term). With
--no-attach the sandbox's details are printed instead.`,
		Args: args(1, "ID"),
		RunE: func(cmd *cobra.Command, a []string) error {
			d, err := checkTimeout(cmd, timeout)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			type res struct {
				sbx     *sdk.Sandbox
				resumed bool
			}
			r, err := spin(g, asJSON, "connecting to "+a[0], func() (res, error) {
				s, resumed, err := c.ConnectSandbox(cmd.Context(), a[0], d)
				return res{s, resumed}, err
			})
			if err != nil {
				return onSandbox(a[0], err)
			}
			if r.resumed && !asJSON {
				fmt.Fprintf(g.e.stderr, "space: resumed sandbox %s\n", a[0])
			}
			if !noAttach && !asJSON {
				return attach(cmd.Context(), g, r.sbx, to)
			}
			info, err := c.GetSandbox(cmd.Context(), a[0])
			if err != nil {
				return onSandbox(a[0], err)
			}
			info.EnvdAccessToken = ""
			if asJSON {
				return printJSON(g.e.stdout, info)
			}
			return printInfo(g.e.stdout, info)
		},
	}
	timeoutFlag(cmd, &timeout, "new time to live")
	cmd.Flags().BoolVar(&noAttach, "no-attach", false, "print the sandbox's details instead of opening a terminal")
	to.register(cmd)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the sandbox's details as JSON (implies --no-attach)")
	return cmd
}

func pauseCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "pause ID",
		Short: "Pause a running sandbox (its processes and files are kept)",
		Args:  args(1, "ID"),
		RunE: func(cmd *cobra.Command, a []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			_, err = spin(g, false, "pausing "+a[0], func() (struct{}, error) {
				return struct{}{}, c.PauseSandbox(cmd.Context(), a[0])
			})
			return onSandbox(a[0], err)
		},
	}
}

func resumeCmd(g *globals) *cobra.Command {
	var (
		timeout int
		asJSON  bool
	)
	cmd := &cobra.Command{
		Use:   "resume ID",
		Short: "Resume a paused sandbox",
		Args:  args(1, "ID"),
		RunE: func(cmd *cobra.Command, a []string) error {
			d, err := checkTimeout(cmd, timeout)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			if _, err := spin(g, asJSON, "resuming "+a[0], func() (*sdk.Sandbox, error) {
				return c.ResumeSandbox(cmd.Context(), a[0], d)
			}); err != nil {
				return onSandbox(a[0], err)
			}
			if !asJSON {
				return nil
			}
			info, err := c.GetSandbox(cmd.Context(), a[0])
			if err != nil {
				return onSandbox(a[0], err)
			}
			info.EnvdAccessToken = ""
			return printJSON(g.e.stdout, info)
		},
	}
	timeoutFlag(cmd, &timeout, "time to live after the resume")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the resumed sandbox's details as JSON")
	return cmd
}

func snapshotCmd(g *globals) *cobra.Command {
	var (
		name   string
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "snapshot ID",
		Short: "Snapshot a sandbox into a persistent snapshot (a template new sandboxes start from)",
		Args:  args(1, "ID"),
		RunE: func(cmd *cobra.Command, a []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			snap, err := spin(g, asJSON, "snapshotting "+a[0], func() (*sdk.SnapshotInfo, error) {
				return c.CreateSnapshot(cmd.Context(), a[0], name)
			})
			if err != nil {
				return onSandbox(a[0], err)
			}
			if snap.Names == nil {
				snap.Names = []string{}
			}
			if asJSON {
				return printJSON(g.e.stdout, snap)
			}
			_, err = fmt.Fprintln(g.e.stdout, snap.SnapshotID)
			return err
		},
	}
	cmd.Flags().StringVar(&name, "name", "", "name the snapshot (usable as a template name)")
	jsonFlag(cmd, &asJSON)
	return cmd
}

func forkCmd(g *globals) *cobra.Command {
	var (
		count, timeout int
		asJSON         bool
	)
	cmd := &cobra.Command{
		Use:   "fork ID",
		Short: "Create sandboxes from a sandbox's current state and print their ids",
		Args:  args(1, "ID"),
		RunE: func(cmd *cobra.Command, a []string) error {
			d, err := checkTimeout(cmd, timeout)
			if err != nil {
				return err
			}
			if count < 1 {
				return &usageError{msg: "sandbox fork: --count must be at least 1", cmd: cmd.CommandPath()}
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			res, err := spin(g, asJSON, "forking "+a[0], func() ([]sdk.ForkResult, error) {
				return c.ForkSandbox(cmd.Context(), a[0], count, d)
			})
			if err != nil {
				return onSandbox(a[0], err)
			}
			if asJSON {
				if res == nil {
					res = []sdk.ForkResult{}
				}
				return printJSON(g.e.stdout, res)
			}
			failed := 0
			for _, r := range res {
				switch {
				case r.Sandbox != nil:
					fmt.Fprintln(g.e.stdout, r.Sandbox.SandboxID)
				case r.Error != nil:
					failed++
					fmt.Fprintf(g.e.stderr, "space: a fork of %s failed: %s\n", a[0], stripClasses(r.Error.Message))
				}
			}
			if failed > 0 {
				return exitCode(ExitError)
			}
			return nil
		},
	}
	cmd.Flags().IntVar(&count, "count", 1, "how many sandboxes to create")
	timeoutFlag(cmd, &timeout, "the forks' time to live")
	jsonFlag(cmd, &asJSON)
	return cmd
}

func migrateCmd(g *globals) *cobra.Command {
	var (
		target string
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "migrate ID",
		Short: "Move a sandbox to another worker",
		Args:  args(1, "ID"),
		RunE: func(cmd *cobra.Command, a []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			m, err := spin(g, asJSON, "migrating "+a[0], func() (*spacev1.MigrateResponse, error) {
				return c.MigrateSandbox(cmd.Context(), a[0], target)
			})
			if err != nil {
				return onSandbox(a[0], err)
			}
			if asJSON {
				return printJSON(g.e.stdout, m)
			}
			tw := tabwriter.NewWriter(g.e.stdout, 0, 4, 1, ' ', 0)
			fmt.Fprintf(tw, "Sandbox:\t%s\n", m.SandboxID)
			fmt.Fprintf(tw, "From:\t%s\n", m.From.WorkerID)
			fmt.Fprintf(tw, "To:\t%s (generation %d)\n", m.Route.WorkerID, m.Route.Generation)
			fmt.Fprintf(tw, "Processes:\t%s\n", map[bool]string{true: "restarted", false: "kept"}[m.ProcessesRestarted])
			fmt.Fprintf(tw, "Files:\t%s\n", map[bool]string{true: "kept", false: "lost"}[m.FilesKept])
			if n := strings.TrimSpace(m.Note); n != "" {
				fmt.Fprintf(tw, "Note:\t%s\n", n)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVar(&target, "to", "", "target worker (default: the scheduler picks one)")
	jsonFlag(cmd, &asJSON)
	return cmd
}
