package cli

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/spacesbx/space/sdk"
)

// terminal is the local terminal `space term` attaches to.
type terminal interface {
	// Size returns the terminal's rows and columns.
	Size() (rows, cols uint32, err error)
	// MakeRaw puts the terminal in raw mode and returns a restore func.
	MakeRaw() (restore func(), err error)
	// Resized delivers a value whenever the terminal size changes, until
	// stop is called.
	Resized() (ch <-chan struct{}, stop func())
}

// termOptions are the flags of a terminal session.
type termOptions struct{ user, cwd string }

func (o *termOptions) register(cmd *cobra.Command) {
	cmd.Flags().StringVarP(&o.user, "user", "u", "", "run the shell as this sandbox user")
	cmd.Flags().StringVar(&o.cwd, "cwd", "", "working directory")
}

func termCmd(g *globals) *cobra.Command {
	var o termOptions
	cmd := &cobra.Command{
		Use:     "term ID",
		Aliases: []string{"terminal"},
		Short:   "Open an interactive terminal (a login shell) in a sandbox",
		Long: `Open an interactive terminal in a sandbox. The local terminal is put in raw
mode: Ctrl-C, Ctrl-D and window size changes go to the remote terminal.
The shell's exit code is space's.`,
		Args: args(1, "ID"),
		RunE: func(cmd *cobra.Command, a []string) error {
			sbx, err := g.open(cmd.Context(), a[0])
			if err != nil {
				return err
			}
			return attach(cmd.Context(), g, sbx, o)
		},
	}
	o.register(cmd)
	return cmd
}

// attach runs a terminal session in sbx on the local terminal.
func attach(ctx context.Context, g *globals, sbx *sdk.Sandbox, o termOptions) error {
	e := g.e
	rows, cols := uint32(24), uint32(80)
	if e.term != nil {
		if r, c, err := e.term.Size(); err == nil && r > 0 && c > 0 {
			rows, cols = r, c
		}
	}
	p, err := sbx.PTY(ctx, rows, cols, sdk.PTYOptions{User: o.user, Cwd: o.cwd})
	if err != nil {
		return onSandbox(sbx.ID, err)
	}
	defer p.Close()
	if e.term != nil {
		restore, err := e.term.MakeRaw()
		if err != nil {
			return fmt.Errorf("terminal raw mode: %w", err)
		}
		defer restore()
		ch, stop := e.term.Resized()
		defer stop()
		go func() {
			for {
				select {
				case <-p.Done():
					return
				case _, ok := <-ch:
					if !ok {
						return
					}
					if r, c, err := e.term.Size(); err == nil && r > 0 && c > 0 {
						_ = p.Resize(ctx, r, c)
					}
				}
			}
		}()
	}
	go func() {
		_, err := io.Copy(p, e.stdin)
		if err == nil {
			// Local input ended: send end-of-transmission so the shell exits.
			_, _ = p.Write([]byte{4})
		}
	}()
	_, copyErr := io.Copy(e.stdout, p)
	code, err := p.Wait()
	var pe *sdk.ProcessError
	switch {
	case errors.As(err, &pe):
		return exitCode(ExitAbnormal)
	case err != nil:
		return onSandbox(sbx.ID, err)
	case copyErr != nil:
		return copyErr
	case code != 0:
		return exitCode(code & 0xff)
	}
	return nil
}
