package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacesbx/space/sdk"
)

// Interrupting exec: the remote process gets SIGTERM and termGrace to
// end, then SIGKILL and killGrace.
const (
	termGrace = 3 * time.Second
	killGrace = 2 * time.Second
)

// stdinChunk is the most stdin one SendInput carries.
const stdinChunk = 32 << 10

func execCmd(g *globals) *cobra.Command {
	var (
		user, cwd string
		envs      = kvFlag{}
		noStdin   bool
	)
	cmd := &cobra.Command{
		Use:   "exec ID [flags] -- CMD [ARGS...]",
		Short: "Run a command in a sandbox, streaming stdin, stdout and stderr",
		Long: `Run a command in a sandbox (no shell: use -- sh -c '...' for one). Local
stdin is streamed to the command; its stdout and stderr stream back and space
exits with its exit code. Ctrl-C or SIGTERM sends SIGTERM to the remote
command, then SIGKILL if it is still running after a few seconds.`,
		Example: `  space exec $ID -- ls -la /home/user
  echo hi | space exec $ID -- cat
  space exec $ID --user root --cwd /tmp --env K=V -- sh -c 'id; pwd; echo $K'`,
		Args: func(cmd *cobra.Command, a []string) error {
			dash := cmd.ArgsLenAtDash()
			switch {
			case len(a) == 0:
				return &usageError{msg: "exec: expected ID -- CMD [ARGS...]", cmd: cmd.CommandPath()}
			case dash == 0:
				return &usageError{msg: "exec: expected ID before --", cmd: cmd.CommandPath()}
			case dash > 1:
				return &usageError{msg: fmt.Sprintf("exec: unexpected argument %q before --", a[1]), cmd: cmd.CommandPath()}
			case len(a) < 2:
				return &usageError{msg: "exec: missing command", cmd: cmd.CommandPath()}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, a []string) error {
			sbx, err := g.open(cmd.Context(), a[0])
			if err != nil {
				return err
			}
			o := sdk.StartOptions{RunOptions: sdk.RunOptions{User: user, Cwd: cwd, Stdout: g.e.stdout, Stderr: g.e.stderr}, Stdin: !noStdin}
			if len(envs) > 0 {
				o.Envs = envs
			}
			var in io.Reader
			if !noStdin {
				in = g.e.stdin
			}
			return execute(cmd.Context(), g, sbx, a[1:], o, in)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&user, "user", "u", "", "run as this sandbox user")
	f.StringVar(&cwd, "cwd", "", "working directory")
	f.Var(envs, "env", "environment variable key=value (repeatable)")
	f.BoolVar(&noStdin, "no-stdin", false, "do not stream local stdin (the command's stdin is empty)")
	return cmd
}

// execute runs argv in sbx and returns the exit code to exit with. in
// (nil: none) is streamed to the process's stdin.
func execute(ctx context.Context, g *globals, sbx *sdk.Sandbox, argv []string, o sdk.StartOptions, in io.Reader) error {
	p, err := sbx.Start(ctx, argv, o)
	if err != nil {
		return onSandbox(sbx.ID, err)
	}
	defer p.Close()
	if in != nil {
		// The pump's owner is the process: it stops at the end of local
		// input or once the process has ended. A pump blocked reading a
		// terminal that never ends is left behind at exit (a read cannot be
		// interrupted); every other pump is waited for.
		pumped := make(chan struct{})
		go func() {
			defer close(pumped)
			pump(p, in)
		}()
		defer func() {
			select {
			case <-pumped:
			case <-time.After(100 * time.Millisecond):
			}
		}()
	}
	select {
	case <-p.Done():
	case <-ctx.Done():
		// Ctrl-C or SIGTERM: end the remote process too, so that
		// interrupting `space exec ... sleep 60` leaves nothing behind.
		stopRemote(p)
		_, _ = p.Wait()
		fmt.Fprintf(g.e.stderr, "space: interrupted; the remote command was stopped\n")
		return exitCode(ExitInterrupted)
	}
	code, err := p.Wait()
	var pe *sdk.ProcessError
	switch {
	case errors.As(err, &pe):
		fmt.Fprintf(g.e.stderr, "space: %v\n", pe)
		return exitCode(ExitAbnormal)
	case err != nil:
		return onSandbox(sbx.ID, err)
	case code < 0 || code > 255:
		return exitCode(ExitAbnormal)
	case code != 0:
		return exitCode(code)
	}
	return nil
}

// pump streams in to the process's stdin and closes it at end of input.
func pump(p *sdk.Process, in io.Reader) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-p.Done():
			cancel()
		case <-ctx.Done():
		}
	}()
	buf := make([]byte, stdinChunk)
	for {
		n, err := in.Read(buf)
		if n > 0 {
			if p.SendStdin(ctx, buf[:n]) != nil {
				return // the process ended or closed its input
			}
		}
		if err != nil {
			break
		}
	}
	_ = p.CloseStdin(ctx)
}

// stopRemote sends SIGTERM, then SIGKILL, waiting a grace period after
// each for the process to end.
func stopRemote(p *sdk.Process) {
	for _, s := range []struct {
		sig   sdk.Signal
		grace time.Duration
	}{{sdk.SIGTERM, termGrace}, {sdk.SIGKILL, killGrace}} {
		ctx, cancel := context.WithTimeout(context.Background(), s.grace)
		err := p.Signal(ctx, s.sig)
		if err == nil {
			select {
			case <-p.Done():
				cancel()
				return
			case <-ctx.Done():
			}
		}
		cancel()
		select {
		case <-p.Done():
			return
		default:
		}
	}
}
