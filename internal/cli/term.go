package cli

import (
	"context"
	"errors"
	"fmt"
	"io"

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

func cmdTerm(ctx context.Context, g *globals, args []string, e *env) error {
	fs := newFlagSet("term")
	g.register(fs)
	user := fs.String("user", "", "run the shell as this sandbox user")
	cwd := fs.String("cwd", "", "working directory")
	pos, _, _, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef("term: expected <id>")
	}
	sbx, err := open(ctx, g, pos[0])
	if err != nil {
		return err
	}
	rows, cols := uint32(24), uint32(80)
	if e.term != nil {
		if r, c, err := e.term.Size(); err == nil && r > 0 && c > 0 {
			rows, cols = r, c
		}
	}
	p, err := sbx.PTY(ctx, rows, cols, sdk.PTYOptions{User: *user, Cwd: *cwd})
	if err != nil {
		return err
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
		return err
	case copyErr != nil:
		return copyErr
	case code != 0:
		return exitCode(code & 0xff)
	}
	return nil
}
