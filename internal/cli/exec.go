package cli

import (
	"context"
	"errors"
	"fmt"

	"github.com/spacesbx/space/sdk"
)

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
