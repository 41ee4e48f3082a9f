package cli

// The fs commands: ls, cat, put and get of files in a sandbox.

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/spacesbx/space/sdk"
)

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
